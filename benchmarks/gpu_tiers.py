"""The DRAM tier on a GPU: KV blocks of per-layer device pools stored into a ``HostPool`` and
loaded back, with the native PJRT engine (``path="native"``: reads through the plugin, writes
where it can) and with the pure-JAX engine, each checked byte for byte and against the block
checksums the pool records (which must not depend on the engine). GB/s per direction, medians,
beside one ``cudaMemcpyAsync`` of the same bytes on pinned memory (the limit).

    python benchmarks/gpu_tiers.py [--layers 8] [--blocks 256] [--block-kib 256] [--repeats 5]

Needs jax with a GPU backend and CuPy; says so and exits 2 without them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, write_json
from gpu_transfer import CudaMemcpyLimit, _gpu

from tpusync._src.bench.common import result_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=256, help="bytes per block per layer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="default: benchmarks/results/gpu_tiers/COMMIT-MACHINE.json")
    args = parser.parse_args()
    gpu = _gpu()
    import jax

    import tpusync
    from tpusync.tiers import HostPool, PoolLayout

    # path="auto" (the loads of the "native" row) is what tpusync chooses for this device: pure
    # JAX on a GPU until a run proves the plugin's path; the rows say which engine ran
    auto_engine = next(
        (d.path for d in tpusync.info().devices if d.platform == gpu.platform and d.id == gpu.id),
        "unknown",
    )
    rng = np.random.default_rng(7)
    row = args.block_kib * 1024 // 2
    sources = [
        rng.integers(1, 2**16, size=(args.blocks, row), dtype=np.uint16) for _ in range(args.layers)
    ]
    pools = [
        tpusync.DevicePool(jax.device_put(s.view(jax.numpy.bfloat16), gpu), name=f"layer{i}")
        for i, s in enumerate(sources)
    ]
    layout = PoolLayout.from_pools("gpu-tiers", pools)
    half = args.blocks // 2
    nbytes = half * layout.slot_bytes
    limit = CudaMemcpyLimit(nbytes)
    limit.d2h(), limit.h2d()
    rows, results = [], {}
    keys = [f"blk{b}".encode() for b in range(half)]
    blocks = rng.permutation(args.blocks)[:half]  # scattered sources, the same for both engines
    targets = rng.permutation(np.setdiff1d(np.arange(args.blocks), blocks))[:half]
    for path in ("native", "jax"):
        host = HostPool(layout, half)
        host.prepare(pools)
        out: dict[str, Any] = {}
        try:
            host.put_from_device(keys, pools, blocks, path=path)
            host.get_to_device(keys, pools, targets, path="auto" if path == "native" else path)
        except Exception as exc:  # reported, not fatal
            out["error"] = f"{type(exc).__name__}: {exc}"
            results[path] = out
            host.close()
            continue
        ok = all(
            np.array_equal(np.asarray(p.array).view(np.uint16)[targets], s[blocks])
            for p, s in zip(pools, sources, strict=True)
        )
        out["bytes_equal"] = bool(ok)
        out["checksums"] = [int(c) for c in host._records["checksum"][:4]]
        times: dict[str, list[float]] = {"put": [], "get": [], "limit_d2h": [], "limit_h2d": []}
        get_path = "auto" if path == "native" else path
        get_engine = auto_engine if get_path == "auto" else get_path
        out["put_engine"], out["get_engine"] = path, get_engine
        for _ in range(args.repeats):
            host.delete(keys)
            times["limit_d2h"].append(limit.d2h())
            start = time.perf_counter()
            host.put_from_device(keys, pools, blocks, path=path)
            times["put"].append(time.perf_counter() - start)
            times["limit_h2d"].append(limit.h2d())
            start = time.perf_counter()
            host.get_to_device(keys, pools, targets, path=get_path)
            times["get"].append(time.perf_counter() - start)
        for key, values in times.items():
            out[f"{key}_gbps"] = nbytes / median(values) / 1e9
        results[path] = out
        rows.append(
            [
                f"put {path}, get {get_path}" + (f" ({get_engine})" if get_path == "auto" else ""),
                out["limit_d2h_gbps"],
                out["put_gbps"],
                out["put_gbps"] / out["limit_d2h_gbps"],
                out["limit_h2d_gbps"],
                out["get_gbps"],
                out["get_gbps"] / out["limit_h2d_gbps"],
                "yes" if ok else "NO",
            ]
        )
        host.close()
    print(
        f"\n{args.layers} layers x {half} blocks x {args.block_kib} KiB = {nbytes / 2**20:.0f} MiB "
        f"per call, median of {args.repeats} (GB/s; x = ratio to cudaMemcpyAsync, pinned)"
    )
    headers = ["engines that ran", "memcpy D2H", "put", "x", "memcpy H2D", "get", "x", "equal"]
    print_table(headers, rows)
    for path, out in results.items():
        if "error" in out:
            print(f"  {path}: {out['error']}")
    same = [r.get("checksums") for r in results.values() if "checksums" in r]
    print(f"  block checksums equal across engines: {len(same) == 2 and same[0] == same[1]}")
    if args.json is None:
        args.json = str(
            result_path("gpu_tiers", os.path.join(os.path.dirname(__file__), "results"))
        )
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
    write_json(args.json, {"benchmark": "gpu_tiers", "device": str(gpu.device_kind),
                           "results": results})  # fmt: skip
    out_dir = os.environ.get("OUT")
    if out_dir and os.path.isdir(out_dir):
        write_json(os.path.join(out_dir, os.path.basename(args.json)), {"results": results})


if __name__ == "__main__":
    main()
