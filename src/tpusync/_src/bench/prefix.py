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
measured in the same run: for DRAM, :class:`~tpusync._src.bench.limits.MemoryLimit` of the same
bytes (a copy on all cores timed in C between barriers, so that no dispatch overhead is in a small
copy; the best of memcpy and non-temporal stores), one sample per round alternating with the
loads, medians (np.copyto beside it); for /dev/shm after a restart, the same limit timed in the
restarted process just before its load; for disk, fio's O_DIRECT sequential read of 4 MiB
requests on the same filesystem with as many jobs as the DiskPool's I/O threads, the best of
iodepth 1, 4 and 16. The targets: a memory load (DRAM, /dev/shm) takes at most 1.5x
the bytes over the memory limit's rate, and the 8k prompt's TTFT from DRAM is at least 90% below
cold.

    python benchmarks/prefix_cache.py [--tokens 1024,4096,8192] [--repeats 9] [--json FILE]
        [--shm-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpusync._src.bench.common import Run, median, print_table, settle, spread
from tpusync._src.bench.limits import MemoryLimit, disk_fio
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.tier_specs import DiskTier, DramTier
from tpusync._src.testing import model as M
from tpusync._src.testing.engine import ToyEngine
from tpusync._src.testing.processes import run_json_child
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.dram import pool_path

CACHE = str(Path.home() / ".cache" / "tpusync" / "jax")
SHM_DIR = "/dev/shm"
QUICK = ["--tokens", "1024,4096", "--repeats", "3", "--restarts", "2"]
# the disk tier's I/O threads: the store opens its DiskPool with the default
DISK_IO_THREADS = inspect.signature(DiskPool).parameters["io_threads"].default


def _setup(cache_dir: str) -> None:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _engine(tokens: int, shm_name: str, disk: Path | None, shm_dir: str = SHM_DIR) -> Any:
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


def measure(
    tokens: int, repeats: int, cache_dir: str, shm_dir: str = SHM_DIR, restarts: int = 3
) -> dict[str, Any]:
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
        limit = MemoryLimit(kv_bytes)  # timed in C between barriers: no dispatch overhead
        limit.sample()  # warm-up
        dram, dram_loads, disk, disk_loads, equal = [], [], [], [], True
        for _ in range(repeats):  # one limit sample per round, alternating with the loads
            limit.sample(repeats=3)
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
        found, copyto = limit.result(), limit.copyto_gbps()
        limit.close()
        engine.close()
        fio = _fio_read(work, kv_bytes)
        children = [_restart_child(tokens, shm_name, cache_dir, shm_dir) for _ in range(restarts)]
        for child in children:
            equal &= child["tokens"] == cold.tokens.tolist() and child["tier"] == "dram"
        memcpy_s = kv_bytes / (found.gbps * 1e9)
        return {
            "tokens": tokens,
            "kv_bytes": kv_bytes,
            "cold_ttft_s": median([c.ttft_s for c in colds]),
            "cold_ttft_s_runs": [c.ttft_s for c in colds],
            "dram_ttft_s": median(dram),
            "dram_ttft_s_runs": dram,
            "dram_load_s": median(dram_loads),
            "dram_load_s_runs": dram_loads,
            "shm_restart_ttft_s": median([c["ttft_s"] for c in children]),
            "shm_restart_ttft_s_runs": [c["ttft_s"] for c in children],
            "shm_restart_load_s": median([c["load_s"] for c in children]),
            "shm_restart_load_s_runs": [c["load_s"] for c in children],
            "shm_restart_memcpy_s": median([c["memcpy_s"] for c in children]),
            "shm_restart_limit_method": children[0]["limit_method"] if children else None,
            "disk_ttft_s": median(disk),
            "disk_ttft_s_runs": disk,
            "disk_load_s": median(disk_loads),
            "disk_load_s_runs": disk_loads,
            "memcpy_s": memcpy_s,
            "memcpy_gbps": found.gbps,
            "limit_gbps": found.gbps,
            "limit_method": found.method,
            "limit_gbps_by_method": found.gbps_by_method,
            "copyto_gbps": copyto,
            "fio_read_gbps": fio.get("gbps"),
            "fio_read_method": fio.get("method"),
            "fio_numjobs": DISK_IO_THREADS,
            "outputs_equal": bool(equal),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        path = pool_path(shm_name, shm_dir)
        path.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(f"tpusync-{shm_name}.sessions"), ignore_errors=True)


def _fio_read(work: Path, kv_bytes: int) -> dict[str, Any]:
    """The disk tier's limit: fio's direct sequential read of 4 MiB requests (the DiskPool reads
    runs of up to 4 MiB) on the disk tier's filesystem with as many jobs as its I/O threads, the
    best iodepth; at least 256 MiB, so that the figure is steady. Empty where fio cannot run."""
    directory = work / "fio"
    directory.mkdir()
    total = max(kv_bytes, 256 << 20)
    try:
        found = disk_fio(str(directory), total, 4 << 20, "read", numjobs=DISK_IO_THREADS)
    except RuntimeError as exc:
        print(f"note: fio read in {directory}: {exc}", flush=True)
        return {}
    return {} if found is None else {"gbps": found.gbps, "method": found.method}


def _restart_child(tokens: int, shm_name: str, cache_dir: str, shm_dir: str) -> dict[str, Any]:
    spec = {"tokens": tokens, "shm_name": shm_name, "cache_dir": cache_dir, "shm_dir": shm_dir}
    return run_json_child("tpusync._src.bench.prefix", spec)


def _child(spec: dict[str, Any]) -> None:
    _setup(spec["cache_dir"])
    engine = _engine(spec["tokens"], spec["shm_name"], None, spec["shm_dir"])
    engine.warmup(spec["tokens"], 1, cold=False)
    settle()  # as in the parent: no huge-page collapsing beside the timed request
    # this process's memory limit, timed just before the load, as the parent's alternate
    kv_bytes = -(-spec["tokens"] // engine.config.block_size) * engine.block_bytes()
    limit = MemoryLimit(kv_bytes)
    limit.sample()
    for _ in range(3):
        limit.sample(repeats=3)
    found = limit.result()
    limit.close()
    request = engine.generate(_prompt(spec["tokens"]), 1)
    engine.close()
    print(
        json.dumps(
            {
                "tier": request.lookup_tiers[0] if request.lookup_tiers else "-",
                "ttft_s": request.ttft_s,
                "load_s": request.load.seconds if request.load else float("nan"),
                "memcpy_s": kv_bytes / (found.gbps * 1e9),
                "limit_method": found.method,
                "tokens": request.tokens.tolist(),
            }
        )
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--restarts", type=int, default=3, help="restarted processes, medians")
    parser.add_argument("--json", default=None, help="default: the results scheme")
    parser.add_argument("--compile-cache", default=CACHE)
    parser.add_argument(
        "--shm-dir",
        default=SHM_DIR,
        help="where the named DRAM pool lives (e.g. a tmpfs mounted with huge=within_size)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def _ms_spread(values: Sequence[float]) -> str:
    return spread([v * 1e3 for v in values], 1)


# No peer that runs here keeps a prefix cache of a JAX model's KV (vLLM's own cache and its
# connectors are measured beside tpusync's vLLM connector, benchmarks/vllm_ttft.py).
NO_PEER = "none runs here"


def table(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        limits = {
            "dram": (r["limit_method"], r["kv_bytes"] / r["memcpy_s"] / 1e9),
            "shm_restart": (
                r["shm_restart_limit_method"] or "-",
                r["kv_bytes"] / r["shm_restart_memcpy_s"] / 1e9,
            ),
            "disk": ((r["fio_read_method"] or "fio").split(",")[0], r["fio_read_gbps"]),
        }
        for tier in ("dram", "shm_restart", "disk"):
            ttft, load = r[f"{tier}_ttft_s"], r[f"{tier}_load_s"]
            method, limit_gbps = limits[tier]
            load_gbps = r["kv_bytes"] / load / 1e9
            rows.append(
                [
                    r["tokens"],
                    tier.replace("_", " "),
                    _ms_spread(r["cold_ttft_s_runs"]),
                    _ms_spread(r[f"{tier}_ttft_s_runs"]),
                    (1 - ttft / r["cold_ttft_s"]) * 100,
                    r["kv_bytes"] / 2**20,
                    _ms_spread(r[f"{tier}_load_s_runs"]),
                    load_gbps,
                    method,
                    "-" if limit_gbps is None else limit_gbps,
                    "-" if limit_gbps is None else load_gbps / limit_gbps,
                    "equal" if r["outputs_equal"] else "DIFFERENT",
                    NO_PEER,
                ]
            )
    print(
        "\nTTFT cold vs full prefix hit (compilation excluded), median (min-max); load = lookup "
        "hit -> KV in the device pool; limit = the memory limit of the same bytes, or fio's "
        "direct read with the disk tier's I/O threads, same run; x limit = load GB/s / limit"
    )
    print_table(
        [
            "tokens", "hit from", "cold ms", "warm ms", "TTFT -%", "KV MiB", "load ms",
            "load GB/s", "limit", "limit GB/s", "x limit", "outputs", "peer",
        ],
        rows,
        limit_columns=(10,),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    run = Run("prefix")
    _setup(args.compile_cache)
    results = [
        measure(int(n), args.repeats, args.compile_cache, args.shm_dir, args.restarts)
        for n in args.tokens.split(",")
    ]
    table(results)
    run.write(args.json, {"shm_dir": args.shm_dir, "repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
