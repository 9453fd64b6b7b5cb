"""Time to first token cold vs warm with tpusync's KV cache store, and the load GB/s vs memcpy.

For prompts of 1k, 4k and 8k tokens, the test model (``tpusync.testing``, 4 layers, 8 KV heads of
32: 128 KiB of KV per 16-token block) serves the prompt cold, saves it, then serves it with a full
prefix hit (the last token recomputed) from:

* DRAM — the store's DRAM tier, warm;
* /dev/shm after a restart — a new process attaches to the named pool, warms up (as a server
  does before taking requests) and serves it; its first load reads a freshly attached mapping.
  Three restarts, medians;
* disk — the blocks evicted from DRAM, read back from the DiskPool (O_DIRECT where allowed).

TTFT excludes compilation on both sides. Each load's GB/s is set beside its physical limit,
measured in the same run: for DRAM, ``np.copyto`` of the same bytes into touched memory (one
thread per core), alternating with the loads, medians; for /dev/shm after a restart, the same
copy timed in the restarted process just before its load; for disk, fio's O_DIRECT sequential
read on the same filesystem (the better of one 4 MiB request at a time and four in flight, as
the DiskPool's I/O threads read). The targets: a memory load (DRAM, /dev/shm) takes at most 1.5x
the bytes over the memcpy rate, and the 8k prompt's TTFT from DRAM is at least 90% below cold.

    python benchmarks/prefix_cache.py [--tokens 1024,4096,8192] [--repeats 9] [--json FILE]
        [--shm-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MemcpyLimit, fio_gbps, median, print_table, settle, timed, write_json

CACHE = str(Path.home() / ".cache" / "tpusync" / "jax")
SHM_DIR = "/dev/shm"


def _setup(cache_dir: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _engine(tokens: int, shm_name: str, disk: Path | None, shm_dir: str = SHM_DIR) -> Any:
    from tpusync.kv import DiskTier, DramTier, KVStoreConfig
    from tpusync.testing import model as M
    from tpusync.testing.engine import ToyEngine

    per_seq = M.blocks_needed(M.ModelConfig(), tokens + 32)
    config = M.ModelConfig(
        n_kv_heads=8, head_dim=32, max_blocks_per_seq=per_seq, num_blocks=2 * per_seq + 16
    )
    blocks = M.blocks_needed(config, tokens)
    store = KVStoreConfig(
        model_id="bench-prefix-cache",
        block_size=config.block_size,
        dram=DramTier(2 * blocks + 16, name=shm_name, shm_dir=shm_dir),
        tiers=(DiskTier(disk, 2 * blocks + 16, create=True),) if disk else (),
    )
    return ToyEngine(config, store)


def _prompt(tokens: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, tokens).astype(np.int32)


def _same(request: Any, cold: Any) -> bool:
    return bool(
        np.array_equal(request.tokens, cold.tokens)
        and np.array_equal(request.prefill_logits, cold.prefill_logits)
    )


def measure(tokens: int, repeats: int, cache_dir: str, shm_dir: str = SHM_DIR) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tpusync-bench-"))
    shm_name = f"bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        engine = _engine(tokens, shm_name, work / "disk", shm_dir)
        engine.warmup(tokens, 1, cold=True)
        prompt = _prompt(tokens)
        colds = [
            engine.generate(prompt, 1, use_cache=False, save=False, boundary=tokens - 1)
            for _ in range(max(2, repeats // 2))
        ]
        cold = engine.generate(prompt, 1, use_cache=False, boundary=tokens - 1)
        colds.append(cold)
        engine.store.flush()
        settle()
        kv_bytes = -(-tokens // engine.config.block_size) * engine.block_bytes()
        limit = MemcpyLimit(kv_bytes)
        limit.copy()
        dram, dram_loads, memcpy, disk, disk_loads, equal = [], [], [], [], [], True
        for _ in range(repeats):
            memcpy.extend(timed(limit.copy) for _ in range(3))  # a steadier limit
            request = engine.generate(prompt, 1)
            equal &= _same(request, cold) and request.lookup_tiers[0] == "dram"
            dram.append(request.ttft_s)
            dram_loads.append(request.load.seconds)
        for _ in range(repeats):
            engine.store.evict(prompt, tier="dram")
            request = engine.generate(prompt, 1)
            equal &= _same(request, cold) and request.lookup_tiers[0] == "disk"
            disk.append(request.ttft_s)
            disk_loads.append(request.load.seconds)
        limit.close()
        engine.close()
        fio_read = _fio_read_gbps(work, kv_bytes)
        children = [_restart_child(tokens, shm_name, cache_dir, shm_dir) for _ in range(3)]
        for child in children:
            equal &= child["tokens"] == cold.tokens.tolist() and child["tier"] == "dram"
        memcpy_s = median(memcpy)
        return {
            "tokens": tokens,
            "kv_bytes": kv_bytes,
            "cold_ttft_s": median([c.ttft_s for c in colds]),
            "dram_ttft_s": median(dram),
            "dram_load_s": median(dram_loads),
            "shm_restart_ttft_s": median([c["ttft_s"] for c in children]),
            "shm_restart_load_s": median([c["load_s"] for c in children]),
            "shm_restart_memcpy_s": median([c["memcpy_s"] for c in children]),
            "disk_ttft_s": median(disk),
            "disk_load_s": median(disk_loads),
            "memcpy_s": memcpy_s,
            "memcpy_gbps": kv_bytes / memcpy_s / 1e9,
            "fio_read_gbps": fio_read,
            "outputs_equal": bool(equal),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        from tpusync.tiers.dram import pool_path

        path = pool_path(shm_name, shm_dir)
        path.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(f"tpusync-{shm_name}.sessions"), ignore_errors=True)


def _fio_read_gbps(work: Path, kv_bytes: int) -> float | None:
    """The disk tier's limit: fio's better direct sequential read on the disk tier's
    filesystem, one 4 MiB request at a time or four in flight (the DiskPool reads runs of up to 4
    MiB on 4 I/O threads); at least 256 MiB, so that the figure is steady."""
    directory = work / "fio"
    directory.mkdir()
    total = max(kv_bytes, 256 << 20)
    runs = [
        fio_gbps(str(directory), total, 4 << 20, "read"),
        fio_gbps(str(directory), total, 4 << 20, "read", ioengine="libaio", iodepth=4),
    ]
    measured = [gbps for gbps in runs if gbps is not None]
    return max(measured) if measured else None


def _restart_child(tokens: int, shm_name: str, cache_dir: str, shm_dir: str) -> dict[str, Any]:
    spec = json.dumps(
        {"tokens": tokens, "shm_name": shm_name, "cache_dir": cache_dir, "shm_dir": shm_dir}
    )
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", spec],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    if process.returncode:
        raise RuntimeError(f"restart child failed with exit code {process.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def _child(spec: dict[str, Any]) -> None:
    _setup(spec["cache_dir"])
    engine = _engine(spec["tokens"], spec["shm_name"], None, spec["shm_dir"])
    engine.warmup(spec["tokens"], 1, cold=False)
    settle()  # as in the parent: no huge-page collapsing beside the timed request
    # this process's memcpy limit, timed just before the load, as the parent's alternate
    limit = MemcpyLimit(-(-spec["tokens"] // engine.config.block_size) * engine.block_bytes())
    limit.copy()
    memcpy_s = median([timed(limit.copy) for _ in range(3)])
    limit.close()
    request = engine.generate(_prompt(spec["tokens"]), 1)
    engine.close()
    print(
        json.dumps(
            {
                "tier": request.lookup_tiers[0] if request.lookup_tiers else "-",
                "ttft_s": request.ttft_s,
                "load_s": request.load.seconds if request.load else float("nan"),
                "memcpy_s": memcpy_s,
                "tokens": request.tokens.tolist(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default="prefix_cache.json")
    parser.add_argument("--compile-cache", default=CACHE)
    parser.add_argument(
        "--shm-dir",
        default=SHM_DIR,
        help="where the named DRAM pool lives (e.g. a tmpfs mounted with huge=within_size)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(json.loads(args.child))
        return
    _setup(args.compile_cache)
    results = [
        measure(int(n), args.repeats, args.compile_cache, args.shm_dir)
        for n in args.tokens.split(",")
    ]
    rows = []
    for r in results:
        limits = {
            "dram": ("memcpy", r["kv_bytes"] / r["memcpy_s"] / 1e9),
            "shm_restart": ("memcpy", r["kv_bytes"] / r["shm_restart_memcpy_s"] / 1e9),
            "disk": ("fio read", r["fio_read_gbps"] or float("nan")),
        }
        for tier in ("dram", "shm_restart", "disk"):
            ttft, load = r[f"{tier}_ttft_s"], r[f"{tier}_load_s"]
            limit, limit_gbps = limits[tier]
            rows.append(
                [
                    r["tokens"],
                    tier.replace("_", " "),
                    r["cold_ttft_s"] * 1e3,
                    ttft * 1e3,
                    (1 - ttft / r["cold_ttft_s"]) * 100,
                    r["kv_bytes"] / 2**20,
                    load * 1e3,
                    r["kv_bytes"] / load / 1e9,
                    limit,
                    limit_gbps,
                    limit_gbps / (r["kv_bytes"] / load / 1e9),
                    "equal" if r["outputs_equal"] else "DIFFERENT",
                ]
            )
    print(
        "\nTTFT cold vs full prefix hit (compilation excluded); load = lookup hit -> KV in the "
        "device pool; limit = np.copyto of the same bytes (one thread per core) or fio's direct "
        "read, same run"
    )
    print_table(
        [
            "tokens",
            "hit from",
            "cold ms",
            "warm ms",
            "TTFT -%",
            "KV MiB",
            "load ms",
            "load GB/s",
            "limit",
            "limit GB/s",
            "load/limit time",
            "outputs",
        ],
        rows,
    )
    write_json(
        args.json, {"benchmark": "prefix_cache", "shm_dir": args.shm_dir, "results": results}
    )


if __name__ == "__main__":
    main()
