"""Rejected calls: the right tpusync exception (which is also the matching builtin), a message
naming the argument, raised by transfer() itself before any byte moves — the destination is
unchanged afterwards (and a pool keeps its very array).

A message names the argument at fault as its label, ``"dst_blocks: block index 8 is out of
range ..."`` (after a prefix such as ``"path='native' cannot run here: "``). The check matches
that label exactly: ``dst`` is not named by ``dst_blocks: ...`` nor by ``... src's shape``."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync import DevicePool, HostBuffer, Transfer, transfer, transfer_batch
from tpusync.errors import (
    ArrayDeletedError,
    BlockIndexError,
    DtypeMismatchError,
    InvalidArgumentError,
    NativePathUnavailableError,
    NotAPoolError,
    ReadOnlyDestinationError,
    ShapeMismatchError,
    TpuSyncError,
    WrongDeviceError,
)

PATHS = ("auto", "native", "jax")


def put(x: np.ndarray, target: Any = None) -> jax.Array:
    return jax.device_put(np.array(x, copy=True), target or jax.devices()[0])


class Snapshot:
    """The destination's bits now, to compare after the rejected call."""

    def __init__(self, arrays: Any, dst: Any) -> None:
        self.arrays = arrays
        self.dst = dst
        self.array = dst.array if isinstance(dst, DevicePool) else None
        self.bits = arrays.bits(self._read()).copy()

    def _read(self) -> Any:
        if isinstance(self.dst, DevicePool):
            return self.dst.array
        if isinstance(self.dst, HostBuffer):
            return self.dst.array
        return self.dst

    def unchanged(self) -> None:
        if isinstance(self.dst, DevicePool):
            assert self.dst.array is self.array, "the pool's array was replaced"
            assert not self.array.is_deleted(), "the pool's array was deleted"
        self.arrays.assert_same(self._read(), self.bits, "destination after a rejected call")


def labelled(argument: str) -> str:
    """The regular expression of a message naming `argument` as its label: at the start or
    after a ``": "`` prefix, followed by ``": "`` (for pytest.raises(match=...) too)."""
    return rf"(?:^|: ){re.escape(argument)}: "


def rejected(
    arrays: Any,
    call: Callable[[], Any],
    dst: Any,
    error: type[TpuSyncError],
    builtin: type[BaseException],
    argument: str | None,
) -> TpuSyncError:
    """call() raises `error` (a TpuSyncError and a `builtin`) naming `argument` (None: a case
    whose label another test checks), and leaves dst as it was."""
    snapshot = Snapshot(arrays, dst) if dst is not None else None
    with pytest.raises(error) as info:
        future = call()
        # a future that fails later is not a rejection: nothing may have been scheduled
        pytest.fail(f"no exception from the call; it returned {future!r}")
    exc = info.value
    assert isinstance(exc, TpuSyncError)
    assert isinstance(exc, builtin), f"{type(exc).__name__} is not a {builtin.__name__}"
    if argument is not None:
        assert re.search(labelled(argument), str(exc)), (
            f"the message does not name {argument!r}: {exc}"
        )
    if snapshot is not None:
        snapshot.unchanged()
    return exc


def test_labelled_matches_the_whole_argument_name():
    """The check itself: a longer name, a possessive or a dotted attribute is not the label."""
    assert re.search(labelled("dst"), "dst: rank 3 differs from src's rank 2")
    assert re.search(labelled("dst"), "path='native' cannot run here: dst: dtype int4 ...")
    assert re.search(labelled("transfers[1]"), "transfers[1]: expected tpusync.Transfer")
    assert not re.search(labelled("dst"), "dst_blocks: block index 8 is out of range")
    assert not re.search(labelled("blocks"), "dst_blocks: block index 8 is out of range")
    assert not re.search(labelled("src"), "dst: shape (8, 4) does not match src's (8, 5)")
    assert not re.search(labelled("dst"), "pool.dst: closed")
    assert not re.search(labelled("transfers[1]"), "transfers[10]: expected tpusync.Transfer")


@pytest.fixture(params=PATHS)
def any_path(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pool(arrays, rng) -> DevicePool:
    return DevicePool(put(arrays.random(rng, (8, 4, 16), np.float32)), name="dst-pool")


@pytest.fixture
def device_src(arrays, rng) -> jax.Array:
    return put(arrays.random(rng, (8, 4, 16), np.float32))


@pytest.fixture
def host(arrays, rng) -> np.ndarray:
    return arrays.random(rng, (8, 4, 16), np.float32)


# --- dtype, shape, rank ---------------------------------------------------------------------------


def test_dtype_mismatch_device_to_host(arrays, device_src, any_path):
    dst = np.ones((8, 4, 16), np.int32)
    exc = rejected(
        arrays,
        lambda: transfer(device_src, dst, path=any_path),
        dst,
        DtypeMismatchError,
        ValueError,
        "dst",
    )
    assert "float32" in str(exc) and "int32" in str(exc)


def test_dtype_mismatch_same_width_suggests_a_view(arrays, rng, any_path):
    pool = DevicePool(put(arrays.random(rng, (6, 8), np.float16)))
    src = arrays.random(rng, (6, 8), ml_dtypes.bfloat16)
    exc = rejected(
        arrays,
        lambda: transfer(src, pool, path=any_path),
        pool,
        DtypeMismatchError,
        ValueError,
        "dst",
    )
    assert ".view(" in str(exc)


def test_dtype_mismatch_host_to_host_and_device_to_device(arrays, rng, pool, any_path):
    src = arrays.random(rng, (8, 4, 16), np.int32)
    dst = arrays.random(rng, (8, 4, 16), np.uint32)
    rejected(
        arrays,
        lambda: transfer(src, dst, path=any_path),
        dst,
        DtypeMismatchError,
        ValueError,
        "dst",
    )
    other = DevicePool(put(arrays.random(rng, (8, 4, 16), np.int32)))
    rejected(
        arrays,
        lambda: transfer(other, pool, path=any_path),
        pool,
        DtypeMismatchError,
        ValueError,
        "dst",
    )


@pytest.mark.parametrize("block", [(4, 17), (5, 16), (16, 4), (64,)], ids=str)
def test_block_shape_mismatch(arrays, rng, device_src, pool, any_path, block):
    host = arrays.random(rng, (8, *block), np.float32)
    if len(block) == 2:
        rejected(
            arrays,
            lambda: transfer(device_src, host, path=any_path),
            host,
            ShapeMismatchError,
            ValueError,
            "dst",
        )
        rejected(
            arrays,
            lambda: transfer(host, pool, path=any_path),
            pool,
            ShapeMismatchError,
            ValueError,
            "src",
        )
    else:  # a rank mismatch too
        rejected(
            arrays,
            lambda: transfer(device_src, host, path=any_path),
            host,
            ShapeMismatchError,
            ValueError,
            "dst",
        )
    other = DevicePool(put(arrays.random(rng, (8, 4, 8), np.float32)))
    rejected(
        arrays,
        lambda: transfer(other, pool, path=any_path),
        pool,
        ShapeMismatchError,
        ValueError,
        "dst",
    )


@pytest.mark.parametrize("block", [(4, 17), (5, 16), (16, 4)], ids=str)
def test_block_shape_mismatch_names_the_host_source(arrays, rng, pool, any_path, block):
    """A host source whose blocks do not fit the pool's: the message names src, as the rank
    and shard-count mismatches of a host side do (the pool's shape is fixed)."""
    host = arrays.random(rng, (8, *block), np.float32)
    rejected(
        arrays,
        lambda: transfer(host, pool, path=any_path),
        pool,
        ShapeMismatchError,
        ValueError,
        "src",
    )


@pytest.mark.parametrize(
    "shape", [(8, 4), (8, 4, 16, 1, 1), (1, 1, 8, 4, 16), (2, 8, 4, 16)], ids=str
)
def test_rank_mismatch(arrays, rng, device_src, pool, any_path, shape):
    host = arrays.random(rng, shape, np.float32)
    rejected(
        arrays,
        lambda: transfer(device_src, host, path=any_path),
        host,
        ShapeMismatchError,
        ValueError,
        "dst",
    )
    rejected(
        arrays,
        lambda: transfer(host, pool, path=any_path),
        pool,
        ShapeMismatchError,
        ValueError,
        "src",
    )
    dst = arrays.random(rng, (8, 4, 16), np.float32)
    rejected(
        arrays,
        lambda: transfer(host, dst, path=any_path),
        dst,
        ShapeMismatchError,
        ValueError,
        "dst",
    )


# --- block lists ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "argument"),
    [
        ([8], [0], "src_blocks"),
        ([0], [8], "dst_blocks"),
        ([-1], [0], "src_blocks"),
        ([0], [-3], "dst_blocks"),
        ([0, 1, 2**40], [0, 1, 2], "src_blocks"),
        (np.array([0, 9], np.uint8), [0, 1], "src_blocks"),
    ],
    ids=["src-too-big", "dst-too-big", "src-negative", "dst-negative", "huge", "uint8"],
)
def test_block_index_out_of_range(
    arrays, device_src, pool, host, any_path, src_blocks, dst_blocks, argument
):
    dst = host.copy()
    for source, target in ((device_src, dst), (host, pool), (device_src, pool), (host, dst)):
        rejected(
            arrays,
            lambda s=source, t=target: transfer(
                s, t, src_blocks=src_blocks, dst_blocks=dst_blocks, path=any_path
            ),
            target,
            BlockIndexError,
            IndexError,
            argument,
        )


def test_block_index_out_of_range_of_the_smaller_side(arrays, rng, any_path):
    src = put(arrays.random(rng, (8, 4), np.int8))
    dst = arrays.random(rng, (3, 4), np.int8)
    rejected(
        arrays,
        lambda: transfer(src, dst, src_blocks=[7], dst_blocks=[3], path=any_path),
        dst,
        BlockIndexError,
        IndexError,
        "dst_blocks",
    )


def test_duplicate_destination_blocks(arrays, device_src, pool, host, any_path):
    dst = host.copy()
    for source, target in ((device_src, dst), (host, pool), (device_src, pool)):
        exc = rejected(
            arrays,
            lambda s=source, t=target: transfer(
                s, t, src_blocks=[0, 1, 2], dst_blocks=[5, 3, 5], path=any_path
            ),
            target,
            BlockIndexError,
            IndexError,
            "dst_blocks",
        )
        assert "5" in str(exc)


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks"),
    [([0, 1], [0]), ([], [1]), (None, [0, 1, 2]), ([0, 1, 2], None)],
    ids=["2-vs-1", "0-vs-1", "all-vs-3", "3-vs-all"],
)
def test_block_lists_of_different_length(
    arrays, device_src, pool, host, any_path, src_blocks, dst_blocks
):
    dst = host.copy()
    for source, target in ((device_src, dst), (host, pool)):
        rejected(
            arrays,
            lambda s=source, t=target: transfer(
                s, t, src_blocks=src_blocks, dst_blocks=dst_blocks, path=any_path
            ),
            target,
            InvalidArgumentError,
            ValueError,
            "dst_blocks",
        )


def test_all_blocks_with_different_block_counts(arrays, rng, device_src, any_path):
    dst = arrays.random(rng, (10, 4, 16), np.float32)
    rejected(
        arrays,
        lambda: transfer(device_src, dst, path=any_path),
        dst,
        InvalidArgumentError,
        ValueError,
        "dst_blocks",
    )


@pytest.mark.parametrize(
    ("blocks", "argument"),
    [
        ([0.0, 1.0], "src_blocks"),
        (np.array([0.5]), "src_blocks"),
        ([True, False], "src_blocks"),
        (np.array([True]), "src_blocks"),
        ([[0, 1]], "src_blocks"),
        (np.zeros((1, 1), np.int64), "src_blocks"),
        (3, "src_blocks"),
        ("01", "src_blocks"),
        ([0, None], "src_blocks"),
        ({0, 1}, "src_blocks"),
        ([0, "1"], "src_blocks"),
    ],
    ids=[
        "floats",
        "float-array",
        "bools",
        "bool-array",
        "2-D",
        "2-D-array",
        "int",
        "str",
        "None-in-list",
        "set",
        "str-in-list",
    ],
)
def test_block_lists_of_the_wrong_kind(arrays, device_src, pool, host, any_path, blocks, argument):
    dst = host.copy()
    for source, target in ((device_src, dst), (host, pool)):
        rejected(
            arrays,
            lambda s=source, t=target: transfer(
                s, t, src_blocks=blocks, dst_blocks=[0, 1], path=any_path
            ),
            target,
            InvalidArgumentError,
            ValueError,
            argument,
        )
    rejected(
        arrays,
        lambda: transfer(host, pool, src_blocks=[0, 1], dst_blocks=blocks, path=any_path),
        pool,
        InvalidArgumentError,
        ValueError,
        "dst_blocks",
    )


# --- deleted and donated arrays -------------------------------------------------------------------


def _donate(array: jax.Array) -> jax.Array:
    return jax.jit(lambda x: x * 2, donate_argnums=0)(array)


@pytest.mark.parametrize("how", ["deleted", "donated"])
def test_deleted_or_donated_source(arrays, device_src, pool, host, any_path, how):
    if how == "deleted":
        device_src.delete()
    else:
        _donate(device_src)
    assert device_src.is_deleted()
    dst = host.copy()
    for target in (dst, pool):
        rejected(
            arrays,
            lambda t=target: transfer(device_src, t, path=any_path),
            target,
            ArrayDeletedError,
            ValueError,
            "src",
        )


@pytest.mark.parametrize("how", ["deleted", "donated"])
def test_deleted_or_donated_pool(arrays, rng, host, any_path, how):
    """A pool whose array the caller donated without update(): rejected as source and as
    destination (nothing to compare in the pool: its array is gone)."""
    pool = DevicePool(put(host))
    if how == "deleted":
        pool.array.delete()
    else:
        _donate(pool.array)
    dst = host.copy()
    rejected(
        arrays,
        lambda: transfer(pool, dst, path=any_path),
        dst,
        ArrayDeletedError,
        ValueError,
        "src",
    )
    rejected(
        arrays,
        lambda: transfer(host, pool, path=any_path),
        None,
        ArrayDeletedError,
        ValueError,
        "dst",
    )


def test_pool_constructor_and_update_reject_bad_arrays(arrays, rng):
    deleted = put(arrays.random(rng, (4, 4), np.float32))
    deleted.delete()
    rejected(arrays, lambda: DevicePool(deleted), None, ArrayDeletedError, ValueError, "array")
    for bad in (np.zeros((4, 4), np.float32), [1, 2], None):
        rejected(
            arrays, lambda b=bad: DevicePool(b), None, InvalidArgumentError, ValueError, "array"
        )
    for bad in ("yes", 1, None):
        rejected(
            arrays,
            lambda b=bad: DevicePool(put(np.ones((4, 4), np.float32)), donated_steps=b),
            None,
            InvalidArgumentError,
            ValueError,
            "donated_steps",
        )
    pool = DevicePool(put(arrays.random(rng, (4, 4), np.float32)))
    rejected(arrays, lambda: pool.update(deleted), pool, ArrayDeletedError, ValueError, "array")
    for bad, error in (
        (put(np.zeros((4, 5), np.float32)), ShapeMismatchError),
        (put(np.zeros((4, 4), np.int32)), DtypeMismatchError),
        (put(np.zeros((4, 4), np.float32), jax.devices()[1]), ShapeMismatchError),
    ):
        rejected(arrays, lambda b=bad: pool.update(b), pool, error, ValueError, "array")


def test_block_holds_count_and_refuse_blocks_outside_the_pool(arrays, rng):
    """Holds are counted per block (two saves of a block, released one by one); releasing a
    block without a hold keeps it without one; ids outside the pool and a wrong axis are
    refused with the argument named, and change nothing."""
    pool = DevicePool(put(arrays.random(rng, (6, 4), np.float32)))
    pool.hold_blocks([1, 3, 3])
    pool.release_blocks([3, 5])
    assert pool.held_blocks() == [1, 3]
    pool.release_blocks(np.array([1, 3]))
    assert pool.held_blocks() == []
    pool.hold_blocks([2])
    for call, error, argument in (
        (lambda: pool.hold_blocks([6]), BlockIndexError, "block_ids"),
        (lambda: pool.release_blocks([-1]), BlockIndexError, "block_ids"),
        (lambda: pool.hold_blocks([0], block_axis=2), InvalidArgumentError, "block_axis"),
        (lambda: pool.hold_blocks([0.5]), InvalidArgumentError, "block_ids"),
    ):
        with pytest.raises(error, match=labelled(argument)):
            call()
    assert pool.held_blocks() == [2] and pool.held_blocks(1) == []


# --- destinations that may not be written ---------------------------------------------------------


def test_read_only_numpy_destination(arrays, device_src, host, any_path):
    view = np.asarray(put(host))  # a read-only zero-copy view of a jax.Array
    assert not view.flags.writeable
    for source in (device_src, host):
        exc = rejected(
            arrays,
            lambda s=source: transfer(s, view, path=any_path),
            view,
            ReadOnlyDestinationError,
            PermissionError,
            "dst",
        )
        assert "read-only" in str(exc)
    frozen = host.copy()
    frozen.setflags(write=False)
    rejected(
        arrays,
        lambda: transfer(device_src, frozen, path=any_path),
        frozen,
        ReadOnlyDestinationError,
        PermissionError,
        "dst",
    )


def test_plain_jax_array_destination(arrays, device_src, host, any_path):
    target = put(host)
    before = arrays.bits(target).copy()
    for source in (device_src, host, DevicePool(put(host))):
        exc = rejected(
            arrays,
            lambda s=source: transfer(s, target, path=any_path),
            None,
            NotAPoolError,
            PermissionError,
            "dst",
        )
        assert isinstance(exc, ReadOnlyDestinationError)
        assert "DevicePool" in str(exc)
    assert not target.is_deleted()
    arrays.assert_same(target, before, "the plain jax.Array")


def test_wrong_device(arrays, rng, any_path):
    devices = jax.devices()
    on_0 = DevicePool(put(arrays.random(rng, (6, 8), np.int32), devices[0]))
    on_1 = DevicePool(put(arrays.random(rng, (6, 8), np.int32), devices[1]))
    array_on_1 = put(arrays.random(rng, (6, 8), np.int32), devices[1])
    for source in (on_1, array_on_1):
        exc = rejected(
            arrays,
            lambda s=source: transfer(s, on_0, path=any_path),
            on_0,
            WrongDeviceError,
            ValueError,
            "dst",
        )
        assert isinstance(exc, InvalidArgumentError)
    rejected(
        arrays,
        lambda: transfer(on_0, on_1, path=any_path),
        on_1,
        WrongDeviceError,
        ValueError,
        "dst",
    )


def test_wrong_device_same_sharding_shape_other_device_order(arrays, rng, mesh, any_path):
    other_mesh = jax.sharding.Mesh(
        np.asarray(mesh.devices)[::-1], mesh.axis_names, axis_types=mesh.axis_types
    )
    spec = P(None, "a")
    a = DevicePool(put(arrays.random(rng, (4, 8), np.int8), NamedSharding(mesh, spec)))
    b = DevicePool(put(arrays.random(rng, (4, 8), np.int8), NamedSharding(other_mesh, spec)))
    rejected(arrays, lambda: transfer(a, b, path=any_path), b, WrongDeviceError, ValueError, "dst")


# --- arguments of the wrong kind ------------------------------------------------------------------


@pytest.mark.parametrize("block_axis", [3, -1, 17], ids=str)
def test_block_axis_out_of_range(arrays, device_src, host, pool, any_path, block_axis):
    dst = host.copy()
    for source, target in ((device_src, dst), (host, pool), (host, dst)):
        rejected(
            arrays,
            lambda s=source, t=target: transfer(s, t, block_axis=block_axis, path=any_path),
            target,
            InvalidArgumentError,
            ValueError,
            "block_axis",
        )


@pytest.mark.parametrize("block_axis", [1.0, True, "0", None, np.array([0])], ids=repr)
def test_block_axis_of_the_wrong_type(arrays, device_src, host, any_path, block_axis):
    dst = host.copy()
    rejected(
        arrays,
        lambda: transfer(device_src, dst, block_axis=block_axis, path=any_path),
        dst,
        InvalidArgumentError,
        ValueError,
        "block_axis",
    )


@pytest.mark.parametrize("bad_path", ["cuda", "Native", "", None, 1])
def test_bad_path_value(arrays, device_src, host, bad_path):
    dst = host.copy()
    rejected(
        arrays,
        lambda: transfer(device_src, dst, path=bad_path),
        dst,
        InvalidArgumentError,
        ValueError,
        "path",
    )
    rejected(
        arrays,
        lambda: transfer_batch([Transfer(device_src, dst)], path=bad_path),
        dst,
        InvalidArgumentError,
        ValueError,
        "path",
    )


def test_native_path_for_int4(arrays, rng):
    src = put(arrays.random(rng, (4, 8), ml_dtypes.int4))
    dst = arrays.random(rng, (4, 8), ml_dtypes.int4)
    exc = rejected(
        arrays,
        lambda: transfer(src, dst, path="native"),
        dst,
        NativePathUnavailableError,
        RuntimeError,
        "src",
    )
    assert "native" in str(exc) and "int4" in str(exc)
    pool = DevicePool(put(arrays.random(rng, (4, 8), ml_dtypes.int4)))
    rejected(
        arrays,
        lambda: transfer(dst, pool, path="native"),
        pool,
        NativePathUnavailableError,
        RuntimeError,
        "dst",
    )


@pytest.mark.parametrize(
    "bad",
    [[[1.0] * 16] * 4, b"\x00" * 64, bytearray(64), None, {"a": 1}, memoryview(b"\x00" * 64)],
    ids=["list", "bytes", "bytearray", "None", "dict", "memoryview"],
)
def test_unsupported_objects(arrays, device_src, host, pool, any_path, bad):
    dst = host.copy()
    rejected(
        arrays,
        lambda: transfer(bad, dst, path=any_path),
        dst,
        InvalidArgumentError,
        ValueError,
        "src",
    )
    rejected(
        arrays,
        lambda: transfer(bad, pool, path=any_path),
        pool,
        InvalidArgumentError,
        ValueError,
        "src",
    )
    rejected(
        arrays,
        lambda: transfer(device_src, bad, path=any_path),
        None,
        InvalidArgumentError,
        ValueError,
        "dst",
    )


def test_object_arrays_are_not_moved_as_raw_bytes(arrays, any_path):
    """numpy object arrays hold PyObject pointers: copying them as bytes skips reference counts.
    (None is used so that a failure here cannot corrupt the interpreter.)"""
    src = np.full(4, None, dtype=object)
    dst = np.full(4, None, dtype=object)
    with pytest.raises(InvalidArgumentError, match=labelled("src")):
        transfer(src, dst, path=any_path)


def test_closed_host_buffer(arrays, device_src, any_path):
    buffer = HostBuffer((8, 4, 16), np.float32)
    buffer.close()
    rejected(
        arrays,
        lambda: transfer(device_src, buffer, path=any_path),
        None,
        InvalidArgumentError,
        ValueError,
        "dst",
    )
    rejected(
        arrays,
        lambda: transfer(buffer, np.zeros((8, 4, 16), np.float32), path=any_path),
        None,
        InvalidArgumentError,
        ValueError,
        "src",
    )


# --- host layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["strided-inner-axis", "fortran", "transposed-block"])
def test_non_contiguous_blocks(arrays, rng, device_src, pool, any_path, view):
    if view == "strided-inner-axis":
        host = arrays.random(rng, (8, 4, 32), np.float32)[:, :, ::2]
    elif view == "fortran":
        host = np.asfortranarray(arrays.random(rng, (8, 4, 16), np.float32))
    else:
        host = arrays.random(rng, (8, 16, 4), np.float32).transpose(0, 2, 1)
    assert host.shape == (8, 4, 16)
    exc = rejected(
        arrays,
        lambda: transfer(device_src, host, path=any_path),
        host,
        ShapeMismatchError,
        ValueError,
        "dst",
    )
    assert "contiguous" in str(exc)
    rejected(
        arrays,
        lambda: transfer(host, pool, path=any_path),
        pool,
        ShapeMismatchError,
        ValueError,
        "src",
    )
    dst = arrays.random(rng, (8, 4, 16), np.float32)
    rejected(
        arrays,
        lambda: transfer(host, dst, path=any_path),
        dst,
        ShapeMismatchError,
        ValueError,
        "src",
    )


@pytest.mark.parametrize("leading", [None, 3, 5, 8], ids=lambda n: f"shards={n}")
def test_wrong_shard_count_on_the_host_side(arrays, rng, mesh, any_path, leading):
    """P(None, None, "a") has 4 distinct shards (each on 2 devices): the host side needs a
    leading axis of exactly 4."""
    sharding = NamedSharding(mesh, P(None, None, "a"))
    pool = DevicePool(put(arrays.random(rng, (6, 4, 8, 16), np.float32), sharding))
    shard = (6, 4, 2, 16)
    host = arrays.random(rng, shard if leading is None else (leading, *shard), np.float32)
    exc = rejected(
        arrays,
        lambda: transfer(pool, host, path=any_path),
        host,
        ShapeMismatchError,
        ValueError,
        "dst",
    )
    assert "4" in str(exc)
    rejected(
        arrays,
        lambda: transfer(host, pool, path=any_path),
        pool,
        ShapeMismatchError,
        ValueError,
        "src",
    )


@pytest.mark.parametrize("spec", [P("a"), P(("a", "b")), P("b", None, "a")], ids=str)
def test_sharded_along_the_block_axis(arrays, rng, mesh, any_path, spec):
    sharding = NamedSharding(mesh, spec)
    pool = DevicePool(put(arrays.random(rng, (8, 4, 8, 16), np.float32), sharding))
    n_shards = len({str(i) for i in sharding.devices_indices_map((8, 4, 8, 16)).values()})
    shard_shape = pool.array.addressable_shards[0].data.shape
    host = arrays.random(rng, (n_shards, *shard_shape), np.float32)
    exc = rejected(
        arrays,
        lambda: transfer(pool, host, path=any_path),
        host,
        ShapeMismatchError,
        ValueError,
        "src",
    )
    assert "block axis" in str(exc)
    rejected(
        arrays,
        lambda: transfer(host, pool, path=any_path),
        pool,
        ShapeMismatchError,
        ValueError,
        "dst",
    )
    # the same pool with a block axis it is not sharded on is fine
    if spec == P("a"):
        transfer(pool, np.empty((4, 2, 4, 8, 16), np.float32), block_axis=1, path=any_path).result(
            60
        )


# --- transfer_batch -------------------------------------------------------------------------------


@pytest.mark.parametrize("item", [("src", "dst"), None, {"src": 1}], ids=["tuple", "None", "dict"])
def test_batch_with_a_non_transfer_item(arrays, device_src, host, any_path, item):
    dst = host.copy()
    rejected(
        arrays,
        lambda: transfer_batch([Transfer(device_src, dst), item], path=any_path),
        dst,
        InvalidArgumentError,
        ValueError,
        "transfers[1]",
    )


def test_batch_is_validated_as_a_whole(arrays, rng, device_src, pool, host, any_path):
    """A valid pair followed by an invalid one: neither moves."""
    first = host.copy()
    second = arrays.random(rng, (8, 4, 16), np.int32)  # wrong dtype
    snapshot = Snapshot(arrays, first)
    rejected(
        arrays,
        lambda: transfer_batch(
            [
                Transfer(device_src, first),
                Transfer(host, pool, [0], [1]),
                Transfer(device_src, second),
            ],
            path=any_path,
        ),
        pool,
        DtypeMismatchError,
        ValueError,
        "dst",
    )
    snapshot.unchanged()
    rejected(
        arrays,
        lambda: transfer_batch(
            [Transfer(host, pool, [0], [1]), Transfer(device_src, pool, [2], [3])], path=any_path
        ),
        pool,
        InvalidArgumentError,
        ValueError,
        "transfers[1]",
    )


def test_batch_of_nothing(any_path):
    future = transfer_batch([], path=any_path)
    assert future.result(timeout=1) == 0


# --- HostBuffer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(-1, 4), (2.5,), "abc", (None,), (4, "4"), -3], ids=repr)
def test_host_buffer_bad_shape(arrays, shape):
    rejected(
        arrays,
        lambda: HostBuffer(shape, np.float32),
        None,
        InvalidArgumentError,
        ValueError,
        "shape",
    )


@pytest.mark.parametrize("dtype", ["not-a-dtype", object, "O", np.dtype([("a", "O")])], ids=repr)
def test_host_buffer_bad_dtype(arrays, dtype):
    rejected(
        arrays, lambda: HostBuffer((4, 4), dtype), None, InvalidArgumentError, ValueError, "dtype"
    )


def test_the_same_fixtures_in_a_valid_call_work(arrays, device_src, pool, host, any_path):
    """The control for every case above: with the bad part taken out, the calls succeed."""
    dst = host.copy()
    assert transfer(device_src, dst, src_blocks=[7], dst_blocks=[0], path=any_path).result(60)
    arrays.assert_same(dst[0], np.asarray(device_src)[7])
    assert transfer(host, pool, src_blocks=[0, 1], dst_blocks=[6, 7], path=any_path).result(60)
    arrays.assert_same(np.asarray(pool.array)[6:], host[:2])
    with HostBuffer((8, 4, 16), np.float32) as buffer:
        assert transfer(pool, buffer, path=any_path).result(60) == host.nbytes
        arrays.assert_same(buffer.array, pool.array)
