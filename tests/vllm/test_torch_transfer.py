"""PyTorch tensors in transfer() / transfer_batch(): CPU tensors as sources, and as
destinations through TorchPool, bit-exact on every dtype vLLM uses, strided views included, on
both engines; what cannot be moved as raw memory is refused by name. Runs in the vLLM
environment (the main one has no torch)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import assert_same_bits, random_array
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpusync import DevicePool, HostBuffer, TorchPool, Transfer, transfer, transfer_batch
from tpusync.errors import (
    BlocksHeldError,
    DtypeMismatchError,
    InvalidArgumentError,
    NotAPoolError,
    ShapeMismatchError,
    UnsupportedTensorError,
)

# torch dtype -> the numpy dtype of its bytes (what a JAX array of that dtype holds)
DTYPES = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float32: np.dtype(np.float32),
    torch.int8: np.dtype(np.int8),
    torch.uint8: np.dtype(np.uint8),
    torch.int32: np.dtype(np.int32),
    torch.bool: np.dtype(np.bool_),
}
TIMEOUT = 60.0


def tensor_of(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor holding ``array``'s bits (a copy, torch's own memory)."""
    if dtype == torch.bool:
        return torch.from_numpy(array.copy())
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[array.itemsize]
    ints = array.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[array.itemsize])
    return torch.from_numpy(ints.copy()).view(same).view(dtype)


def bits_of(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """A tensor's bits, read by torch (not through tpusync's view)."""
    if tensor.dtype == torch.bool:
        return tensor.contiguous().numpy().copy()
    same = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    return tensor.contiguous().view(same).numpy().copy().view(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_tensor_to_host_and_back_is_bit_exact(
    rng: np.random.Generator, dtype: torch.dtype, path: str
) -> None:
    np_dtype = DTYPES[dtype]
    source = random_array(rng, (12, 4, 32), np_dtype)
    src = tensor_of(source, dtype)
    host = HostBuffer((6, 4, 32), np_dtype)
    order = rng.permutation(12)[:6]
    transfer(src, host, src_blocks=order, dst_blocks=np.arange(6), path=path).result(TIMEOUT)
    assert_same_bits(host.array, source[order], "tensor -> host")
    target = tensor_of(random_array(rng, (12, 4, 32), np_dtype), dtype)
    expected = bits_of(target, np_dtype)
    back = rng.permutation(12)[:6]
    transfer(host, TorchPool(target), src_blocks=np.arange(6), dst_blocks=back,
             path=path).result(TIMEOUT)  # fmt: skip
    expected[back] = source[order]
    assert_same_bits(bits_of(target, np_dtype), expected, "host -> tensor")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.int8], ids=str)
def test_tensor_and_device_pool_meet_both_ways(
    rng: np.random.Generator, dtype: torch.dtype, path: str
) -> None:
    np_dtype = DTYPES[dtype]
    source = random_array(rng, (16, 8, 64), np_dtype)
    pool = DevicePool(jax.device_put(random_array(rng, (16, 8, 64), np_dtype)))
    expected = np.asarray(pool.array).copy()
    ids = rng.permutation(16)[:7]
    transfer(tensor_of(source, dtype), pool, src_blocks=ids, dst_blocks=ids[::-1],
             path=path).result(TIMEOUT)  # fmt: skip
    expected[ids[::-1]] = source[ids]
    assert_same_bits(np.asarray(pool.array), expected, "tensor -> DevicePool")
    target = tensor_of(random_array(rng, (16, 8, 64), np_dtype), dtype)
    want = bits_of(target, np_dtype)
    transfer(pool, TorchPool(target), src_blocks=ids, dst_blocks=ids, path=path).result(TIMEOUT)
    want[ids] = expected[ids]
    assert_same_bits(bits_of(target, np_dtype), want, "DevicePool -> tensor")


def test_vllm_cpu_layer_views_of_one_buffer(rng: np.random.Generator, path: str) -> None:
    """vLLM's CPU layout: every layer a view of one buffer, [blocks, kv_heads, block, 2*head]."""
    layers, blocks, shape = 3, 10, (2, 32, 64)
    buffer = tensor_of(random_array(rng, (layers, blocks, *shape), DTYPES[torch.bfloat16]),
                       torch.bfloat16)  # fmt: skip
    views = [buffer[i] for i in range(layers)]
    host = HostBuffer((4, layers, *shape), DTYPES[torch.bfloat16])
    chosen = np.array([7, 2, 9, 0])
    save = [Transfer(v, host.array[:, i], chosen, np.arange(4)) for i, v in enumerate(views)]
    transfer_batch(save, path=path).result(TIMEOUT)
    before = bits_of(buffer, DTYPES[torch.bfloat16])
    for i in range(layers):
        assert_same_bits(host.array[:, i], before[i][chosen], f"layer {i}")
    pools = [TorchPool(v) for v in views]
    into = np.array([1, 3, 5, 8])
    load = [Transfer(host.array[:, i], p, np.arange(4), into) for i, p in enumerate(pools)]
    transfer_batch(load, path=path).result(TIMEOUT)
    after = bits_of(buffer, DTYPES[torch.bfloat16])
    before[:, into] = before[:, chosen]
    assert_same_bits(after, before, "layers loaded in place")


def strided(tensor: torch.Tensor, kind: str, blocks: int) -> torch.Tensor:
    if kind == "step":
        return tensor[::2]
    if kind == "slice":
        return tensor[1 : 1 + blocks, 1:5]
    return tensor[:blocks].transpose(1, 2)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int32]),
)
def test_strided_views_move_their_own_elements(
    data: st.DataObject, dtype: torch.dtype, path: str
) -> None:
    """Sliced and stepped views (each block contiguous) move the elements they show, nothing
    else; a transposed one, whose blocks are not contiguous, is refused."""
    np_dtype = DTYPES[dtype]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    blocks = data.draw(st.integers(2, 9))
    base = tensor_of(random_array(rng, (blocks * 2, 6, 10), np_dtype), dtype)
    kind = data.draw(st.sampled_from(["step", "slice", "transpose"]))
    view = strided(base, kind, blocks)
    if kind == "transpose":  # blocks that are not contiguous are refused, as numpy's are
        host = HostBuffer(tuple(view.shape), np_dtype)
        with pytest.raises(ShapeMismatchError, match="contiguous"):
            transfer(view, host, path=path)
        return
    want = bits_of(view, np_dtype)
    host = HostBuffer(tuple(view.shape), np_dtype)
    ids = rng.permutation(view.shape[0])
    transfer(view, host, src_blocks=ids, dst_blocks=np.arange(len(ids)), path=path).result(TIMEOUT)
    assert_same_bits(host.array, want[ids], f"{kind} view -> host")
    outside = bits_of(base, np_dtype)
    fresh = random_array(rng, tuple(view.shape), np_dtype)
    transfer(fresh, TorchPool(view), path=path).result(TIMEOUT)
    assert_same_bits(bits_of(view, np_dtype), fresh, f"host -> {kind} view")
    untouched = bits_of(base, np_dtype)
    mask = np.ones(base.shape, dtype=bool)
    marker = torch.zeros(base.shape, dtype=torch.bool)
    strided(marker, kind, blocks).fill_(True)
    mask &= ~marker.numpy()
    assert_same_bits(untouched[mask], outside[mask], "elements outside the view")


def test_a_tensor_destination_must_be_a_torch_pool(rng: np.random.Generator) -> None:
    target = torch.zeros((4, 8), dtype=torch.float32)
    with pytest.raises(NotAPoolError, match="TorchPool"):
        transfer(random_array(rng, (4, 8), np.float32), target)
    assert not target.any()


def test_what_cannot_move_as_raw_memory_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedTensorError, match="complex64"):
        TorchPool(torch.zeros((2, 2), dtype=torch.complex64))
    with pytest.raises(UnsupportedTensorError, match="requires grad"):
        TorchPool(torch.zeros((2, 2), requires_grad=True))
    with pytest.raises(UnsupportedTensorError, match="dense"):
        TorchPool(torch.zeros((2, 2)).to_sparse())
    with pytest.raises(UnsupportedTensorError, match="resolve_conj"):
        transfer(torch.zeros((2, 2), dtype=torch.complex64).conj(), np.zeros((2, 2), np.complex64))
    with pytest.raises(InvalidArgumentError, match=r"torch\.Tensor"):
        TorchPool(np.zeros(3))


def test_dtypes_must_match_bit_for_bit(rng: np.random.Generator) -> None:
    src = tensor_of(random_array(rng, (4, 8), DTYPES[torch.bfloat16]), torch.bfloat16)
    host = np.zeros((4, 8), np.float16)
    with pytest.raises(DtypeMismatchError, match="bfloat16"):
        transfer(src, host)
    assert not host.any()


def test_a_resized_tensor_is_refused_not_written_at_its_old_address(
    rng: np.random.Generator,
) -> None:
    target = torch.zeros((8, 16), dtype=torch.float32)
    pool = TorchPool(target)
    target.resize_((64, 16))  # new memory: the pool's address is stale
    with pytest.raises(InvalidArgumentError, match="new TorchPool"):
        transfer(random_array(rng, (8, 16), np.float32), pool)


def test_held_blocks_of_a_torch_pool_are_not_written(rng: np.random.Generator) -> None:
    target = torch.zeros((8, 16), dtype=torch.float32)
    pool = TorchPool(target)
    pool.hold_blocks([2, 5])
    assert pool.held_blocks() == [2, 5]
    with pytest.raises(BlocksHeldError, match=r"\[5\]"):
        transfer(random_array(rng, (2, 16), np.float32), pool, dst_blocks=[4, 5])
    assert not target.any()
    pool.release_blocks([2, 5])
    transfer(random_array(rng, (2, 16), np.float32), pool, dst_blocks=[4, 5]).result(TIMEOUT)
    assert target[4:6].all()
