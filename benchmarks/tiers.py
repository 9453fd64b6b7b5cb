"""GB/s of the DRAM tier (anonymous and /dev/shm) with checksums on, against memcpy.

For 1 MiB and 4 MiB blocks (each spanning 8 arrays, like 4 layers' K and V), puts 1 GiB of
scattered device blocks into a HostPool and gets them back into other device blocks, verifying
every checksum in the copy pass; alternates with the limit (``np.copyto`` between touched buffers,
one thread per core). Gets from /dev/shm are timed warm and from a freshly attached mapping.
The disk tier (DiskPool, O_DIRECT where the filesystem allows) puts the same bytes from DRAM slots
and gets them back, beside a plain sequential O_DIRECT write/read loop of the same size on the
same filesystem (and fio's figures when fio is installed). The shared-FS tier (SharedFsPool: a
file per block, written to a temporary name, fsynced, renamed) beside the same file-per-block loop
without tpusync, in ``--shared-dir``. Also times re-attaching a 4 GiB and a 256 MiB /dev/shm
pool. Prints tables; writes JSON.

    python benchmarks/tiers.py [--total-mib 1024] [--repeats 9] [--json tiers.json]
        [--disk-dir DIR] [--shared-dir DIR] [--shm-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from functools import partial

import jax
import numpy as np

import tpusync
from tpusync import _core
from tpusync.tiers import DiskPool, HostPool, PoolLayout, SharedFsPool
from tpusync.tiers.dram import pool_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MemcpyLimit, fio_gbps, median, print_table, settle, timed, write_json

N_ARRAYS = 8


def _device_pools(n_blocks: int, block_bytes: int, seed: int) -> list[tpusync.DevicePool]:
    per_array = block_bytes // N_ARRAYS // 2  # bf16 elements of one array's part of a block
    rng = np.random.default_rng(seed)
    pools = []
    for _ in range(N_ARRAYS):
        bits = rng.integers(0, 2**16, size=(n_blocks, per_array), dtype=np.uint16)
        pools.append(tpusync.DevicePool(jax.device_put(bits.view(jax.numpy.bfloat16))))
    settle()
    return pools


def bench_dram(
    block_mib: int, total: int, repeats: int, limit: MemcpyLimit, shm_dir: str = "/dev/shm"
) -> list[dict]:
    block_bytes = block_mib << 20
    n = total // block_bytes
    pools = _device_pools(2 * n, block_bytes, block_mib)
    layout = PoolLayout.from_pools("bench", pools)
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(2 * n)[:n]
    dst_blocks = rng.permutation(2 * n)[:n]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    rows = []
    name = f"bench-{uuid.uuid4().hex[:8]}"
    for kind in ("anonymous", "shm"):
        pool = HostPool(layout, n, name=name if kind == "shm" else None, shm_dir=shm_dir)
        settle()  # a named pool's pages are collapsed into huge ones in the background
        times: dict[str, list[float]] = {"limit": [], "put": [], "get": [], "get_fresh": []}

        def put(pool: HostPool) -> None:
            pool.put_from_device(keys, pools, src_blocks)

        def get(pool: HostPool) -> None:
            pool.get_to_device(keys, pools, dst_blocks)

        put(pool)
        get(pool)  # warm-up: compilation, first touches
        for _ in range(repeats):
            times["limit"].append(timed(limit.copy))
            pool.delete(keys)  # room for the put, not timed: a put fills free slots
            times["put"].append(timed(partial(put, pool)))
            times["get"].append(timed(partial(get, pool)))
            if kind == "shm":
                pool.close()
                pool = HostPool(layout, n, name=name, populate=False, shm_dir=shm_dir)
                times["get_fresh"].append(timed(partial(get, pool)))
                pool.wait_mapped()  # warm again: the next put and get are timed warm
        pool.close()
        if kind == "shm":
            pool_path(name, shm_dir).unlink()
        lim = limit.src.nbytes / median(times["limit"]) / 1e9
        result = {
            "tier": f"dram {kind}",
            "block_mib": block_mib,
            "bytes": n * block_bytes,
            "limit_gbps": lim,
        }
        for op in ("put", "get", "get_fresh"):
            if times[op]:
                result[f"{op}_gbps"] = n * block_bytes / median(times[op]) / 1e9
        rows.append(result)
    return rows


def raw_direct_io(directory: str, total: int, block_bytes: int) -> tuple[float, float]:
    """A plain sequential O_DIRECT write then read of ``total`` bytes in ``block_bytes`` pieces
    from one aligned buffer, in one file of ``directory``: the disk's limit for this tier."""
    path = os.path.join(directory, f".raw-{uuid.uuid4().hex[:8]}")
    buffer = _core.Mapping(block_bytes)
    memory = memoryview(buffer)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        start = time.perf_counter()
        for offset in range(0, total, block_bytes):
            os.pwritev(fd, [memory], offset)
        os.fdatasync(fd)
        write = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, total, block_bytes):
            os.preadv(fd, [memory], offset)
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
        del memory
        buffer.close()
    return total / write / 1e9, total / read / 1e9


def raw_file_per_block(directory: str, n: int, block_bytes: int) -> tuple[float, float]:
    """The same loop a shared-FS tier runs, without tpusync: each block written to a temporary
    file, fsynced and renamed into place, then every file read back whole: the filesystem's
    limit for one file per block."""
    buffer = _core.Mapping(block_bytes)
    memory = memoryview(buffer)
    names = [os.path.join(directory, f".raw-{i}") for i in range(n)]
    try:
        start = time.perf_counter()
        for name in names:
            fd = os.open(name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, memory)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(name + ".tmp", name)
        write = time.perf_counter() - start
        start = time.perf_counter()
        for name in names:
            with open(name, "rb", buffering=0) as f:
                f.readinto(memory)
        read = time.perf_counter() - start
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        del memory
        buffer.close()
    return n * block_bytes / write / 1e9, n * block_bytes / read / 1e9


def bench_lower(kind: str, block_mib: int, total: int, repeats: int, directory: str) -> dict:
    """Put and get of a lower tier (``"disk"`` or ``"shared"``) from and to DRAM slots, beside
    the raw loop of its medium: sequential O_DIRECT for disk, a file per block for shared FS."""
    block_bytes = block_mib << 20
    n = total // block_bytes
    pools = _device_pools(n, block_bytes, block_mib)
    layout = PoolLayout.from_pools("bench", pools)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    source = HostPool(layout, n)
    source.put_from_device(keys, pools, range(n))
    target = HostPool(layout, n)
    workdir = tempfile.mkdtemp(dir=directory, prefix="tpusync-bench-")
    tier: DiskPool | SharedFsPool
    if kind == "disk":
        tier = DiskPool(layout, n, workdir)
        raw = partial(raw_direct_io, workdir, n * layout.slot_bytes, layout.slot_bytes)
        label = f"disk ({'O_DIRECT' if tier.direct_io else 'buffered'})"
    else:
        os.mkdir(os.path.join(workdir, "pool"))
        tier = SharedFsPool(layout, os.path.join(workdir, "pool"))
        raw = partial(raw_file_per_block, workdir, n, layout.payload_bytes)
        label = "shared fs (file per block)"
    times: dict[str, list[float]] = {"raw_write": [], "raw_read": [], "put": [], "get": []}
    fio = None
    try:
        for _ in range(repeats):
            write, read = raw()
            times["raw_write"].append(write)
            times["raw_read"].append(read)
            tier.delete(keys)
            times["put"].append(n * block_bytes / timed(partial(tier.put, keys, source)) / 1e9)
            target.delete(keys)
            times["get"].append(n * block_bytes / timed(partial(tier.get, keys, target)) / 1e9)
        if kind == "disk":
            total, size = n * layout.slot_bytes, layout.slot_bytes
            fio = (
                fio_gbps(workdir, total, size, "write"),
                fio_gbps(workdir, total, size, "read"),
            )
    finally:
        tier.close()
        source.close()
        target.close()
        shutil.rmtree(workdir)
    result = {
        "tier": label,
        "block_mib": block_mib,
        "bytes": n * block_bytes,
        **{f"{k}_gbps": median(v) for k, v in times.items()},
    }
    if fio and None not in fio:
        result["fio_write_gbps"], result["fio_read_gbps"] = fio
    return result


def bench_attach(repeats: int) -> dict:
    pools = _device_pools(4, 4 << 20, 1)
    layout = PoolLayout.from_pools("bench", pools)
    out = {}
    for label, size in (("256 MiB", 256 << 20), ("4 GiB", 4 << 30)):
        name = f"attach-{uuid.uuid4().hex[:8]}"
        slots = size // layout.slot_bytes
        seconds = []
        try:  # the named pool's file goes whatever happens (it holds RAM in /dev/shm)
            HostPool(layout, slots, name=name, populate=False).close()
            for _ in range(repeats):
                start = time.perf_counter()
                pool = HostPool(layout, slots, name=name)
                seconds.append(time.perf_counter() - start)
                assert pool.attached
                pool.close()
        finally:
            pool_path(name).unlink(missing_ok=True)
        out[label] = median(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default="tiers.json")
    parser.add_argument(
        "--disk-dir",
        default=tempfile.gettempdir(),
        help="a directory on the disk to measure (default: the temp dir)",
    )
    parser.add_argument(
        "--shared-dir",
        default=tempfile.gettempdir(),
        help="a directory on the shared filesystem to measure (default: the temp dir)",
    )
    parser.add_argument(
        "--shm-dir",
        default="/dev/shm",
        help="where named pools live (e.g. a tmpfs mounted with huge=within_size)",
    )
    args = parser.parse_args()
    total = args.total_mib << 20
    limit = MemcpyLimit(total)
    results = []
    for block_mib in (1, 4):
        results += bench_dram(block_mib, total, args.repeats, limit, args.shm_dir)
        print(f"  {block_mib} MiB blocks done", flush=True)
    limit.close()
    disk_results = []
    for kind, directory in (("disk", args.disk_dir), ("shared", args.shared_dir)):
        for block_mib in (1, 4):
            disk_results.append(bench_lower(kind, block_mib, total, args.repeats, directory))
            print(f"  {kind} {block_mib} MiB blocks done", flush=True)
    attach = bench_attach(args.repeats)
    rows = []
    for r in results:
        lim = r["limit_gbps"]
        fresh = r.get("get_fresh_gbps")
        rows.append(
            [
                r["tier"],
                f"{r['block_mib']} MiB",
                lim,
                r["put_gbps"],
                r["put_gbps"] / lim,
                r["get_gbps"],
                r["get_gbps"] / lim,
                "-" if fresh is None else f"{fresh:.2f}",
                "-" if fresh is None else f"{fresh / lim:.2f}",
            ]
        )
    print(
        f"\n{args.total_mib} MiB per op, scattered blocks, checksums on, median of "
        f"{args.repeats} (GB/s; x = ratio to memcpy)"
    )
    print_table(["tier", "block", "memcpy", "put", "x", "get warm", "x", "get fresh", "x"], rows)
    disk_rows = []
    for r in disk_results:
        fio = (
            f"{r['fio_write_gbps']:.2f}/{r['fio_read_gbps']:.2f}"
            if "fio_write_gbps" in r
            else "-"
            if r["tier"].startswith("shared")
            else "not installed"
        )
        disk_rows.append(
            [
                r["tier"],
                f"{r['block_mib']} MiB",
                r["raw_write_gbps"],
                r["put_gbps"],
                r["put_gbps"] / r["raw_write_gbps"],
                r["raw_read_gbps"],
                r["get_gbps"],
                r["get_gbps"] / r["raw_read_gbps"],
                fio,
            ]
        )
    print(
        f"\ndisk tier in {args.disk_dir} (raw loop: sequential O_DIRECT) and shared-FS tier in "
        f"{args.shared_dir} (raw loop: a file per block, fsync, rename), checksums on "
        "(GB/s; x = ratio to the raw loop)"
    )
    print_table(
        ["tier", "block", "raw write", "put", "x", "raw read", "get", "x", "fio w/r"], disk_rows
    )
    ratio = attach["4 GiB"] / attach["256 MiB"]
    print(
        f"\nre-attach /dev/shm pool: 256 MiB {attach['256 MiB'] * 1e3:.2f} ms, "
        f"4 GiB {attach['4 GiB'] * 1e3:.2f} ms ({ratio:.2f}x)"
    )
    write_json(
        args.json,
        {
            "benchmark": "tiers",
            "shm_dir": args.shm_dir,
            "results": results,
            "disk": disk_results,
            "disk_dir": args.disk_dir,
            "attach_seconds": attach,
            "repeats": args.repeats,
        },
    )


if __name__ == "__main__":
    main()
