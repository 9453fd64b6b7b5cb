"""HostBuffer: page-aligned, zero-copy host memory; close() and its guard against live views."""

from __future__ import annotations

import ctypes
import gc
import mmap
import time

import jax
import ml_dtypes
import numpy as np
import pytest

import tpusync
from tpusync import HostBuffer
from tpusync._src.memory import deferred_refs
from tpusync.errors import InvalidArgumentError, TpuSyncError

SHAPES_DTYPES = [
    ((16, 4, 2, 8), ml_dtypes.bfloat16),
    ((3,), np.float32),
    ((5, 7), np.int8),  # 35 bytes: less than a page
    ((1024, 1024), np.uint8),  # exactly 256 pages of 4 KiB
    ((4097,), np.uint8),  # one byte past a page
    ((2, 3, 5), ml_dtypes.float8_e5m2),
]


@pytest.mark.parametrize(("shape", "dtype"), SHAPES_DTYPES, ids=str)
def test_page_aligned_with_the_right_view(shape, dtype):
    buffer = HostBuffer(shape, dtype)
    assert buffer.address % mmap.PAGESIZE == 0
    assert buffer.address != 0
    array = buffer.array
    assert array.ctypes.data == buffer.address
    assert array.shape == shape and buffer.shape == shape
    assert array.dtype == np.dtype(dtype) and buffer.dtype == np.dtype(dtype)
    assert buffer.nbytes == int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert array.flags.c_contiguous and array.flags.writeable
    del array  # a live reference to the view keeps close() from unmapping
    buffer.close()


def test_integer_shape_and_dtype_by_name():
    buffer = HostBuffer(10, "bfloat16")
    assert buffer.shape == (10,) and buffer.dtype == np.dtype(ml_dtypes.bfloat16)
    buffer.close()
    buffer = HostBuffer(np.int64(3), np.float32)
    assert buffer.shape == (3,)
    buffer.close()


@pytest.mark.parametrize("populate", [True, False])
def test_zero_copy_both_ways(arrays, rng, populate):
    buffer = HostBuffer((64, 32), np.float32, populate=populate)
    data = arrays.random(rng, (64, 32), np.float32)
    buffer.array[...] = data  # through the view ...
    raw = ctypes.string_at(buffer.address, buffer.nbytes)  # ... is in the memory at address
    assert raw == data.tobytes()
    patch = arrays.random(rng, (32,), np.float32)
    ctypes.memmove(buffer.address + 5 * 32 * 4, patch.tobytes(), patch.nbytes)  # and back
    arrays.assert_same(buffer.array[5], patch)
    assert np.shares_memory(np.asarray(buffer), buffer.array)
    del raw
    buffer.close()


def test_fresh_memory_is_zeroed_and_the_array_interface():
    buffer = HostBuffer((3, 4096), np.uint8)
    assert not buffer.array.any()  # anonymous mappings start zeroed
    as_array = np.asarray(buffer)
    assert np.shares_memory(as_array, buffer.array)
    copied = np.array(buffer, copy=True)
    assert not np.shares_memory(copied, buffer.array)
    as_int = np.asarray(buffer, dtype=np.int16)
    assert as_int.dtype == np.int16 and not np.shares_memory(as_int, buffer.array)
    del as_array
    buffer.close()


def test_close_refuses_while_another_view_lives():
    buffer = HostBuffer((8, 16), np.int32)
    buffer.array[...] = np.arange(8 * 16).reshape(8, 16)
    view = buffer.array[2:4]
    with pytest.raises(BufferError):
        buffer.close()
    # still usable, same memory, same contents
    assert buffer.array.ctypes.data == buffer.address
    assert buffer.array[3, 5] == 3 * 16 + 5
    assert view[1, 5] == 3 * 16 + 5
    view[0, 0] = -7
    assert buffer.array[2, 0] == -7
    assert "closed" not in repr(buffer)
    del view
    gc.collect()
    buffer.close()
    assert repr(buffer) == "HostBuffer(closed)"
    with pytest.raises(InvalidArgumentError) as info:
        _ = buffer.array
    assert isinstance(info.value, TpuSyncError) and isinstance(info.value, ValueError)
    buffer.close()  # closing twice is fine


def test_close_refuses_while_a_reference_to_array_lives():
    buffer = HostBuffer((4,), np.float32)
    held = buffer.array
    with pytest.raises(BufferError):
        buffer.close()
    del held
    buffer.close()


def test_context_manager_closes():
    with HostBuffer((4, 4), np.float32) as buffer:
        assert isinstance(buffer, HostBuffer)
        buffer.array[...] = 1.5
        assert float(buffer.array.sum()) == 24.0
    assert repr(buffer) == "HostBuffer(closed)"
    with pytest.raises(InvalidArgumentError):
        _ = buffer.shape


def test_context_manager_with_a_live_view_raises_on_exit():
    with pytest.raises(BufferError), HostBuffer((4,), np.float32) as buffer:
        view = buffer.array[1:]
    view[0] = 2.0  # the memory is still mapped
    assert buffer.array[1] == 2.0


def test_views_keep_the_memory_alive_after_the_buffer_is_dropped(arrays, rng):
    data = arrays.random(rng, (128, 128), np.int8)
    view = HostBuffer((128, 128), np.int8).array
    gc.collect()
    view[...] = data
    gc.collect()
    arrays.assert_same(view, data)


def test_repr():
    buffer = HostBuffer((2, 3), ml_dtypes.bfloat16)
    text = repr(buffer)
    assert text.startswith("HostBuffer(")
    assert "(2, 3)" in text and "bfloat16" in text and f"0x{buffer.address:x}" in text
    buffer.close()
    assert repr(buffer) == "HostBuffer(closed)"


def test_zero_sized_buffer():
    buffer = HostBuffer((0, 16), np.float32)
    assert buffer.shape == (0, 16) and buffer.nbytes == 0
    assert buffer.address % mmap.PAGESIZE == 0
    buffer.close()


def test_huge_pages_request_still_gives_an_aligned_buffer():
    """huge_pages=True is a hint (transparent huge pages); the buffer works either way."""
    buffer = HostBuffer((4 << 20,), np.uint8, huge_pages=True)
    assert buffer.address % mmap.PAGESIZE == 0
    buffer.array[::4096] = 7
    assert int(buffer.array.sum()) == 7 * 1024
    buffer.close()


def test_distinct_buffers_do_not_overlap():
    a, b = HostBuffer((5000,), np.uint8), HostBuffer((5000,), np.uint8)
    a.array[...] = 1
    b.array[...] = 2
    assert not np.shares_memory(a.array, b.array)
    assert int(a.array.sum()) == 5000 and int(b.array.sum()) == 10000
    a.close()
    b.close()


@pytest.fixture
def no_automatic_gc():
    """Collections only when the code asks: JAX's deferred decrefs then wait as they may."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_close_right_after_a_pure_jax_transfer_into_a_pool(no_automatic_gc, rng):
    """device_put aliases the host buffer on CPU and JAX drops that view only at a collection:
    close() lets it go instead of refusing with a view nothing uses."""
    pool = tpusync.DevicePool(jax.device_put(np.zeros((16, 256), np.float32)))
    host = HostBuffer((16, 256), "float32")
    host.array[...] = rng.random((16, 256), dtype=np.float32)
    expected = host.array.copy()
    order = rng.permutation(16)
    tpusync.transfer(host, pool, src_blocks=order, dst_blocks=order, path="jax").result()
    host.close()
    assert np.array_equal(np.asarray(pool.array), expected)


def test_close_waits_briefly_for_a_view_the_runtime_drops_late() -> None:
    """The runtime's thread may queue its decref after the transfer returns: close() keeps
    collecting for a short while, then lets a view that stays alive refuse it."""
    refusals = iter([BufferError("alive")] * 3)

    def close_once_dropped() -> str:
        refusal = next(refusals, None)
        if refusal is not None:
            raise refusal
        return "closed"

    assert deferred_refs.close_releasing_deferred_views(close_once_dropped) == "closed"

    def never() -> None:
        raise BufferError("alive")

    started = time.monotonic()
    with pytest.raises(BufferError):
        deferred_refs.close_releasing_deferred_views(never)
    assert deferred_refs.SETTLE_S <= time.monotonic() - started < deferred_refs.SETTLE_S + 1


def test_close_still_refuses_a_view_that_is_alive_after_a_transfer(no_automatic_gc, rng):
    pool = tpusync.DevicePool(jax.device_put(np.zeros((8, 64), np.float32)))
    host = HostBuffer((8, 64), "float32")
    host.array[...] = rng.random((8, 64), dtype=np.float32)
    tpusync.transfer(host, pool, path="jax").result()
    view = host.array[2:]
    with pytest.raises(BufferError):
        host.close()
    assert np.array_equal(view, host.array[2:])  # still usable
    del view
    host.close()
