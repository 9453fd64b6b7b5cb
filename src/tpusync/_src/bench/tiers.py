"""GB/s of the DRAM tier (anonymous and /dev/shm) with checksums on, against the memory limit; the
disk and shared-FS tiers against fio and their raw loops.

For 1 MiB and 4 MiB blocks (each spanning 8 arrays, like 4 layers' K and V), puts ``--total-mib``
of scattered device blocks into a HostPool and gets them back into other device blocks, verifying
every checksum in the copy pass, with the native engine and the pure-JAX engine (the peer that
runs here), interleaved round by round with one sample of the memory limit
(:class:`~tpusync._src.bench.limits.MemoryLimit`; np.copyto beside it). Gets from /dev/shm are timed
warm and from a freshly attached mapping. The disk tier (DiskPool, O_DIRECT where the filesystem
allows) puts the same bytes from DRAM slots and gets them back, beside a plain sequential
O_DIRECT write/read loop of the same size on the same filesystem and fio's O_DIRECT figures with
as many jobs as the tier's I/O threads (the best iodepth of 1, 4 and 16). The shared-FS tier
(SharedFsPool: a file per block, written to a temporary name, fsynced, renamed) beside the same
file-per-block loop without tpusync and fio (buffered, as the tier reads and writes) with its
I/O threads, in ``--shared-dir``. fio moves at least 256 MiB. Also times
re-attaching a 4 GiB and a 256 MiB /dev/shm pool. Prints tables; writes JSON.

    python benchmarks/tiers.py [--total-mib 1024] [--repeats 9] [--json tiers.json]
        [--disk-dir DIR] [--shared-dir DIR] [--shm-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.bench.common import (
    Run,
    median,
    print_table,
    random_device_pools,
    settle,
    spread,
    timed,
)
from tpusync._src.bench.limits import LimitResult, MemoryLimit, disk_fio
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.dram import HostPool, pool_path
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.shared_fs import SharedFsPool

N_ARRAYS = 8
BLOCK_MIBS = (1, 4)
QUICK = ["--total-mib", "32", "--repeats", "3", "--attach-gib", "1"]
PATHS = ("native", "jax")


def _gbps(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / s / 1e9 for s in seconds]


def bench_dram(block_mib: int, total: int, repeats: int, shm_dir: str = "/dev/shm") -> list[dict]:
    block_bytes = block_mib << 20
    n = total // block_bytes
    nbytes = n * block_bytes
    pools = random_device_pools(N_ARRAYS, 2 * n, block_bytes, block_mib)
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
        limit = MemoryLimit(nbytes)
        times: dict[str, list[float]] = {}

        def put(pool: HostPool, path: str) -> None:
            pool.put_from_device(keys, pools, src_blocks, path=path)

        def get(pool: HostPool, path: str) -> None:
            pool.get_to_device(keys, pools, dst_blocks, path=path)

        try:
            for path in PATHS:  # warm-up: compilation, first touches
                put(pool, path)
                get(pool, path)
            for _ in range(repeats):  # contenders interleaved, one limit sample per round
                limit.sample(repeats=3)  # the best of 3: what the machine can do
                for path in PATHS:
                    suffix = "" if path == "native" else "_jax"
                    pool.delete(keys)  # room for the put, not timed: a put fills free slots
                    times.setdefault(f"put{suffix}", []).append(timed(partial(put, pool, path)))
                    times.setdefault(f"get{suffix}", []).append(timed(partial(get, pool, path)))
                if kind == "shm":
                    pool.close()
                    pool = HostPool(layout, n, name=name, populate=False, shm_dir=shm_dir)
                    fresh = timed(partial(get, pool, "native"))
                    times.setdefault("get_fresh", []).append(fresh)
                    pool.wait_mapped()  # warm again: the next put and get are timed warm
            found = limit.result()
            copyto = limit.copyto_gbps()
        finally:
            limit.close()
            pool.close()
            if kind == "shm":
                pool_path(name, shm_dir).unlink(missing_ok=True)
        result: dict[str, Any] = {
            "tier": f"dram {kind}",
            "block_mib": block_mib,
            "bytes": nbytes,
            "limit_gbps": found.gbps,
            "limit_method": found.method,
            "limit_gbps_by_method": found.gbps_by_method,
            "copyto_gbps": copyto,
        }
        for op, seconds in times.items():
            result[f"{op}_gbps"] = nbytes / median(seconds) / 1e9
            result[f"{op}_gbps_runs"] = _gbps(nbytes, seconds)
            result[f"{op}_x_limit"] = result[f"{op}_gbps"] / found.gbps
        for op in ("put", "get"):
            result[f"{op}_x_jax"] = result[f"{op}_gbps"] / result[f"{op}_jax_gbps"]
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


# fio moves at least this much: over fewer bytes its jobs' start-up is in the figure
FIO_MIN_BYTES = 256 << 20


def fio_limit(
    directory: str, total: int, block_bytes: int, numjobs: int, direct: bool, notes: list[str]
) -> dict[str, Any]:
    """fio's write and read (``O_DIRECT`` or through the page cache, as the tier does its I/O)
    on ``numjobs`` jobs (the tier's I/O threads): GB/s and the iodepth that won, under the keys
    the tables read; nothing where fio cannot run."""
    out: dict[str, Any] = {"fio_numjobs": numjobs, "fio_direct": direct}
    total = max(total, FIO_MIN_BYTES)
    for rw in ("write", "read"):
        try:
            found: LimitResult | None = disk_fio(
                directory, total, block_bytes, rw, numjobs=numjobs, direct=direct
            )
        except RuntimeError as exc:
            notes.append(f"fio {rw} in {directory}: {exc}")
            continue
        if found is None:
            notes.append("fio: not installed (apt-get install fio); its limit is skipped")
            return out
        out[f"fio_{rw}_gbps"] = found.gbps
        out[f"fio_{rw}_method"] = found.method
        out[f"fio_{rw}_gbps_by_method"] = found.gbps_by_method
    return out


def fastest_read(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The fio sample whose read was fastest (the disk's limit is the most it showed in the
    run), with every sample's read GB/s under ``fio_read_gbps_samples``."""
    read = [sample for sample in samples if "fio_read_gbps" in sample]
    best = dict(max(read, key=lambda sample: sample["fio_read_gbps"]) if read else samples[-1])
    best["fio_read_gbps_samples"] = [sample["fio_read_gbps"] for sample in read]
    return best


def bench_lower(
    kind: str, block_mib: int, total: int, repeats: int, directory: str, notes: list[str]
) -> dict:
    """Put and get of a lower tier (``"disk"`` or ``"shared"``) from and to DRAM slots, beside
    the raw loop of its medium (sequential O_DIRECT for disk, a file per block for shared FS)
    and fio with the tier's own I/O threads."""
    block_bytes = block_mib << 20
    n = total // block_bytes
    pools = random_device_pools(N_ARRAYS, n, block_bytes, block_mib)
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
    try:
        for _ in range(repeats):
            write, read = raw()
            times["raw_write"].append(write)
            times["raw_read"].append(read)
            tier.delete(keys)
            times["put"].append(n * block_bytes / timed(partial(tier.put, keys, source)) / 1e9)
            target.delete(keys)
            times["get"].append(n * block_bytes / timed(partial(tier.get, keys, target)) / 1e9)
        direct = isinstance(tier, DiskPool) and bool(tier.direct_io)  # shared FS: buffered
        fio = fio_limit(
            workdir, n * layout.slot_bytes, layout.slot_bytes, tier.io_threads, direct, notes
        )
    finally:
        tier.close()
        source.close()
        target.close()
        shutil.rmtree(workdir)
    result: dict[str, Any] = {
        "tier": label,
        "block_mib": block_mib,
        "bytes": n * block_bytes,
        "io_threads": tier.io_threads,
        **{f"{k}_gbps": median(v) for k, v in times.items()},
        **{f"{k}_gbps_runs": v for k, v in times.items()},
        **fio,
    }
    for op, rw in (("put", "write"), ("get", "read")):
        # The limit is the faster way this run found to move the bytes on this medium: fio, or
        # the raw loop where it beat fio (buffered reads of a cached file, for one).
        candidates = {"raw loop": result[f"raw_{rw}_gbps"]}
        if f"fio_{rw}_gbps" in result:
            depth = result[f"fio_{rw}_method"].split(",")[0]
            candidates[f"fio {depth}"] = result[f"fio_{rw}_gbps"]
        best = max(candidates, key=candidates.__getitem__)
        result[f"limit_{rw}_gbps"] = candidates[best]
        result[f"limit_{rw}_method"] = best
        result[f"{op}_x_limit"] = result[f"{op}_gbps"] / candidates[best]
    return result


def bench_attach(repeats: int, big_gib: int = 4) -> dict:
    pools = random_device_pools(N_ARRAYS, 4, 4 << 20, 1)
    layout = PoolLayout.from_pools("bench", pools)
    out = {}
    for label, size in (("256 MiB", 256 << 20), (f"{big_gib} GiB", big_gib << 30)):
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


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None, help="default: the results scheme")
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
    parser.add_argument("--attach-gib", type=int, default=4, help="the big pool re-attached")
    return parser


def _ratio(value: float | None) -> float | str:
    return "-" if value is None else value


def dram_table(results: list[dict[str, Any]], total_mib: int, repeats: int) -> None:
    rows = []
    for r in results:
        fresh = r.get("get_fresh_gbps_runs")
        rows.append(
            [
                r["tier"],
                f"{r['block_mib']} MiB",
                f"{r['limit_gbps']:.2f} {r['limit_method']}",
                r["copyto_gbps"],
                spread(r["put_gbps_runs"]),
                r["put_x_limit"],
                r["put_x_jax"],
                spread(r["get_gbps_runs"]),
                r["get_x_limit"],
                r["get_x_jax"],
                spread(fresh) if fresh else "-",
                _ratio(r.get("get_fresh_x_limit")),
            ]
        )
    print(
        f"\n{total_mib} MiB per op, scattered blocks, checksums on, median (min-max) of "
        f"{repeats} (GB/s; x = ratio to the limit, or to the pure-JAX engine's put/get)"
    )
    print_table(
        [
            "tier", "block", "limit", "np.copyto", "put", "x limit", "x jax", "get warm",
            "x limit", "x jax", "get fresh", "x limit",
        ],
        rows,
        limit_columns=(5, 8, 11),
    )  # fmt: skip


def _limit_cell(r: dict[str, Any], rw: str) -> str:
    return f"{r[f'limit_{rw}_gbps']:.2f} {r[f'limit_{rw}_method']}"


def lower_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rows = [
        [
            r["tier"],
            f"{r['block_mib']} MiB",
            r["io_threads"],
            _limit_cell(r, "write"),
            spread(r["raw_write_gbps_runs"]),
            spread(r["put_gbps_runs"]),
            _ratio(r.get("put_x_limit")),
            _limit_cell(r, "read"),
            spread(r["raw_read_gbps_runs"]),
            spread(r["get_gbps_runs"]),
            _ratio(r.get("get_x_limit")),
            "none runs here",  # no peer here has a disk or shared-FS tier
        ]
        for r in results
    ]
    print(
        f"\ndisk tier in {args.disk_dir} and shared-FS tier in {args.shared_dir}, checksums on, "
        "median (min-max) (GB/s); limit: the faster of fio (O_DIRECT for disk, buffered for shared "
        "fs, as the tiers do their I/O; the tier's I/O threads as jobs, the best iodepth) and the "
        "raw loop: sequential O_DIRECT (disk) or a file per block, fsync, rename (shared fs)"
    )
    print_table(
        [
            "tier", "block", "threads", "limit write", "raw write", "put", "x limit", "limit read",
            "raw read", "get", "x limit", "peer",
        ],
        rows,
        limit_columns=(6, 10),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = Run("tiers")
    total = args.total_mib << 20
    notes: list[str] = []
    results = []
    for block_mib in BLOCK_MIBS:
        results += bench_dram(block_mib, total, args.repeats, args.shm_dir)
        print(f"  {block_mib} MiB blocks done", flush=True)
    disk_results = []
    for kind, directory in (("disk", args.disk_dir), ("shared", args.shared_dir)):
        for block_mib in BLOCK_MIBS:
            disk_results.append(bench_lower(kind, block_mib, total, args.repeats, directory, notes))
            print(f"  {kind} {block_mib} MiB blocks done", flush=True)
    attach = bench_attach(args.repeats, args.attach_gib)
    dram_table(results, args.total_mib, args.repeats)
    lower_table(disk_results, args)
    small, big = attach["256 MiB"], attach[f"{args.attach_gib} GiB"]
    print(
        f"\nre-attach /dev/shm pool: 256 MiB {small * 1e3:.2f} ms, "
        f"{args.attach_gib} GiB {big * 1e3:.2f} ms ({big / small:.2f}x)"
    )
    for note in dict.fromkeys(notes):
        print(f"note: {note}")
    payload = {
        "shm_dir": args.shm_dir,
        "results": results,
        "disk": disk_results,
        "disk_dir": args.disk_dir,
        "shared_dir": args.shared_dir,
        "attach_seconds": attach,
        "repeats": args.repeats,
        "notes": list(dict.fromkeys(notes)),
    }
    run.write(args.json, payload)
    return 0
