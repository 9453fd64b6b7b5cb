"""Two builds of tpusync, the hot paths' operations one at a time, in two warm processes: is B
slower than A?

Whole benchmark runs (``benchmarks/ab.py``) differ by 5-25% between two runs of one build on a
shared 2-core VM: each run is a new process with its own memory placement, page cache and huge
pages. Here each side is a long-lived worker process (its ``site/`` first on ``PYTHONPATH``)
that sets up every fixture once and keeps it; the driver asks the two in turn (A then B, then B
then A, ...) to run one operation ``--batch`` times (after one untimed run), and takes each
batch's median. Per round, B's median is divided by A's. Beside the times, each operation's
calls in one run (Python functions, and C functions called from Python; a profile hook counts
them) are compared: a count the machine's load does not move, which shows what a change added to
a path's fixed cost (a trivial call is ~0.1 us here). A process keeps its own placement for
its life, which moves its figures by up to ~8% against another process of the same build, so
``--pairs`` fresh pairs of processes run ``--rounds`` rounds each (the first started
alternating). A figure is the median of all the paired ratios, with their spread (half the
interquartile range) and each pair's own median. The operations use only the public API both
builds share, at sizes where fixed costs show:

* transfer: D2H and H2D of 64 scattered 256 KiB blocks, and of 16 scattered 16 KiB blocks;
* DRAM tier: ``HostPool.put_from_device`` / ``get_to_device`` of 8 x 1 MiB blocks;
* disk and shared-FS tiers: ``put`` / ``get`` of 8 x 1 MiB blocks from and to DRAM;
* prefix loads: a 1024-token prompt of the test model served from DRAM and from disk (the
  load's seconds and the time to first token);
* network: a loopback pull of 8 x 2 MiB blocks (``BlockClient.pull``, each block verified) and
  a push of them to a store node (``StoreNodePool.put``);
* weights: ``publish`` of a 16 MiB tree, a subscriber's ``pull`` of it (its pool file, then
  over TCP) and ``commit``;
* controls: the test model's prompt computed without the store, and a 16 MiB ``np.copyto``:
  code neither build changes, so their ratios show this harness's own noise.

    python benchmarks/ab_ops.py --a /work/ab/before --b /work/ab/after [--pairs 4]
        [--rounds 6] [--batch 10] [--only prefix,network] [--threshold 0.03] [--json FILE]

``--a`` / ``--b`` are directories holding ``site/`` (an unpacked wheel), as for ``ab.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()

# --- the worker: one build, every fixture set up once -------------------------------------------


def _fixtures() -> tuple[dict[str, Any], Any]:
    """Every operation, by name (a callable returning ``{figure: seconds}``), and what closes
    them all; a setup that fails closes what it made and removes its directories."""
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="tpusync-ab-ops-"))
    shm = Path(tempfile.mkdtemp(prefix="tpusync-ab-ops-", dir="/dev/shm"))
    closers: list[Any] = []

    def close() -> None:
        for closer in reversed(closers):
            closer()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    try:
        return _set_up(work, shm, closers), close
    except BaseException:
        close()
        raise


def _set_up(work: Path, shm: Path, closers: list[Any]) -> dict[str, Any]:
    """The fixtures, made in ``work`` and ``shm``; each thing to close is added to
    ``closers``."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpusync import DevicePool, HostBuffer, transfer
    from tpusync.cluster import BlockClient, BlockServer, StoreNodePool, StoreServer
    from tpusync.kv import DiskTier, DramTier, KVStoreConfig
    from tpusync.testing import model as M
    from tpusync.testing.engine import ToyEngine
    from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout, SharedFsPool
    from tpusync.weights import Publisher, Subscriber, WeightsClientOptions, WeightsPoolOptions

    secret = bytes(range(32))
    rng = np.random.default_rng(7)
    ops: dict[str, Any] = {}

    def timed(call: Any, figure: str) -> Any:
        def run() -> dict[str, float]:
            start = time.perf_counter()
            call()
            return {figure: time.perf_counter() - start}

        return run

    # transfer: scattered blocks between a device pool and a host buffer
    for block_kib, n in ((256, 64), (16, 16)):
        shape = (n, block_kib * 512)
        host = HostBuffer(shape, "bfloat16")
        host.array.view(np.uint16)[...] = rng.integers(0, 2**16, shape, dtype=np.uint16)
        pool = DevicePool(jax.device_put(host.array, may_alias=False))
        order, identity = rng.permutation(n), np.arange(n)

        def d2h(pool=pool, host=host, order=order, identity=identity) -> None:
            transfer(pool, host, src_blocks=order, dst_blocks=identity).result()

        def h2d(pool=pool, host=host, order=order, identity=identity) -> None:
            transfer(host, pool, src_blocks=identity, dst_blocks=order).result()

        label = f"{n} x {block_kib} KiB"
        ops[f"transfer d2h {label}"] = timed(d2h, f"transfer d2h {label}")
        ops[f"transfer h2d {label}"] = timed(h2d, f"transfer h2d {label}")

    # the tiers: 8 blocks of 1 MiB in 4 bf16 arrays, as a model's layers hold them
    n, block_bytes = 8, 1 << 20
    per_array = block_bytes // 4 // 2
    pools = [
        DevicePool(
            jax.device_put(
                rng.integers(0, 2**16, (2 * n, per_array), dtype=np.uint16).view(jax.numpy.bfloat16)
            )
        )
        for _ in range(4)
    ]
    layout = PoolLayout.from_pools("ab-ops", pools)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    src_blocks, dst_blocks = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    dram = HostPool(layout, n)
    target = HostPool(layout, n)
    closers += [dram.close, target.close]

    def dram_put() -> dict[str, float]:
        dram.delete(keys)
        start = time.perf_counter()
        dram.put_from_device(keys, pools, src_blocks)
        return {"dram put 8 x 1 MiB": time.perf_counter() - start}

    ops["dram put"] = dram_put
    ops["dram get"] = timed(
        lambda: dram.get_to_device(keys, pools, dst_blocks), "dram get 8 x 1 MiB"
    )
    dram.put_from_device(keys, pools, src_blocks)
    (work / "disk").mkdir()
    (work / "shared").mkdir()
    disk = DiskPool(layout, n, str(work / "disk"))
    shared = SharedFsPool(layout, str(work / "shared"))
    closers += [disk.close, shared.close]
    for name, tier in (("disk", disk), ("shared fs", shared)):

        def put(tier=tier, name=name) -> dict[str, float]:
            tier.delete(keys)
            start = time.perf_counter()
            tier.put(keys, dram)
            return {f"{name} put 8 x 1 MiB": time.perf_counter() - start}

        def get(tier=tier, name=name) -> dict[str, float]:
            target.delete(keys)
            start = time.perf_counter()
            tier.get(keys, target)
            return {f"{name} get 8 x 1 MiB": time.perf_counter() - start}

        ops[f"{name} put"], ops[f"{name} get"] = put, get
        put()

    # prefix loads: the test model's 1024-token prompt, as benchmarks/prefix_cache.py serves it
    tokens = 1024
    per_seq = M.blocks_needed(M.ModelConfig(), tokens + 32)
    config = M.ModelConfig(
        n_kv_heads=8, head_dim=32, max_blocks_per_seq=per_seq, num_blocks=2 * per_seq + 16
    )
    blocks = M.blocks_needed(config, tokens)
    engine = ToyEngine(
        config,
        KVStoreConfig(
            model_id="ab-ops",
            block_size=config.block_size,
            dram=DramTier(2 * blocks + 16),
            tiers=(DiskTier(work / "kv-disk", 2 * blocks + 16, create=True),),
        ),
    )
    closers.append(engine.close)
    engine.warmup(tokens, 1, cold=True)
    prompt = np.random.default_rng(7).integers(0, 512, tokens).astype(np.int32)
    engine.generate(prompt, 1, use_cache=False, boundary=tokens - 1)
    engine.store.flush()

    def served(tier: str) -> dict[str, float]:
        if tier == "disk":
            engine.store.evict(prompt, tier="dram")
        request = engine.generate(prompt, 1)
        if request.lookup_tiers[0] != tier:
            raise RuntimeError(f"the prompt was served from {request.lookup_tiers[0]}, not {tier}")
        return {
            f"prefix {tier} load 1024 tokens": request.load.seconds,
            f"prefix {tier} ttft 1024 tokens": request.ttft_s,
        }

    def cold() -> dict[str, float]:
        request = engine.generate(prompt, 1, use_cache=False, save=False, boundary=tokens - 1)
        return {"control: model ttft 1024 tokens": request.ttft_s}

    ops["prefix dram"] = lambda: served("dram")
    ops["prefix disk"] = lambda: served("disk")
    ops["control model"] = cold

    # network: a pull from a block server and a push to a store node, loopback, one connection
    net_layout = PoolLayout("ab-ops-net", (ArrayLayout("kv", "uint8", (2 << 20,), 0, 1),))
    net_keys = [i.to_bytes(4, "little") * 6 for i in range(8)]
    served_pool, pulled = HostPool(net_layout, 8), HostPool(net_layout, 8)
    reservation = served_pool.reserve(net_keys)
    for i, slot in enumerate(reservation.slots.tolist()):
        with served_pool.slot_memory(slot) as memory:
            memory[: 2 << 20] = np.random.default_rng([7, i]).bytes(2 << 20)
    served_pool.commit(reservation, served_pool.hash_slots(reservation.slots))
    server = BlockServer(served_pool, secret=secret, host="127.0.0.1")
    client = BlockClient(addresses=[f"127.0.0.1:{server.port}"], connections=1, secret=secret)
    node = StoreServer(32 << 20, secret=secret)
    pusher = StoreNodePool(node.address, layout=net_layout, secret=secret, connections=1)
    closers += [pusher.close, node.close, client.close, server.close, served_pool.close]
    closers.append(pulled.close)

    def pull() -> dict[str, float]:
        pulled.delete(net_keys)
        start = time.perf_counter()
        loaded = client.pull(net_keys, pulled)
        took = time.perf_counter() - start
        if not all(loaded):
            raise RuntimeError("a block was not pulled")
        return {"network pull 8 x 2 MiB": took}

    def push() -> dict[str, float]:
        pusher.delete(net_keys)
        start = time.perf_counter()
        stored = pusher.put(net_keys, served_pool)
        took = time.perf_counter() - start
        if stored != len(net_keys):
            raise RuntimeError("a block was not pushed")
        return {"network push 8 x 2 MiB": took}

    ops["network pull"], ops["network push"] = pull, push

    # weights: a 16 MiB tree on a 4x1 mesh, subscribed on a 2x2 mesh
    devices = np.array(jax.devices("cpu")[:4])
    trained = NamedSharding(Mesh(devices.reshape(4, 1), ("x", "y")), P("x", None))
    sampled = NamedSharding(Mesh(devices.reshape(2, 2), ("x", "y")), P("x", "y"))
    shapes = {"embed": (2048, 1024), "head": (1024, 2048)}
    tree = {
        k: jax.device_put(
            rng.standard_normal(s, dtype=np.float32).astype(jax.numpy.bfloat16), trained
        )
        for k, s in shapes.items()
    }
    spec = {
        k: jax.ShapeDtypeStruct(s, jax.numpy.bfloat16, sharding=sampled) for k, s in shapes.items()
    }
    publisher = Publisher(
        "ab-ops",
        secret=secret,
        pool=WeightsPoolOptions(keep=2, capacity_bytes=128 << 20, shm_dir=str(shm)),
    )
    subscribers = {
        "pool file": Subscriber("ab-ops", spec, secret=secret, address=publisher.address),
        "tcp": Subscriber(
            "ab-ops",
            spec,
            secret=secret,
            address=publisher.address,
            client=WeightsClientOptions(same_host=False),
        ),
    }
    closers += [s.close for s in subscribers.values()] + [publisher.close]
    version = iter(range(1, 1 << 30))

    def weights() -> dict[str, float]:
        v = next(version)
        start = time.perf_counter()
        publisher.publish(tree, v)
        figures = {"weights publish 16 MiB": time.perf_counter() - start}
        for how, subscriber in subscribers.items():
            start = time.perf_counter()
            subscriber.pull(v)
            figures[f"weights pull ({how}) 16 MiB"] = time.perf_counter() - start
            start = time.perf_counter()
            subscriber.commit()
            figures[f"weights commit ({how})"] = time.perf_counter() - start
        return figures

    ops["weights"] = weights

    source = np.random.default_rng(1).bytes(16 << 20)
    copy_from = np.frombuffer(source, np.uint8)
    copy_to = np.empty_like(copy_from)
    ops["control copy"] = timed(lambda: np.copyto(copy_to, copy_from), "control: np.copyto 16 MiB")

    return ops


def _python_calls(run: Any) -> int:
    """The calls a run makes, the fewest of three (Python functions, and C functions called from
    Python): a count that, unlike a time, does not move with the machine's load. Counted by a
    profile hook, as cProfile's table merges functions of one name and line (every dataclass
    ``__init__``)."""
    count = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    counts = []
    for _ in range(3):  # the fewest: a run that also refreshed a cache is not the path
        count = 0
        sys.setprofile(hook)
        try:
            run()
        finally:
            sys.setprofile(None)
        counts.append(count)
    return min(counts)


def worker() -> int:
    """Answers ``{"op": name, "n": count}`` lines with ``{"figures": {figure: [seconds]}}``,
    and ``{"op": name, "calls": true}`` with ``{"calls": count}``."""
    ops, close = _fixtures()
    print(json.dumps({"ops": sorted(ops)}), flush=True)
    try:
        for line in sys.stdin:
            ask = json.loads(line)
            run = ops[ask["op"]]
            run()  # untimed: the other process ran last
            if ask.get("calls"):
                print(json.dumps({"calls": _python_calls(run)}), flush=True)
                continue
            figures: dict[str, list[float]] = {}
            for _ in range(ask["n"]):
                for figure, seconds in run().items():
                    figures.setdefault(figure, []).append(seconds)
            print(json.dumps({"figures": figures}), flush=True)
    finally:
        close()
    return 0


# --- the driver -------------------------------------------------------------------------------


class Side:
    """One build's worker process."""

    def __init__(self, label: str, root: Path) -> None:
        site = root / "site"
        if not (site / "tpusync").is_dir():
            raise SystemExit(f"--{label.lower()}: {site}/tpusync not found (unzip a wheel there)")
        env = {**os.environ, "PYTHONPATH": str(site)}
        self.label = label
        self.process = subprocess.Popen(
            [sys.executable, str(HERE), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=str(root),
        )
        self.ops = self._answer()["ops"]

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"{self.label}: the worker ended (exit {self.process.wait()})")
        return json.loads(line)

    def run(self, op: str, n: int) -> dict[str, float]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, "n": n}) + "\n")
        self.process.stdin.flush()
        return {k: statistics.median(v) for k, v in self._answer()["figures"].items()}

    def python_calls(self, op: str) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, "calls": True}) + "\n")
        self.process.stdin.flush()
        return int(self._answer()["calls"])

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def _spread(values: list[float]) -> float:
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--a", type=Path, help="the baseline: a directory holding site/")
    parser.add_argument("--b", type=Path, help="the change: a directory holding site/")
    parser.add_argument("--pairs", type=int, default=4, help="fresh pairs of processes")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per pair")
    parser.add_argument("--batch", type=int, default=10, help="runs of an operation per turn")
    parser.add_argument("--only", default="", help="operations whose name starts so (a,b,...)")
    parser.add_argument("--threshold", type=float, default=0.03)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.worker:  # imports nothing of this checkout's: the side's build runs here
        return worker()
    sys.path.insert(0, str(HERE.parent))
    from _common import commit_of, write_json

    if args.a is None or args.b is None:
        parser.error("--a and --b are required")
    if args.pairs < 1 or args.rounds < 1 or args.pairs * args.rounds < 3 or args.batch < 1:
        parser.error("--pairs x --rounds must be at least 3, and --batch at least 1")
    prefixes = [p.strip() for p in args.only.split(",") if p.strip()]
    medians: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, list[float]] = {}
    pair_changes: dict[str, list[float]] = {}  # each pair of processes' own paired median
    calls: dict[str, dict[str, int]] = {}  # per operation: Python calls of one run, per side
    for pair in range(args.pairs):
        # fresh processes, the first started alternating: a process's own placement (its
        # mappings, its files' pages) can move its figures by several percent for its life
        started = [Side("A", args.a), Side("B", args.b)][:: 1 if pair % 2 == 0 else -1]
        sides = sorted(started, key=lambda side: side.label)
        here: dict[str, list[float]] = {}
        try:
            ops = [o for o in sides[0].ops if o in sides[1].ops]
            ops = [o for o in ops if not prefixes or any(o.startswith(p) for p in prefixes)]
            for round_ in range(args.rounds):
                for op in ops:
                    order = sides if (round_ + ops.index(op)) % 2 == 0 else sides[::-1]
                    got = {side.label: side.run(op, args.batch) for side in order}
                    for figure in got["A"]:
                        medians.setdefault(figure, {"A": [], "B": []})
                        for label in ("A", "B"):
                            medians[figure][label].append(got[label][figure])
                        ratio = got["B"][figure] / got["A"][figure]
                        ratios.setdefault(figure, []).append(ratio)
                        here.setdefault(figure, []).append(ratio)
                print(
                    f"pair {pair + 1}/{args.pairs}, round {round_ + 1}/{args.rounds}",
                    file=sys.stderr,
                    flush=True,
                )
            if pair == 0:
                for op in ops:
                    calls[op] = {side.label: side.python_calls(op) for side in sides}
        finally:
            for side in started:
                side.close()
        for figure, values in here.items():
            pair_changes.setdefault(figure, []).append(1 - statistics.median(values))
    rows = []
    for figure, per_side in medians.items():
        change = 1 - statistics.median(ratios[figure])  # + : B takes less time
        rows.append(
            {
                "figure": figure,
                "a_ms": 1e3 * statistics.median(per_side["A"]),
                "b_ms": 1e3 * statistics.median(per_side["B"]),
                "b_faster_by": change,
                "spread": _spread(ratios[figure]),
                "pair_changes": pair_changes[figure],
                "worse": change < -args.threshold,
                "a_ms_runs": [1e3 * s for s in per_side["A"]],
                "b_ms_runs": [1e3 * s for s in per_side["B"]],
            }
        )
    print(f"\n{'figure':44} {'A ms':>9} {'B ms':>9} {'B faster by':>12} {'spread':>7}")
    for row in rows:
        print(
            f"{row['figure']:44} {row['a_ms']:9.3f} {row['b_ms']:9.3f} "
            f"{100 * row['b_faster_by']:+11.1f}% {100 * row['spread']:6.1f}%"
            f"{'  WORSE' if row['worse'] else ''}"
        )
    print(f"\n{'operation (one run)':44} {'A calls':>9} {'B calls':>9} {'B - A':>7}")
    for op, per_side in calls.items():
        print(f"{op:44} {per_side['A']:9d} {per_side['B']:9d} {per_side['B'] - per_side['A']:+7d}")
    worse = [r["figure"] for r in rows if r["worse"]]
    print(
        f"\n{args.pairs} pairs of processes x {args.rounds} rounds x {args.batch} runs per side, "
        "paired medians; "
        + (f"worse by more than {100 * args.threshold:.0f}%: {worse}" if worse else "none worse")
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "ab_ops",
                "a": str(args.a),
                "b": str(args.b),
                "a_commit": commit_of(args.a / "benchmarks"),
                "b_commit": commit_of(args.b / "benchmarks"),
                "pairs": args.pairs,
                "rounds": args.rounds,
                "batch": args.batch,
                "python_calls": calls,
                "threshold": args.threshold,
                "rows": rows,
            },
        )
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
