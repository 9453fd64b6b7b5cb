"""SGLang's real host pools and storage factory, on CPU (the SGLang environment of
scripts/test.sh): pools of every layout SGLang 0.5.23 builds for MHA and MLA models, filled with
random bits, and backends made through SGLang's ``dynamic`` storage factory."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head", "page_unified"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_unified"]
LAYERS, HEADS, HEAD_DIM, MLA_DIM = 3, 2, 8, 16
DEVICE_TOKENS = 256  # the device pool SGLang sizes the host pool from (x2)
DYNAMIC = {
    "backend_name": "tpusync",
    "module_path": "tpusync.connectors.sglang",
    "class_name": "TpuSyncHiCacheStorage",
    "interface_v1": 1,
}


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def host_pool(
    kind: str,
    layout: str,
    page_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    device_tokens: int = DEVICE_TOKENS,
) -> Any:
    """SGLang's own host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) for a
    device pool of ``device_tokens`` tokens on CPU (the host pool holds twice as many), its
    buffer filled with random bits."""
    cpu = torch.device("cpu")
    if kind == "mha":
        k = tuple(torch.zeros(device_tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
        v = tuple(torch.zeros(device_tokens, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
        buffers = KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v),
                            layout=KVBufferLayout.NHD)  # fmt: skip
        info = MHABufferInfo(
            buffers=buffers, page_size=page_size, head_num=HEADS, head_dim=HEAD_DIM,
            v_head_dim=HEAD_DIM, dtype=dtype, device=cpu,
        )  # fmt: skip
        pool = MHATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device_tokens, start_layer=0, end_layer=LAYERS,
        )  # fmt: skip
    else:
        rows = tuple(torch.zeros(device_tokens, 1, MLA_DIM, dtype=dtype) for _ in range(LAYERS))
        info = MLABufferInfo(
            buffers=rows, data_ptrs=_pointers(rows), layer_indices=tuple(range(LAYERS)),
            device_layer_num=LAYERS, page_size=page_size, kv_lora_rank=MLA_DIM - 4,
            qk_rope_head_dim=4, kv_cache_dim=MLA_DIM, dtype=dtype, device=cpu,
        )  # fmt: skip
        pool = MLATokenToKVPoolHost(
            info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device_tokens, start_layer=0, end_layer=LAYERS,
            target_layer_num=LAYERS,
        )  # fmt: skip
    randomize(pool)
    return pool


def randomize(pool: Any) -> None:
    """Random bits into the whole host buffer (never zeros)."""
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.from_numpy(np.random.default_rng().integers(0, 256, raw.numel(), np.uint8)))


def storage_config(kind: str, layout: str, extra: dict[str, Any], **fields: Any) -> Any:
    values = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="tiny-llama",
        extra_config={**DYNAMIC, **extra},
    )  # fmt: skip
    values.update(fields)
    return HiCacheStorageConfig(**values)


@pytest.fixture
def backends(shm_names: Callable[[], str]) -> Iterator[Callable[..., Any]]:
    """``make(pool, kind, extra={...}, **config fields)``: a backend made the way SGLang's
    cache controller makes it (the ``dynamic`` factory, then the host pool registered), closed
    at the end of the test."""
    made: list[Any] = []

    def make(pool: Any, kind: str, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
        config = storage_config(kind, pool.layout, extra or {}, **fields)
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        made.append(backend)
        backend.register_mem_pool_host(pool)
        return backend

    yield make
    for backend in made:
        backend.close()


def page_bytes(pool: Any, page: int) -> bytes:
    """Page ``page`` of ``pool`` as SGLang's own ``get_data_page`` reads it, or (page_unified,
    which has none) the page's bytes."""
    if pool.layout == "page_unified":
        return pool.kv_buffer[page].contiguous().view(torch.uint8).numpy().tobytes()
    flat = pool.get_data_page(page * pool.page_size, flat=True)
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


def indices(pages: list[int], page_size: int) -> torch.Tensor:
    """SGLang's host_indices for ``pages``: every token slot of each page, in order."""
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)],
                        dtype=torch.int64)  # fmt: skip


def keys(n: int, tag: str = "") -> list[str]:
    """SGLang-shaped page keys (64 hex characters), random."""
    return [os.urandom(32).hex() for _ in range(n)]


@dataclasses.dataclass
class Case:
    kind: str
    layout: str


CASES = [Case("mha", lay) for lay in MHA_LAYOUTS] + [Case("mla", lay) for lay in MLA_LAYOUTS]
