"""Device<->host GB/s of tpusync.transfer against the memory-copy limit and the pure-JAX path.

For each block size, moves ``--total-mib`` of scattered blocks (a random permutation, so nothing
merges into one big copy) between a device array and a prefaulted HostBuffer, in both
directions, with the native path, the pure-JAX path and, where its environment is set up
(``benchmarks/peers/setup.sh``), Google TPU Sync's KVCacheManager (``d2h``/``h2d`` of the same
blocks in another process: :mod:`tpusync._src.bench.peer_workers.tpu_sync_transfer`), interleaved
round by round with one sample of the memory limit (:class:`~tpusync._src.bench.limits.MemoryLimit`:
a copy of the same bytes on all cores, the best of memcpy and non-temporal stores; np.copyto is
shown beside it). Prints medians with their range and the ratios; writes JSON.

    python benchmarks/transfer.py [--total-mib 1024] [--repeats 5] [--json transfer.json]
        [--peers-dir benchmarks/peers]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tpusync._src.bench.common import Run, median, print_table, settle, spread, timed
from tpusync._src.bench.external import peer_state, start_peer
from tpusync._src.bench.limits import MemoryLimit
from tpusync._src.memory.device_pool import DevicePool
from tpusync._src.memory.host_buffer import HostBuffer
from tpusync._src.transfer import transfer

TRANSFER_BLOCK_SIZES_KIB = [64, 256, 1024, 4096, 16384]
QUICK = ["--total-mib", "64", "--repeats", "3", "--block-kib", "256", "4096"]
FIGURES = ("d2h_native", "d2h_jax", "h2d_native", "h2d_jax")
PEER_FIGURES = ("d2h_tpu_sync", "h2d_tpu_sync")
PEERS = {"jax": "pure-JAX engine", "tpu_sync": "Google TPU Sync"}


def parser(doc: str = __doc__ or "", json_default: str | None = None) -> argparse.ArgumentParser:
    """The command line both transfer benchmarks (CPU and GPU) take."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-kib", type=int, nargs="*", default=TRANSFER_BLOCK_SIZES_KIB)
    parser.add_argument("--json", default=json_default, help="default: the results scheme")
    parser.add_argument(
        "--peers-dir", default=None, help="the peers' environments (default: benchmarks/peers)"
    )
    return parser


def bench_block_size(
    block_kib: int,
    total: int,
    repeats: int,
    limit: MemoryLimit,
    peers_dir: str | None = None,
    notes: list[str] | None = None,
) -> dict:
    block_bytes = block_kib * 1024
    n_blocks = total // block_bytes
    shape = (n_blocks, block_bytes // 2)
    rng = np.random.default_rng(block_kib)
    host = HostBuffer(shape, "bfloat16")
    host.array.view(np.uint16)[...] = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    pool = DevicePool(jax.device_put(host.array, may_alias=False))
    order = rng.permutation(n_blocks)
    identity = np.arange(n_blocks)
    nbytes = n_blocks * block_bytes
    times: dict[str, list[float]] = {k: [] for k in FIGURES}

    def d2h(path: str) -> None:
        transfer(pool, host, src_blocks=order, dst_blocks=identity, path=path).result()

    def h2d(path: str) -> None:
        transfer(host, pool, src_blocks=identity, dst_blocks=order, path=path).result()

    with contextlib.ExitStack() as stack:
        tpu_sync = None
        if peer_state("tpu-sync", peers_dir) == "runs":
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tpusync-bench-"))
            config = {"blocks": n_blocks, "block_bytes": block_bytes, "seed": block_kib}
            tpu_sync, first = start_peer(stack, "tpu-sync", "tpu_sync_transfer", "transfer",
                                         config, log_dir, peers_dir)  # fmt: skip
            if notes is not None and not any(n.startswith("Google TPU Sync") for n in notes):
                notes.append(f"Google TPU Sync {first['tpu_sync']} on jax {first['jax']} "
                             f"({first['backend']} backend), in its own process")  # fmt: skip
            times.update({k: [] for k in PEER_FIGURES})
        settle()
        for path in ("native", "jax"):  # warm-up: compilation and first touches are not measured
            d2h(path)
            h2d(path)
        for _ in range(repeats):  # contenders interleaved, one limit sample per round
            limit.sample(repeats=3)  # the best of 3: what the machine can do
            times["d2h_native"].append(timed(lambda: d2h("native")))
            times["d2h_jax"].append(timed(lambda: d2h("jax")))
            times["h2d_native"].append(timed(lambda: h2d("native")))
            times["h2d_jax"].append(timed(lambda: h2d("jax")))
            if tpu_sync is not None:
                for way in ("d2h", "h2d"):
                    times[f"{way}_tpu_sync"].append(tpu_sync.request({"op": way})["seconds"])
    result: dict[str, Any] = {"block_kib": block_kib, "n_blocks": n_blocks, "bytes": nbytes}
    for key, seconds in times.items():
        result[f"{key}_gbps"] = nbytes / median(seconds) / 1e9
        result[f"{key}_gbps_runs"] = [nbytes / s / 1e9 for s in seconds]
    result["seconds"] = times
    return result


def add_limit(result: dict[str, Any], limit: MemoryLimit) -> None:
    """The limit's figures so far (every block size's rounds) and the ratios against it."""
    found = limit.result()
    result["limit_gbps"] = found.gbps
    result["limit_method"] = found.method
    result["limit_gbps_by_method"] = found.gbps_by_method
    result["copyto_gbps"] = limit.copyto_gbps()
    for key in FIGURES:
        result[f"{key}_x_limit"] = result[f"{key}_gbps"] / found.gbps
    for way in ("d2h", "h2d"):
        result[f"{way}_native_x_jax"] = result[f"{way}_native_gbps"] / result[f"{way}_jax_gbps"]
        peers = {p: result[f"{way}_{p}_gbps"] for p in PEERS if f"{way}_{p}_gbps" in result}
        best = max(peers, key=peers.__getitem__)
        result[f"{way}_best_peer"] = PEERS[best]
        result[f"{way}_native_x_peer"] = result[f"{way}_native_gbps"] / peers[best]


def table(results: list[dict[str, Any]], total_mib: int, repeats: int) -> None:
    rows = []
    for r in results:
        for way in ("d2h", "h2d"):
            peer = r.get(f"{way}_tpu_sync_gbps_runs")
            rows.append(
                [
                    f"{r['block_kib']} KiB",
                    way.upper(),
                    f"{r['limit_gbps']:.2f} {r['limit_method']}",
                    r["copyto_gbps"],
                    spread(r[f"{way}_native_gbps_runs"]),
                    r[f"{way}_native_x_limit"],
                    spread(r[f"{way}_jax_gbps_runs"]),
                    spread(peer) if peer else "skipped",
                    f"{r[f'{way}_native_x_peer']:.2f} ({r[f'{way}_best_peer']})",
                ]
            )
    print(
        f"\n{total_mib} MiB per transfer, scattered blocks, median (min-max) of {repeats} "
        "(GB/s; x = ratio); peers: the pure-JAX engine and Google TPU Sync; x peer: native "
        "against the faster peer"
    )
    print_table(
        ["block", "way", "limit", "np.copyto", "native", "x limit", "jax", "TPU Sync", "x peer"],
        rows,
        limit_columns=(5,),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = Run("transfer")
    total = args.total_mib * 2**20
    results = []
    notes: list[str] = []
    for block_kib in args.block_kib:
        limit = MemoryLimit(total)  # per block size: its samples interleave with that size's
        try:
            r = bench_block_size(block_kib, total, args.repeats, limit, args.peers_dir, notes)
            add_limit(r, limit)
        finally:
            limit.close()
        results.append(r)
        print(f"  {block_kib} KiB done", flush=True)
    table(results, args.total_mib, args.repeats)
    peers = {"Google TPU Sync": peer_state("tpu-sync", args.peers_dir)}
    for name, state in peers.items():
        print(f"{name}: {state}")
    for note in notes:
        print(f"note: {note}")
    payload = {"total_bytes": total, "repeats": args.repeats, "results": results,
               "peers": peers, "notes": notes}  # fmt: skip
    run.write(args.json, payload)
    return 0
