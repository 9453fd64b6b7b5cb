"""RL weight sync (issue 24): a trainer process (8 CPU devices, mesh 8x1) publishes ~1.4 GiB of
bf16 over 100 leaves; sampler processes (mesh 2x4) pull each version and commit it, one from the
trainer's /dev/shm (same host) and one over the data plane (loopback TCP), checksums on. In one
run beside: the memory limit (:class:`~tpusync._src.bench.limits.MemoryLimit`: a copy of the same
bytes on all cores) and the TCP limit (2 streams over loopback: the better of our own sender
and receiver pair, the median of its runs beside each version, and one iperf3 process per
stream), a plain ``BlockClient`` pull of the same
chunks (the data plane's own speed), ``jax.experimental.transfer`` (which pulls only into the
trainer's own layout) plus a ``device_put`` into 2x4 in the sampler, orbax saving to /dev/shm
in the trainer plus restoring into the 2x4 shardings in the sampler (``tpusync[bench]``
installs orbax), and an in-process ``jax.device_put`` 8x1 -> 2x4 of the same tree (after a
warm-up, as many runs as versions; the median run is the peer).

Each sampler makes its next version's buffers after a commit, off the pull's path (as it would
during a training step); the benchmark waits for that (``prepare``) before it times anything
else.

"End to end" is ``publish()`` returning in the trainer's time plus ``pull()`` and ``commit()``
in the sampler's (the commands between processes are not counted); compilation is excluded
(the first version is a warm-up).

Then the fan-out part (:mod:`tpusync._src.bench.weights_fanout`): 1, 2, 4 and 8 samplers on
hosts with shaped links, through chained relays, beside one sampler alone and N sequential
pulls (needs root, iproute2 and iperf3; else it says why it is skipped).

    python benchmarks/weights.py [--scale 1100] [--repeats 5] [--fanout-mib 128]
        [--fanout-counts 1,2,4,8] [--rate-mbit 1000] [--skip-fanout] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import secrets
import shutil
import socket
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.bench.common import Run, median, print_table, spread, timed
from tpusync._src.bench.limits import Iperf3PerStream, MemoryLimit, loopback_tcp
from tpusync._src.bench.weights_fanout import HEADERS as FANOUT_HEADERS
from tpusync._src.bench.weights_fanout import fanout, fanout_rows
from tpusync._src.cluster.registry import MemoryRegistry, RegistryServer
from tpusync._src.testing.weights_procs import Child, stop_together, tree_spec
from tpusync._src.tiers.dram.shm_admin import remove_pool
from tpusync._src.weights.plan import leaf_plan
from tpusync.errors import TpuSyncError

QUICK = ["--scale", "64", "--repeats", "2", "--fanout-mib", "16", "--fanout-counts", "1,2"]
LEAVES = 100


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scale", type=int, default=1100, help="last-axis multiplier")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=4, help="the publisher's chunk")
    parser.add_argument("--fanout-mib", type=int, default=128, help="the fan-out part's tree")
    parser.add_argument("--fanout-counts", default="1,2,4,8", help="samplers in each fan-out run")
    parser.add_argument("--rate-mbit", type=int, default=1000, help="each host's link, shaped")
    parser.add_argument("--skip-fanout", action="store_true", help="skip the fan-out part")
    parser.add_argument("--json", default=None, help="default: the results scheme")
    return parser


def _fanout_unavailable(args: argparse.Namespace) -> str | None:
    if args.skip_fanout:
        return "skipped (--skip-fanout)"
    if os.geteuid() != 0:
        return "skipped: needs root (network namespaces, veth, tc)"
    missing = [tool for tool in ("ip", "tc", "iperf3") if shutil.which(tool) is None]
    if missing:
        return f"skipped: {' and '.join(missing)} not installed (apt-get install iproute2 iperf3)"
    return None


def _grid_boxes(
    shape: tuple[int, ...], parts: tuple[int, int]
) -> list[tuple[tuple[int, int], ...]]:
    """The shard boxes of a 2-D mesh ``parts`` over ``shape`` (1-D leaves: the first only)."""
    if len(shape) == 1:
        step = shape[0] // parts[0]
        return [((i * step, (i + 1) * step),) for i in range(parts[0])]
    rows, cols = shape[0] // parts[0], shape[1] // parts[1]
    return [
        ((i * rows, (i + 1) * rows), (j * cols, (j + 1) * cols))
        for i in range(parts[0])
        for j in range(parts[1])
    ]


def verified_unit(scale: int, chunk_bytes: int) -> dict[str, float]:
    """What each choice of verified unit costs for the benchmark's tree, 8x1 -> 2x4:

    * over-fetch of whole chunks: the chunk bytes a sampler process holding half of the 2x4
      devices (one of two hosts) reads, over the bytes its shards need (1.0 for a process
      holding all of them);
    * ranges: how many byte ranges (runs) a per-range scheme would ask for and checksum, and
      their mean size;
    * hashing cost: GB/s of ``sum64`` over those runs one by one (each its own checksum, as a
      server checksumming each requested range would) beside one stream per chunk, on one core
      over the same 256 MiB.
    """
    spec = tree_spec(LEAVES, scale, "bfloat16")
    offset, needed, touched, runs = 0, 0, set(), []
    for _, shape, _ in spec:
        source = _grid_boxes(shape, (8, 1))
        target = _grid_boxes(shape, (2, 4))
        plan = leaf_plan(shape, 2, source, target)
        starts = [offset]
        for box in source[:-1]:
            starts.append(starts[-1] + int(np.prod([b - a for a, b in box])) * 2)
        for t, pieces in enumerate(plan.pieces):
            for piece in pieces:
                src, _, run = piece.runs()
                if t < len(plan.pieces) // 2:  # the first host's half of the devices
                    needed += len(src) * run
                    first = (starts[piece.source] + src) // chunk_bytes
                    last = (starts[piece.source] + src + run - 1) // chunk_bytes
                    for a, b in zip(first.tolist(), last.tolist(), strict=True):
                        touched.update(range(a, b + 1))
                runs.append(np.full(len(src), run, dtype=np.int64))
        offset = starts[-1] + int(np.prod([b - a for a, b in source[-1]])) * 2
    sizes = np.concatenate(runs)
    sample = 256 << 20
    memory = np.random.default_rng(0).integers(0, 256, sample, dtype=np.uint8)
    lengths = sizes[np.cumsum(sizes) <= sample].astype(np.uint64)
    starts_ = (memory.ctypes.data + np.cumsum(lengths) - lengths).astype(np.uint64)
    per_range = timed(lambda: _core.sum64_regions(starts_, lengths))
    chunks = np.arange(0, sample, chunk_bytes, dtype=np.uint64)
    per_chunk = timed(
        lambda: _core.sum64_regions(
            memory.ctypes.data + chunks, np.full(len(chunks), chunk_bytes, np.uint64)
        )
    )
    return {
        "overfetch_half_host": len(touched) * chunk_bytes / needed,
        "ranges": float(len(sizes)),
        "mean_range_bytes": float(sizes.mean()),
        "hash_per_range_gbps": float(lengths.sum()) / per_range / 1e9,
        "hash_per_chunk_gbps": sample / per_chunk / 1e9,
    }


def trainer_processes(counts: list[int], scale: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each ``publish`` (the slowest process's: it is a collective) of the
    benchmark's tree by a trainer of each of ``counts`` ``jax.distributed`` processes, 8 CPU
    devices across them, the tree sharded 8x1 over all of them (after a warm-up version)."""
    secret = secrets.token_bytes(32)
    env = {"TPUSYNC_TEST_SECRET": secret.hex()}
    found: dict[str, list[float]] = {}
    with RegistryServer(MemoryRegistry(), secret=secret) as server:
        for count in counts:
            found[str(count)] = _trainer_run(count, scale, repeats, env, server.address)
    return found


def _trainer_run(
    count: int, scale: int, repeats: int, env: dict[str, str], registry: str
) -> list[float]:
    """:func:`trainer_processes` for one count."""
    name = f"bench-mc-{uuid.uuid4().hex[:8]}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    common = [name, registry, coordinator]
    args = [str(LEAVES), str(scale), "bfloat16"]
    children = [
        Child(["multitrainer", *common, str(i), str(count), *args], env) for i in range(count)
    ]
    try:
        for child in children:
            child.answer(timeout=300)
        times = []
        for version in range(repeats + 1):  # version 0: the warm-up
            for command in ("make", "publish"):  # the arrays made before the timed publish
                for child in children:
                    child.send(f"{command} {version}")
                answers = [child.answer(timeout=600) for child in children]
                if any("error" in a for a in answers):
                    raise RuntimeError(f"a trainer process of {count}: {answers}")
            if version:
                times.append(max(a["seconds"] for a in answers))
        return times
    finally:
        stop_together(children)
        for i in range(count):
            with contextlib.suppress(TpuSyncError):
                remove_pool(f"weights-{name}" + (f"-p{i}" if count > 1 else ""), force=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = Run("weights")
    secret = secrets.token_bytes(32)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    registry = RegistryServer(MemoryRegistry(), secret=secret)
    env = {"TPUSYNC_TEST_SECRET": secret.hex()}
    common = [name, registry.address, str(LEAVES), str(args.scale), "bfloat16"]
    children: list[Any] = []
    limit: MemoryLimit | None = None
    times: dict[str, list[float]] = {
        k: []
        for k in (
            *("publish", "shm pull", "net pull", "raw pull", "shm e2e", "net e2e"),
            *("jax pull", "jax e2e", "orbax save", "orbax e2e"),
        )
    }
    have_orbax = importlib.util.find_spec("orbax") is not None
    scratch = tempfile.mkdtemp(prefix="tpusync-bench-orbax-", dir="/dev/shm")
    commits: list[float] = []
    tcp_runs: list[float] = []
    try:
        trainer = Child(["trainer", *common, "1", str(args.chunk_mib)], env)
        shm = Child(["sampler", *common[:2], "2x4", *common[2:], "1"], env)
        net = Child(["sampler", *common[:2], "2x4", *common[2:], "0"], env)
        children += [trainer, shm, net]
        for child in children:
            child.answer(timeout=300)
        nbytes = 0
        published: dict[str, Any] = {}
        # tpusync's paths first, the peers after: each tool measured on a machine the other
        # has left quiet (an orbax save just before slowed the next pull)
        for version in range(args.repeats + 1):  # version 0: the warm-up
            published = trainer.ask(f"{'publish' if version == 0 else 'again'} {version}", 600)
            nbytes = int(published["nbytes"])
            if limit is None:
                limit = MemoryLimit(nbytes)
            limit.sample(repeats=3)
            pulls = {}
            for label, child in (("shm", shm), ("net", net)):
                answer = child.ask(f"pull {version} nodigest", 600)
                if "error" in answer:
                    raise RuntimeError(f"{label} sampler: {answer}")
                pulls[label] = answer
                child.ask("prepare", 600)  # its next buffers, made before anything else runs
            raw = net.ask(f"rawpull {version} {published['chunks']} {published['address']}", 600)
            if version == 0:
                continue
            # the TCP limit beside each version's pulls (the children idle): it varies from
            # one minute to the next here as much as the pulls do
            tcp_runs.append(loopback_tcp(2, nbytes).gbps)
            times["publish"].append(published["seconds"])
            for label, answer in pulls.items():
                times[f"{label} pull"].append(answer["seconds"])
                e2e = published["seconds"] + answer["seconds"] + answer["commit_seconds"]
                times[f"{label} e2e"].append(e2e)
                commits.append(answer["commit_seconds"])
            times["raw pull"].append(raw["seconds"])
        last = args.repeats
        for round_ in range(args.repeats + 1):  # round 0: the warm-up
            offer = trainer.ask(f"jaxoffer {last + 1 + round_}", 600)
            jax_pull = net.ask(f"jaxpull {last + 1 + round_} {offer['address']}", 600)
            orbax: dict[str, Any] = {}
            if have_orbax:
                directory = os.path.join(scratch, f"r{round_}")
                orbax["save"] = trainer.ask(f"orbaxsave {directory}", 600)["seconds"]
                orbax["restore"] = net.ask(f"orbaxrestore {directory}", 600)["seconds"]
                shutil.rmtree(directory, ignore_errors=True)
            if round_ == 0:
                continue
            times["jax pull"].append(jax_pull["pull_seconds"])
            times["jax e2e"].append(jax_pull["pull_seconds"] + jax_pull["reshard_seconds"])
            if orbax:
                times["orbax save"].append(orbax["save"])
                times["orbax e2e"].append(orbax["save"] + orbax["restore"])
        for child in (shm, net):  # their memory, before the trainer holds a sampler too
            child.stop()
        times["device_put"] = trainer.ask(f"reshard {args.repeats}", 600)["reshard_seconds"]
        first = 2 * (args.repeats + 1)
        inproc = trainer.ask(
            "inproc " + " ".join(str(first + i) for i in range(args.repeats + 1)), 600
        )["seconds"]
        times["in-process e2e"] = inproc
        for child in children:  # iperf3 runs with nothing else running
            child.stop()
        tcp = median(tcp_runs)
        iperf = 0.0
        if shutil.which("iperf3"):
            with Iperf3PerStream(2) as servers:
                iperf = median([servers.gbps(nbytes) for _ in range(3)])
        assert limit is not None
        found = limit.result()
    finally:
        for child in children:
            child.stop()
        registry.close()
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(TpuSyncError):  # left by a trainer that was killed
            remove_pool(f"weights-{name}", force=True)
        if limit is not None:
            limit.close()
    gb = nbytes / 1e9
    runs = {k: [gb / s for s in v] for k, v in times.items() if v}
    gbps = {k: median(v) for k, v in runs.items()}
    missing = "not installed: pip install 'tpusync[bench]'"
    orbax_rows = [
        ["orbax save to /dev/shm (trainer)", spread(runs["orbax save"]), "", ""],
        ["orbax save + restore into 2x4 (end to end)", spread(runs["orbax e2e"]), "", ""],
    ] if have_orbax else [["orbax save + restore", missing, "", ""]]  # fmt: skip
    lim = found.gbps
    net_lim = max(tcp, iperf)
    rows = [
        [f"memory limit ({found.method}, all cores)", f"{lim:.2f}", "", ""],
        [f"TCP limit, 2 streams (ours {tcp:.2f}, iperf3 {iperf:.2f})", f"{net_lim:.2f}", "", ""],
        ["jax.device_put 8x1 -> 2x4, in process", spread(runs["device_put"]), "", ""],
        ["BlockClient pull of the chunks, TCP (2 connections)", spread(runs["raw pull"]), "", ""],
        ["jax.experimental.transfer pull (8x1 -> 8x1)", spread(runs["jax pull"]), "", ""],
        ["jax.experimental.transfer + device_put into 2x4", spread(runs["jax e2e"]), "", ""],
        *orbax_rows,
        ["publish (stage + checksum + announce)", spread(runs["publish"]), gbps["publish"] / lim, ""],  # noqa: E501
        ["same host: pull + verify + reshard", spread(runs["shm pull"]), gbps["shm pull"] / lim, ""],  # noqa: E501
        ["same host: end to end", spread(runs["shm e2e"]), gbps["shm e2e"] / lim,
         gbps["shm e2e"] / gbps["device_put"]],
        ["  same host e2e x jax.experimental.transfer + device_put", "", "",
         gbps["shm e2e"] / gbps["jax e2e"]],
        ["  same host e2e x orbax", "", "",
         gbps["shm e2e"] / gbps["orbax e2e"] if have_orbax else "-"],
        ["in process: publish -> commit into 2x4", spread(runs["in-process e2e"]),
         gbps["in-process e2e"] / lim, gbps["in-process e2e"] / gbps["device_put"]],
        ["network: pull + verify + reshard (x TCP limit)", spread(runs["net pull"]),
         gbps["net pull"] / net_lim, gbps["net pull"] / gbps["raw pull"]],
        ["network: end to end (x TCP limit)", spread(runs["net e2e"]), gbps["net e2e"] / net_lim,
         gbps["net e2e"] / gbps["device_put"]],
        ["  network e2e x jax.experimental.transfer + device_put", "", "",
         gbps["net e2e"] / gbps["jax e2e"]],
        ["  network e2e x orbax", "", "",
         gbps["net e2e"] / gbps["orbax e2e"] if have_orbax else "-"],
    ]  # fmt: skip
    print(f"{nbytes / 2**30:.2f} GiB of bf16 over {LEAVES} leaves, trainer 8x1 -> sampler 2x4, "
          f"{os.cpu_count()} cores; commit median {median(commits) * 1e6:.0f} us")  # fmt: skip
    print_table(
        ["path", "GB/s (runs)", "x limit", "x peer (device_put; net pull: x BlockClient)"],
        rows,
        limit_columns=(2,),
    )
    unit = verified_unit(args.scale, args.chunk_mib << 20)
    print(
        f"verified unit: whole {args.chunk_mib} MiB chunks read by a sampler holding half the "
        f"2x4 devices: {unit['overfetch_half_host']:.3f}x the bytes it needs; per-range "
        f"checksums: {unit['ranges']:.0f} ranges of {unit['mean_range_bytes'] / 1024:.1f} KiB "
        f"on average, hashed one by one at {unit['hash_per_range_gbps']:.2f} GB/s a core "
        f"beside {unit['hash_per_chunk_gbps']:.2f} GB/s per chunk"
    )
    print(
        "trainer of 1, 2 and 4 jax.distributed processes publishing the same tree ...", flush=True
    )
    processes = trainer_processes([1, 2, 4], args.scale, min(args.repeats, 3))
    one = median(processes["1"])
    print_table(
        ["trainer processes (8 CPU devices in all)", "publish GB/s (runs)", "x 1 process"],
        [[f"{c} process{'es' if c != '1' else ''}", spread([nbytes / t / 1e9 for t in v]),
          one / median(v)] for c, v in processes.items()],
    )  # fmt: skip
    why = _fanout_unavailable(args)
    fanned: dict[str, Any] | None = None
    if why is None:
        counts = [int(c) for c in args.fanout_counts.split(",")]
        print(f"fan-out: {args.fanout_mib} MiB, samplers {counts}, {args.rate_mbit} Mbit/s "
              "links ...", flush=True)  # fmt: skip
        fanned = fanout(args.fanout_mib, counts, args.repeats, args.rate_mbit)
        print_table(FANOUT_HEADERS, fanout_rows(fanned), limit_columns=(2,))
    else:
        print(f"fan-out: {why}")
    run.write(
        args.json,
        {
            "fanout": fanned if fanned is not None else {"skipped": why},
            "trainer_processes_publish_seconds": processes,
            "verified_unit": unit,
            "nbytes": nbytes,
            "leaves": LEAVES,
            "limit": {"gbps": lim, "method": found.method},
            "tcp_limit": {"gbps": net_lim, "ours": tcp, "ours_runs": tcp_runs, "iperf3": iperf},
            "reshard_device_put_gbps": gbps["device_put"],
            "gbps": gbps,
            "runs_gbps": runs,
            "commit_seconds_median": median(commits),
        },
    )
    return 0
