"""SGLang HiCache storage: pages between SGLang's host pool and the storage layer, through
tpusync's backend (``batch_set_v1`` / ``batch_get_v1``, DRAM tier in /dev/shm) and through
SGLang's own ``file`` backend with its files in /dev/shm (the same medium), each driven by
SGLang's cache controller code (``_page_backup`` / ``_page_transfer``: batches of 128 pages),
beside the streaming-copy limit of the same bytes, in one run. Imports SGLang: run it in the
SGLang environment (scripts/test.sh makes .venv-sglang).

A model of 8 layers, 8 KV heads of 64, bf16 (16 KiB of KV per token, the vllm_ttft model's),
pages of 64 and 128 tokens, 128 pages a batch (SGLang's storage batch), every MHA host layout.
SGLang's ``shm`` backend is a stand-in in 0.5.23 (it stores nothing: ``exists`` is always
False), so it has no figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.managers.cache_controller import (
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from tpusync._src.bench.common import Run, median, print_table, spread
from tpusync._src.connectors.sglang import TpuSyncHiCacheStorage
from tpusync._src.connectors.sglang.host_pages import host_pages
from tpusync._src.memory.copy_limit import MemoryLimit
from tpusync._src.testing.sglang_controller import controller
from tpusync._src.tiers.dram import pool_path, sessions_path

__all__ = ["QUICK", "main"]

LAYERS, HEADS, HEAD_DIM = 8, 8, 64
DTYPE = torch.bfloat16
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head", "page_unified"]
BACKENDS = ["tpusync", "sglang file"]
QUICK = ["--repeats", "2", "--page-sizes", "64", "--layouts", "page_first"]


def host_pool(layout: str, page_size: int, pages: int) -> Any:
    """SGLang's own MHA host pool of ``pages`` pages (plus its padding page) on CPU, filled
    with random bits."""
    cpu = torch.device("cpu")
    k = tuple(torch.zeros(page_size, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    v = tuple(torch.zeros(page_size, HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS))
    pointers = [torch.tensor([t.data_ptr() for t in side], dtype=torch.uint64) for side in (k, v)]
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=pointers[0], v_data_ptrs=pointers[1],
                        layout=KVBufferLayout.NHD)  # fmt: skip
    info = MHABufferInfo(
        buffers=buffers, page_size=page_size, head_num=HEADS, head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM, dtype=DTYPE, device=cpu,
    )  # fmt: skip
    with host_memory_budget_scope(1 << 40):  # the bench sizes its pool itself
        pool = MHATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=page_size, start_layer=0, end_layer=LAYERS,
            host_token_capacity=pages * page_size,
        )  # fmt: skip
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    rng = np.random.default_rng(0)
    step = 64 << 20
    for start in range(0, raw.numel(), step):
        part = raw[start : start + step]
        part.copy_(torch.from_numpy(rng.integers(0, 256, part.numel(), dtype=np.uint8)))
    return pool


def storage_config(layout: str, extra: dict[str, Any]) -> Any:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="bench-llama",
        extra_config=extra,
    )  # fmt: skip


def _indices(pages: Sequence[int], page_size: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size
            + torch.arange(page_size)[None, :]).reshape(-1)  # fmt: skip


@contextlib.contextmanager
def backend_of(name: str, pool: Any, layout: str, work: str) -> Iterator[tuple[Any, Any]]:
    """The backend ``name`` over ``pool`` and SGLang's controller driving it; removed after."""
    if name == "tpusync":
        shm = f"bench-sglang-{os.getpid()}"
        extra = {"dram": {"capacity_blocks": BATCH, "name": shm}}
        backend = TpuSyncHiCacheStorage(storage_config(layout, extra))
        try:
            backend.register_mem_pool_host(pool)
            yield backend, controller(backend, pool, zero_copy=True)
        finally:
            backend.close()
            pool_path(shm).unlink(missing_ok=True)
            shutil.rmtree(sessions_path(shm), ignore_errors=True)
    else:
        directory = tempfile.mkdtemp(prefix="tpusync-bench-sglang-file-", dir=work)
        try:
            backend = HiCacheFile(storage_config(layout, {}), file_path=directory)
            yield backend, controller(backend, pool, zero_copy=False)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _same_pages(pool: Any, source: list[int], target: list[int]) -> bool:
    pages = host_pages(pool, is_mla=False)
    # as bytes: random bits hold NaNs, which never equal themselves
    return all(torch.equal(r[source].view(torch.uint8), r[target].view(torch.uint8))
               for r in pages.regions)  # fmt: skip


def measure(layout: str, page_size: int, repeats: int, work: str) -> dict[str, Any]:
    """Set and get times of one batch, per backend, alternating the backends per repeat."""
    pool = host_pool(layout, page_size, 2 * BATCH + 1)
    page_bytes = host_pages(pool, is_mla=False).page_elements * pool.kv_buffer.element_size()
    source, target = list(range(BATCH)), list(range(BATCH, 2 * BATCH))
    # SGLang's generic page path (the file backend's) has no flat pages in page_unified
    names = BACKENDS if layout != "page_unified" else BACKENDS[:1]
    runs: dict[str, dict[str, list[float]]] = {b: {"set": [], "get": []} for b in names}
    equal = dict.fromkeys(names, True)
    with contextlib.ExitStack() as stack:
        drive = {b: stack.enter_context(backend_of(b, pool, layout, work)) for b in names}
        for _ in range(repeats):
            for name in names:
                _, control = drive[name]
                keys = [os.urandom(32).hex() for _ in source]
                backup = StorageOperation(_indices(source, page_size), [], hash_value=keys)
                start = time.perf_counter()
                control._page_backup(backup)
                set_s = time.perf_counter() - start
                prefetch = PrefetchOperation("bench", [])
                prefetch.hash_value, prefetch.host_indices = keys, _indices(target, page_size)
                start = time.perf_counter()
                loaded = control._page_transfer(prefetch)
                get_s = time.perf_counter() - start
                ok = backup.completed_tokens == BATCH * page_size and loaded == BATCH
                equal[name] = equal[name] and ok and _same_pages(pool, source, target)
                runs[name]["set"].append(set_s)
                runs[name]["get"].append(get_s)
    limit = MemoryLimit(BATCH * page_bytes, cold=True)
    for _ in range(repeats):
        limit.sample(repeats=3)
    found = limit.result()
    limit.close()
    return {
        "layout": layout,
        "page_size": page_size,
        "page_bytes": page_bytes,
        "batch_pages": BATCH,
        "runs": runs,
        "bytes_equal": equal,
        "limit_gbps": found.gbps,
        "limit_method": found.method,
    }


def rates(r: dict[str, Any], name: str) -> tuple[float, float, float]:
    """(set GB/s, get GB/s, round-trip GB/s: the batch's bytes twice over both times)."""
    moved = r["batch_pages"] * r["page_bytes"]
    set_s, get_s = median(r["runs"][name]["set"]), median(r["runs"][name]["get"])
    return moved / set_s / 1e9, moved / get_s / 1e9, 2 * moved / (set_s + get_s) / 1e9


def table(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        ours = rates(r, "tpusync")
        for name in r["runs"]:
            set_gbps, get_gbps, trip = rates(r, name)
            rows.append([
                r["layout"], r["page_size"], name,
                spread([t * 1e3 for t in r["runs"][name]["set"]], 1),
                spread([t * 1e3 for t in r["runs"][name]["get"]], 1),
                set_gbps, get_gbps, trip, trip / r["limit_gbps"],
                f"{ours[2] / trip:.1f}x" if name == "sglang file" else "-",
                "equal" if r["bytes_equal"][name] else "DIFFERENT",
            ])  # fmt: skip
    print(
        f"\n{BATCH} pages a batch through SGLang's controller code (medians (min-max)); round "
        "trip = the batch's bytes twice over set + get time; x limit = round trip / the "
        "streaming-copy limit of the batch's bytes (caches emptied before each copy); tpusync "
        "DRAM and SGLang's file backend both in /dev/shm; SGLang's shm backend stores nothing "
        "in 0.5.23 (no figure); the file backend goes through SGLang's flat pages, which "
        "page_unified has not"
    )
    print_table(
        ["layout", "page", "backend", "set ms", "get ms", "set GB/s", "get GB/s",
         "round trip GB/s", "x limit", "tpusync x it", "bytes"],
        rows,
        limit_columns=(8,),
    )  # fmt: skip
    for r in results:
        print(f"  limit for {r['layout']} {r['page_size']}: {r['limit_gbps']:.1f} GB/s "
              f"({r['limit_method']})")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--page-sizes", default="64,128")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="default: the results scheme")
    parser.add_argument("--work-dir", default="/dev/shm", help="the file backend's directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = Run("sglang_hicache")
    results = [
        measure(layout, int(size), args.repeats, args.work_dir)
        for size in args.page_sizes.split(",")
        for layout in args.layouts.split(",")
    ]
    table(results)
    run.write(args.json, {"repeats": args.repeats, "work_dir": args.work_dir, "results": results})
    return 0
