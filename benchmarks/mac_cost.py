"""What a keyed MAC of every block costs (issue 18): Poly1305 tags beside DRAM put/get, and the
shared-FS tier with ``mac_key`` on and off, in one run.

DRAM rows: a HostPool put (device blocks -> slots, checksummed) and get (slots -> device blocks,
verified) of ``--total-mib`` in 2 MiB blocks, beside tagging the same slots with Poly1305 on one
thread per core (what a MAC'd DRAM tier would add to each put and each get), and the memory
``np.copyto`` on all cores (``MemcpyLimit``: a weak limit, beaten by the DRAM tier; the
limits issue replaces it). "put + MAC" is the put followed by the tags: the rate a DRAM tier with
MACs would reach.
Shared-FS rows: ``SharedFsPool.put`` / ``get`` of the same blocks in a directory on /dev/shm
(tmpfs: the fastest medium, where the MAC's share is largest), with and without ``mac_key``,
alternating.

    python benchmarks/mac_cost.py [--total-mib 512] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import numpy as np

import tpusync
from tpusync import _mac
from tpusync.tiers import HostPool, PoolLayout, SharedFsPool
from tpusync.tiers.mac import mac_key_from_secret

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MemcpyLimit, median, print_table, settle, timed, write_json

BLOCK = 2 << 20
N_ARRAYS = 8


def device_pools(n_blocks: int, seed: int) -> list[tpusync.DevicePool]:
    rng = np.random.default_rng(seed)
    per_array = BLOCK // N_ARRAYS // 2
    pools = []
    for _ in range(N_ARRAYS):
        bits = rng.integers(0, 2**16, size=(n_blocks, per_array), dtype=np.uint16)
        pools.append(tpusync.DevicePool(jax.device_put(bits.view(jax.numpy.bfloat16))))
    settle()
    return pools


def tag_slots(pool: HostPool, n: int, executor: ThreadPoolExecutor, threads: int) -> None:
    """Poly1305 tags of slots 0..n-1, split over ``threads`` (each call releases the GIL)."""
    base = np.frombuffer(pool.slot_memory(0), np.uint8)  # keeps the mapping's address
    start = base.ctypes.data
    del base
    stride = pool.layout.slot_bytes
    keys = np.random.default_rng(0).integers(0, 256, (n, 32), dtype=np.uint8)
    starts = start + np.arange(n, dtype=np.uint64) * np.uint64(stride)
    lengths = np.full(n, pool.layout.payload_bytes, dtype=np.uint64)
    parts = np.array_split(np.arange(n), threads)
    futures = [
        executor.submit(_mac.poly1305_regions, keys[p], starts[p], lengths[p])
        for p in parts
        if p.size
    ]
    for future in futures:
        future.result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="benchmarks/results/mac-cost-cpu-2core.json")
    args = parser.parse_args()
    n = (args.total_mib << 20) // BLOCK
    total = n * BLOCK
    threads = os.cpu_count() or 1
    pools = device_pools(2 * n, 1)
    layout = PoolLayout.from_pools("mac-bench", pools)
    rng = np.random.default_rng(2)
    src_blocks, dst_blocks = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    limit = MemcpyLimit(total)
    times: dict[str, list[float]] = {k: [] for k in ("limit", "put", "get", "mac")}
    executor = ThreadPoolExecutor(threads)
    shared_dir = tempfile.mkdtemp(prefix="tpusync-mac-bench-", dir="/dev/shm")
    mac_key = mac_key_from_secret(b"benchmark secret")
    try:
        with HostPool(layout, n) as dram:
            dram.put_from_device(keys, pools, src_blocks)
            dram.get_to_device(keys, pools, dst_blocks)  # warm-up
            tag_slots(dram, n, executor, threads)
            for _ in range(args.repeats):
                times["limit"].append(timed(limit.copy))
                dram.delete(keys)
                times["put"].append(timed(partial(dram.put_from_device, keys, pools, src_blocks)))
                times["get"].append(timed(partial(dram.get_to_device, keys, pools, dst_blocks)))
                times["mac"].append(timed(partial(tag_slots, dram, n, executor, threads)))
            fs: dict[str, list[float]] = {f"{op} {m}": [] for op in ("put", "get") for m in "AB"}
            tiers = {
                "A": SharedFsPool(layout, shared_dir, durability="none"),
                "B": SharedFsPool(layout, shared_dir, durability="none", mac_key=mac_key),
            }
            try:
                for _ in range(args.repeats):
                    for mode in "AB":
                        tier = tiers[mode]
                        tier.delete(keys)
                        fs[f"put {mode}"].append(timed(partial(tier.put, keys, dram)))
                        with HostPool(layout, n) as target:
                            fs[f"get {mode}"].append(timed(partial(tier.get, keys, target)))
            finally:
                for tier in tiers.values():
                    tier.delete(keys)
                    tier.close()
    finally:
        executor.shutdown()
        shutil.rmtree(shared_dir, ignore_errors=True)
    gbps = {k: total / median(v) / 1e9 for k, v in times.items()}
    fs_gbps = {k: total / median(v) / 1e9 for k, v in fs.items()}
    with_mac = {op: 1 / (1 / gbps[op] + 1 / gbps["mac"]) for op in ("put", "get")}
    rows = [
        ["np.copyto, all cores (a weak limit)", f"{gbps['limit']:.2f}", ""],
        [f"Poly1305 tags, {threads} threads", f"{gbps['mac']:.2f}", ""],
        ["DRAM put", f"{gbps['put']:.2f}", ""],
        ["DRAM put + MAC", f"{with_mac['put']:.2f}", f"{with_mac['put'] / gbps['put']:.2f}x"],
        ["DRAM get", f"{gbps['get']:.2f}", ""],
        ["DRAM get + MAC", f"{with_mac['get']:.2f}", f"{with_mac['get'] / gbps['get']:.2f}x"],
        ["shared FS put (tmpfs)", f"{fs_gbps['put A']:.2f}", ""],
        ["shared FS put, mac_key", f"{fs_gbps['put B']:.2f}",
         f"{fs_gbps['put B'] / fs_gbps['put A']:.2f}x"],
        ["shared FS get (tmpfs)", f"{fs_gbps['get A']:.2f}", ""],
        ["shared FS get, mac_key", f"{fs_gbps['get B']:.2f}",
         f"{fs_gbps['get B'] / fs_gbps['get A']:.2f}x"],
    ]  # fmt: skip
    print(f"{total >> 20} MiB in 2 MiB blocks, median of {args.repeats}")
    print_table(["what", "GB/s", "vs without MAC"], rows)
    write_json(
        args.json,
        {
            "bytes": total,
            "repeats": args.repeats,
            "threads": threads,
            "gbps": gbps,
            "dram_with_mac_gbps": with_mac,
            "shared_fs_gbps": {k.replace(" A", "").replace(" B", " mac"): v
                               for k, v in fs_gbps.items()},
        },
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
