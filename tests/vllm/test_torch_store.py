"""A KV store over torch tensors (TorchPools), as the vLLM connector opens it: blocks keyed by
an engine's hashes round-trip bit-exact, and a tensor moved since its pool was made is refused
by the store's kept plans too (never written at its old address)."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from tpusync import TorchPool
from tpusync._src.memory.torch_tensors import prefault_cpu_tensors
from tpusync.errors import InvalidArgumentError
from tpusync.kv import KVCacheStore, KVStoreConfig

BLOCK = 32


def _store(buffer: torch.Tensor) -> tuple[KVCacheStore, list[TorchPool]]:
    pools = [TorchPool(buffer[i], name=f"layer{i}") for i in range(buffer.shape[0])]
    config = KVStoreConfig.from_dict(
        {"model_id": "m", "block_size": BLOCK, "token_axis": 2, "dram": {"capacity_blocks": 16}}
    )
    return KVCacheStore(config, pools), pools


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_engine_keyed_blocks_round_trip_bit_exact(dtype: torch.dtype) -> None:
    buffer = (torch.randn(3, 12, 2, BLOCK, 64) * 4).to(dtype)
    store, _ = _store(buffer)
    try:
        hashes = [os.urandom(32) for _ in range(4)]
        store.save_engine_blocks_async(hashes, [1, 3, 5, 7]).result()
        before = buffer.clone()
        for _ in range(2):  # the second load runs the plan the pool keeps
            result = store.lookup_engine_blocks([*hashes, os.urandom(32)])
            assert result.num_blocks == 4
            assert store.load(result, [8, 9, 10, 11]).loaded_blocks == 4
        same = buffer[:, [8, 9, 10, 11]].view(torch.uint8)
        assert torch.equal(same, before[:, [1, 3, 5, 7]].view(torch.uint8))
        assert torch.equal(buffer[:, :8].view(torch.uint8), before[:, :8].view(torch.uint8))
    finally:
        store.close()


def test_warmup_plans_both_directions_over_torch_pools_and_moves_nothing() -> None:
    buffer = torch.randn(3, 12, 2, BLOCK, 64).to(torch.bfloat16)
    store, _ = _store(buffer)
    try:
        hashes = [os.urandom(32) for _ in range(3)]
        store.save_engine_blocks_async(hashes, [0, 2, 4]).result()
        store.flush(timeout=30)
        before = buffer.clone()
        store.warmup(wait_mapped=False)
        plans = {way: id(plan) for way, plan in store.dram._mover._kept.plans.items()}
        assert set(plans) == {True, False}  # loads and saves: planned now, not on first use
        assert torch.equal(buffer.view(torch.uint8), before.view(torch.uint8))
        assert store.load(store.lookup_engine_blocks(hashes), [5, 7, 9]).loaded_blocks == 3
        # the load ran the plan made by warmup
        assert {way: id(plan) for way, plan in store.dram._mover._kept.plans.items()} == plans
        moved = buffer[:, [5, 7, 9]].view(torch.uint8)
        assert torch.equal(moved, before[:, [0, 2, 4]].view(torch.uint8))
    finally:
        store.close()


def test_a_tensor_re_pointed_after_the_plan_was_kept_is_refused() -> None:
    buffer = torch.randn(2, 8, 2, BLOCK, 64).to(torch.bfloat16)
    store, pools = _store(buffer)
    try:
        hashes = [os.urandom(32) for _ in range(2)]
        store.save_engine_blocks_async(hashes, [0, 1]).result()
        store.load(store.lookup_engine_blocks(hashes), [2, 3])  # keeps its plan
        old = buffer.clone()
        layer = pools[0].tensor
        layer.set_(torch.zeros_like(layer))  # the pool's tensor now has other memory
        result = store.lookup_engine_blocks(hashes)
        with pytest.raises(InvalidArgumentError, match="re-pointed"):
            store.load(result, [4, 5])
        store.release(result)
        assert torch.equal(buffer.view(torch.int16), old.view(torch.int16))  # nothing written
    finally:
        store.close()


def _resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(resident pages, pages) of the whole pages inside [address, address + nbytes), from
    mincore(2)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-address // page) * page
    count = (address + nbytes - first) // page
    vector = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(first), count * page, vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector), count


def test_prefaulting_vllms_kv_memory_maps_it_once_and_keeps_its_bytes() -> None:
    """vLLM allocates its CPU KV cache and touches a block first when it writes it; the
    connector maps it all at registration, so a load into a fresh block pays no page faults:
    every page becomes resident, each storage is counted once (the layers are views of one
    buffer) and no byte changes."""
    # 64 MiB, never touched: above glibc's largest mmap threshold (32 MiB), so fresh pages even
    # after earlier tests freed large blocks (which raises the threshold and keeps heap pages)
    buffer = torch.empty(2, 64, 4, 32, 1024, dtype=torch.bfloat16)
    buffer[0, 0].normal_()  # a few pages hold data already
    before = buffer[0, 0].clone()
    address, nbytes = buffer.data_ptr(), buffer.untyped_storage().nbytes()
    resident, pages = _resident_pages(address, nbytes)
    assert resident < pages // 2
    assert prefault_cpu_tensors([buffer[0], buffer[1], buffer[1]]) == nbytes
    assert _resident_pages(address, nbytes) == (pages, pages)
    assert torch.equal(buffer[0, 0], before)
    assert prefault_cpu_tensors([]) == 0
