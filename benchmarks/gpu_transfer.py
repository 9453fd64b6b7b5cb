"""Device<->host GB/s of tpusync.transfer on a GPU, beside cudaMemcpyAsync on pinned memory.

For each block size, moves ``--total-mib`` of scattered blocks (a random permutation) between a
``DevicePool`` on the first GPU and a ``HostBuffer``, both directions, with the path tpusync picks
for the GPU (``auto``: the PJRT C API path once it is enabled there, the pure-JAX path until then;
``tpusync.info()`` printed first says which and why) and with the pure-JAX path, checking that
both deliver the same bytes. The limit, alternating with them in the same run: CuPy's
``cudaMemcpyAsync`` of the same bytes between device memory and pinned host memory in one call
per direction, timed with CUDA events. Medians; prints a table; writes JSON (also into ``$OUT``
when that is set, for the device tool).

    python benchmarks/gpu_transfer.py [--total-mib 1024] [--repeats 5] [--json FILE]

Needs jax with a GPU backend and CuPy; says so and exits 2 without them.
"""

from __future__ import annotations

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

    # bytes: each path's device->host result equals the source blocks, and host->device puts
    # them back where they came from
    same = True
    for path in ("auto", "jax"):
        host.array.view(np.uint16)[...] = 0x5A5A
        d2h(path)
        same &= bool(np.array_equal(host.array.view(np.uint16), bits[order]))
        h2d(path)
        same &= bool(np.array_equal(np.asarray(pool.array).view(np.uint16), bits))
    times: dict[str, list[float]] = {
        k: [] for k in ("limit_d2h", "limit_h2d", "d2h_auto", "d2h_jax", "h2d_auto", "h2d_jax")
    }
    for _ in range(repeats):
        times["limit_d2h"].append(limit.d2h())
        times["d2h_auto"].append(_timed(lambda: d2h("auto")))
        times["d2h_jax"].append(_timed(lambda: d2h("jax")))
        times["limit_h2d"].append(limit.h2d())
        times["h2d_auto"].append(_timed(lambda: h2d("auto")))
        times["h2d_jax"].append(_timed(lambda: h2d("jax")))
    result: dict[str, Any] = {"block_kib": block_kib, "bytes": nbytes, "bytes_equal": same}
    for key, values in times.items():
        moved = limit.nbytes if key.startswith("limit") else nbytes
        result[f"{key}_gbps"] = moved / median(values) / 1e9
    result["seconds"] = times
    host.close()
    return result


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
                r["d2h_auto_gbps"],
                r["d2h_auto_gbps"] / r["limit_d2h_gbps"],
                r["d2h_jax_gbps"],
                r["limit_h2d_gbps"],
                r["h2d_auto_gbps"],
                r["h2d_auto_gbps"] / r["limit_h2d_gbps"],
                r["h2d_jax_gbps"],
                "yes" if r["bytes_equal"] else "NO",
            ]
        )
        print(f"  {block_kib} KiB done", flush=True)
    paths = {d.path for d in info.devices if d.platform != "cpu"}
    print(
        f"\n{args.total_mib} MiB per transfer, scattered blocks, median of {args.repeats} "
        f"(GB/s; x = ratio to cudaMemcpyAsync on pinned memory); tpusync's path on the GPU: "
        f"{', '.join(sorted(paths)) or '?'}"
    )
    print_table(
        [
            "block",
            "memcpy D2H",
            "D2H auto",
            "x",
            "D2H jax",
            "memcpy H2D",
            "H2D auto",
            "x",
            "H2D jax",
            "bytes equal",
        ],
        rows,
    )
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
