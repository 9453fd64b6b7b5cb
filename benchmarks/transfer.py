"""Device<->host GB/s of tpusync.transfer against the memory-copy limit and the pure-JAX path.

For each block size, moves 1 GiB of scattered blocks (a random permutation, so nothing merges
into one big copy) between a device array and a prefaulted HostBuffer, in both directions, with
the native path and the pure-JAX path, alternating with the limit (``np.copyto`` between touched
buffers, one thread per core). Prints medians and ratios; writes JSON.

    python benchmarks/transfer.py [--total-mib 1024] [--repeats 5] [--json transfer.json]
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import tpusync

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import MemcpyLimit, median, print_table, settle, timed, transfer_arguments, write_json


def bench_block_size(block_kib: int, total: int, repeats: int, limit: MemcpyLimit) -> dict:
    block_bytes = block_kib * 1024
    n_blocks = total // block_bytes
    shape = (n_blocks, block_bytes // 2)
    rng = np.random.default_rng(block_kib)
    host = tpusync.HostBuffer(shape, "bfloat16")
    host.array.view(np.uint16)[...] = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    pool = tpusync.DevicePool(jax.device_put(host.array, may_alias=False))
    settle()
    order = rng.permutation(n_blocks)
    identity = np.arange(n_blocks)
    nbytes = n_blocks * block_bytes
    times: dict[str, list[float]] = {
        k: [] for k in ("limit", "d2h_native", "d2h_jax", "h2d_native", "h2d_jax")
    }

    def d2h(path: str) -> None:
        tpusync.transfer(pool, host, src_blocks=order, dst_blocks=identity, path=path).result()

    def h2d(path: str) -> None:
        tpusync.transfer(host, pool, src_blocks=identity, dst_blocks=order, path=path).result()

    for path in ("native", "jax"):  # warm-up: compilation and first touches are not measured
        d2h(path)
        h2d(path)
    for _ in range(repeats):
        times["limit"].append(timed(limit.copy))
        times["d2h_native"].append(timed(lambda: d2h("native")))
        times["d2h_jax"].append(timed(lambda: d2h("jax")))
        times["limit"].append(timed(limit.copy))
        times["h2d_native"].append(timed(lambda: h2d("native")))
        times["h2d_jax"].append(timed(lambda: h2d("jax")))
    limit_gbps = limit.src.nbytes / median(times["limit"]) / 1e9
    result = {
        "block_kib": block_kib,
        "n_blocks": n_blocks,
        "bytes": nbytes,
        "limit_gbps": limit_gbps,
    }
    for key in times:
        if key != "limit":
            result[f"{key}_gbps"] = nbytes / median(times[key]) / 1e9
    result["seconds"] = {k: v for k, v in times.items()}
    return result


def main() -> None:
    args = transfer_arguments(__doc__, "transfer.json")
    total = args.total_mib * 2**20
    print(tpusync.info())
    limit = MemcpyLimit(total)
    rows, results = [], []
    for block_kib in args.block_kib:
        r = bench_block_size(block_kib, total, args.repeats, limit)
        results.append(r)
        lim = r["limit_gbps"]
        rows.append(
            [
                f"{block_kib} KiB",
                lim,
                r["d2h_native_gbps"],
                r["d2h_native_gbps"] / lim,
                r["d2h_jax_gbps"],
                r["d2h_native_gbps"] / r["d2h_jax_gbps"],
                r["h2d_native_gbps"],
                r["h2d_native_gbps"] / lim,
                r["h2d_jax_gbps"],
                r["h2d_native_gbps"] / r["h2d_jax_gbps"],
            ]
        )
        print(f"  {block_kib} KiB done", flush=True)
    limit.close()
    print(
        f"\n{args.total_mib} MiB per transfer, scattered blocks, median of {args.repeats} "
        f"(GB/s; x = ratio)"
    )
    print_table(
        [
            "block",
            "memcpy",
            "D2H nat",
            "x limit",
            "D2H jax",
            "x jax",
            "H2D nat",
            "x limit",
            "H2D jax",
            "x jax",
        ],
        rows,
    )
    write_json(
        args.json,
        {
            "benchmark": "transfer",
            "total_bytes": total,
            "repeats": args.repeats,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
