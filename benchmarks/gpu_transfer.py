"""Device<->host GB/s of tpusync.transfer on a GPU, beside cudaMemcpyAsync on pinned memory.

For each block size, moves ``--total-mib`` of scattered blocks (a random permutation) between a
``DevicePool`` on the first GPU and a ``HostBuffer``, both directions, with the native PJRT path
(asked for explicitly: ``path="auto"`` keeps a platform on pure JAX until a run like this one
has proven it) and with the pure-JAX path, checking that each delivers the right bytes. The
native reads run three ways: as tpusync does them (blocks under 1 MiB gathered on the device
first, then few large copies), every block its own ``CopyRawToHost`` ("no gather"), and into
host memory tpusync did not allocate, so never registered for DMA ("unregistered"). A
direction the plugin cannot do natively (the CUDA plugin has no raw-buffer extension, so no
in-place host->device writes) is reported with the reason. ``tpusync.info()`` printed first says
what the PJRT probe found. The limit, alternating with them in the same run: CuPy's
``cudaMemcpyAsync`` of the same bytes between device memory and pinned host memory in one call
per direction, timed with CUDA events. Medians; prints a table; writes JSON (also into ``$OUT``
when that is set, for the device tool).

    python benchmarks/gpu_transfer.py [--total-mib 1024] [--repeats 5] [--json FILE]

Needs jax with a GPU backend and CuPy; says so and exits 2 without them.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, transfer_arguments, write_json


def _gpu() -> Any:
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        print("gpu_transfer: needs a GPU backend (jax.devices('gpu') is empty)", file=sys.stderr)
        raise SystemExit(2)
    return gpus[0]


class CudaMemcpyLimit:
    """One cudaMemcpyAsync per direction between device memory and pinned host memory of
    ``nbytes``, timed with CUDA events on a stream of its own."""

    def __init__(self, nbytes: int) -> None:
        import cupy
        import cupyx

        self.cupy = cupy
        self.nbytes = nbytes
        self.device = cupy.empty(nbytes, dtype=cupy.uint8)
        self.device[...] = 7
        self.host = cupyx.empty_pinned(nbytes, dtype=np.uint8)
        self.host[...] = 3
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _timed(self, kind: int, dst: int, src: int) -> float:
        cuda = self.cupy.cuda
        start, end = cuda.Event(), cuda.Event()
        start.record(self.stream)
        cuda.runtime.memcpyAsync(dst, src, self.nbytes, kind, self.stream.ptr)
        end.record(self.stream)
        end.synchronize()
        return cuda.get_elapsed_time(start, end) / 1e3

    def d2h(self) -> float:
        kind = self.cupy.cuda.runtime.memcpyDeviceToHost
        return self._timed(kind, self.host.ctypes.data, self.device.data.ptr)

    def h2d(self) -> float:
        kind = self.cupy.cuda.runtime.memcpyHostToDevice
        return self._timed(kind, self.device.data.ptr, self.host.ctypes.data)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_block_size(
    block_kib: int, total: int, repeats: int, limit: CudaMemcpyLimit, gpu: Any
) -> dict[str, Any]:
    import jax

    import tpusync

    block_bytes = block_kib * 1024
    n_blocks = total // block_bytes
    shape = (n_blocks, block_bytes // 2)
    rng = np.random.default_rng(block_kib)
    bits = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    pool = tpusync.DevicePool(jax.device_put(bits.view(jax.numpy.bfloat16), gpu))
    host = tpusync.HostBuffer(shape, "bfloat16")
    order = rng.permutation(n_blocks)
    identity = np.arange(n_blocks)
    nbytes = n_blocks * block_bytes

    def d2h(path: str) -> None:
        tpusync.transfer(pool, host, src_blocks=order, dst_blocks=identity, path=path).result()

    def h2d(path: str) -> None:
        tpusync.transfer(host, pool, src_blocks=identity, dst_blocks=order, path=path).result()

    # the same read into host memory tpusync did not allocate (never registered for DMA): what
    # PJRT_Client_DmaMap of tpusync's own memory is worth
    plain = np.empty(shape, np.uint16).view(host.array.dtype)

    def d2h_pageable(path: str) -> None:
        tpusync.transfer(pool, plain, src_blocks=order, dst_blocks=identity, path=path).result()

    def d2h_direct(path: str) -> None:
        # every block its own CopyRawToHost, not gathered on the device first
        with tpusync.options.overridden(pjrt_stage_below=0):
            d2h(path)

    # bytes: each path's device->host result equals the source blocks, and host->device puts
    # them back where they came from; a direction a path cannot run is left out, with why
    runs: dict[str, Any] = {}
    result: dict[str, Any] = {"block_kib": block_kib, "bytes": nbytes, "errors": {}}
    cases = [
        ("d2h_native", d2h, "native", host.array),
        ("d2h_pageable_native", d2h_pageable, "native", plain),
        ("d2h_direct_native", d2h_direct, "native", host.array),
        ("h2d_native", h2d, "native", None),
        ("d2h_jax", d2h, "jax", host.array),
        ("h2d_jax", h2d, "jax", None),
    ]
    for key, fn, path, target in cases:
        # the pool holds the source blocks before a read, and is scrambled (through JAX)
        # before a write, so that the write must land
        start = bits if target is not None else np.zeros_like(bits)
        tpusync.transfer(start.view(host.array.dtype), pool, path="jax").result()
        host.array.view(np.uint16)[...] = bits[order]
        if target is not None:
            target.view(np.uint16)[...] = 0x5A5A
        try:
            fn(path)
        except Exception as exc:  # e.g. NativePathUnavailableError: reported, not fatal
            result["errors"][key] = f"{type(exc).__name__}: {exc}"
            continue
        if target is not None:
            ok = np.array_equal(target.view(np.uint16), bits[order])
        else:
            ok = np.array_equal(np.asarray(pool.array).view(np.uint16), bits)
        result[f"{key}_bytes_equal"] = bool(ok)
        runs[key] = fn, path
    times: dict[str, list[float]] = {"limit_d2h": [], "limit_h2d": []}
    times.update({key: [] for key in runs})
    for _ in range(repeats):
        times["limit_d2h"].append(limit.d2h())
        times["limit_h2d"].append(limit.h2d())
        for key, (fn, path) in runs.items():
            times[key].append(_timed(lambda fn=fn, path=path: fn(path)))
    for key, values in times.items():
        moved = limit.nbytes if key.startswith("limit") else nbytes
        result[f"{key}_gbps"] = moved / median(values) / 1e9
    result["seconds"] = times
    del runs, cases, target  # they hold views of the host buffer, which close() refuses
    gc.collect()
    host.close()
    return result


def _cell(r: dict[str, Any], key: str, limit_key: str) -> list[Any]:
    """GB/s and ratio to the limit of one run, or why it did not run."""
    if f"{key}_gbps" not in r:
        return ["n/a", "-"]
    gbps = r[f"{key}_gbps"]
    ok = "" if r.get(f"{key}_bytes_equal") else " WRONG BYTES"
    return [f"{gbps:.2f}{ok}", gbps / r[f"{limit_key}_gbps"]]


def main() -> None:
    args = transfer_arguments(__doc__, "gpu_transfer.json")
    gpu = _gpu()
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("gpu_transfer: needs CuPy for the cudaMemcpyAsync limit", file=sys.stderr)
        raise SystemExit(2) from None
    import tpusync

    info = tpusync.info()
    print(info)
    total = args.total_mib << 20
    limit = CudaMemcpyLimit(total)
    limit.d2h(), limit.h2d()  # warm-up
    rows, results = [], []
    for block_kib in args.block_kib:
        r = bench_block_size(block_kib, total, args.repeats, limit, gpu)
        results.append(r)
        rows.append(
            [
                f"{block_kib} KiB",
                r["limit_d2h_gbps"],
                *_cell(r, "d2h_native", "limit_d2h"),
                *_cell(r, "d2h_direct_native", "limit_d2h"),
                *_cell(r, "d2h_pageable_native", "limit_d2h"),
                *_cell(r, "d2h_jax", "limit_d2h"),
                r["limit_h2d_gbps"],
                *_cell(r, "h2d_native", "limit_h2d"),
                *_cell(r, "h2d_jax", "limit_h2d"),
            ]
        )
        print(f"  {block_kib} KiB done", flush=True)
    paths = {d.path for d in info.devices if d.platform != "cpu"}
    print(
        f"\n{args.total_mib} MiB per transfer, scattered blocks, median of {args.repeats} "
        f"(GB/s; x = ratio to cudaMemcpyAsync on pinned memory); path='auto' on the GPU: "
        f"{', '.join(sorted(paths)) or '?'}"
    )
    print_table(
        [
            "block",
            "memcpy D2H",
            "D2H native",
            "x",
            "no gather",
            "x",
            "unregistered",
            "x",
            "D2H jax",
            "x",
            "memcpy H2D",
            "H2D native",
            "x",
            "H2D jax",
            "x",
        ],
        rows,
    )
    for r in results:
        for key, why in r["errors"].items():
            print(f"  {r['block_kib']} KiB {key}: {why}")
    payload = {
        "benchmark": "gpu_transfer",
        "device": str(gpu.device_kind),
        "paths": sorted(paths),
        "total_bytes": total,
        "repeats": args.repeats,
        "results": results,
    }
    write_json(args.json, payload)
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        shutil.copy(args.json, os.path.join(out, os.path.basename(args.json)))


if __name__ == "__main__":
    main()
