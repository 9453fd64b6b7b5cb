"""PoolLayout: what one block is, where each array's part of it sits in a slot, and the
fingerprint that names the format.

The slot format is written down in :mod:`tpusync._src.tiers.layout`: a slot holds every array's part
of one block, in the layout's array order, each part laid out ``[shard][outer][inner]`` (``outer``
the axes before the block axis, ``inner`` the ones after), slots page-aligned. These tests check
those byte offsets independently of the code that computes them, and pin the fingerprint of one
layout so that a silent change of the scheme fails.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync import DevicePool
from tpusync.errors import InvalidArgumentError, TpuSyncError
from tpusync.tiers import ArrayLayout, PoolLayout

PAGE = 4096
NB = 6  # device blocks in every test pool
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def device(shape: tuple[int, ...], dtype: np.dtype, sharding=None) -> jax.Array:
    return jax.device_put(np.zeros(shape, dtype), sharding or jax.devices()[0])


# --- from_pools: the three shapes of KV pools --------------------------------------------------


def test_per_layer_kv_pools():
    """Two layers, K and V apart, (blocks, block_size, heads*dim), mixed dtypes."""
    pools = [
        device((NB, 4, 16), BF16),  # layer0.k: 4*16*2 = 128 B per block
        DevicePool(device((NB, 4, 16), BF16)),  # layer0.v, given as a pool
        device((NB, 4, 16), np.float32),  # layer1.k: 256 B
        device((NB, 4, 16), FP8),  # layer1.v: 64 B
    ]
    names = ["layer0.k", "layer0.v", "layer1.k", "layer1.v"]
    layout = PoolLayout.from_pools("m", pools, names=names)

    assert [a.name for a in layout.arrays] == names
    assert [a.dtype for a in layout.arrays] == ["bfloat16", "bfloat16", "float32", "float8_e4m3fn"]
    for a in layout.arrays:
        assert a.shard_block_shape == (4, 16)
        assert a.block_axis == 0
        assert a.n_shards == 1
        assert a.outer_shape == ()
        assert a.inner_shape == (4, 16)
        assert a.pieces == 1
    assert [a.block_bytes for a in layout.arrays] == [128, 128, 256, 64]
    assert layout.offsets == (0, 128, 256, 512)
    assert layout.payload_bytes == 576
    assert layout.slot_bytes == PAGE
    offsets, lengths = layout.piece_table
    assert offsets.tolist() == [0, 128, 256, 512]
    assert lengths.tolist() == [128, 128, 256, 64]


def test_default_names():
    layout = PoolLayout.from_pools("m", [device((NB, 4, 16), BF16)] * 2)
    assert [a.name for a in layout.arrays] == ["array0", "array1"]


def test_stacked_kv_pools_block_axis_1():
    """vLLM's (2, num_blocks, block_size, heads, dim) per layer: K and V are the outer axis."""
    pools = [device((2, NB, 4, 2, 8), BF16), device((2, NB, 4, 2, 8), BF16)]
    layout = PoolLayout.from_pools("m", pools, block_axis=1)
    for a in layout.arrays:
        assert a.shard_block_shape == (2, 4, 2, 8)
        assert a.block_axis == 1
        assert a.outer_shape == (2,)
        assert a.inner_shape == (4, 2, 8)
        assert a.piece_bytes == 4 * 2 * 8 * 2
        assert a.pieces == 2
        assert a.block_bytes == 256
    assert layout.offsets == (0, 256)
    assert layout.payload_bytes == 512
    offsets, lengths = layout.piece_table
    # [array][outer]: layer0 K, layer0 V, layer1 K, layer1 V
    assert offsets.tolist() == [0, 128, 256, 384]
    assert lengths.tolist() == [128] * 4


SHARDED = {
    # name: (global shape, block axis, spec, distinct shards, shard block shape)
    "heads-over-a (2 replicas)": ((NB, 4, 8, 16), 0, P(None, None, "a"), 4, (4, 2, 16)),
    "heads-over-a,b": ((NB, 4, 8, 16), 0, P(None, None, ("a", "b")), 8, (4, 1, 16)),
    "replicated": ((NB, 4, 8, 16), 0, P(), 1, (4, 8, 16)),
    "stacked, heads-over-a": ((2, NB, 8, 16), 1, P(None, None, "a"), 4, (2, 2, 16)),
    "stacked, K/V-over-b, heads-over-a": ((2, NB, 8, 16), 1, P("b", None, "a"), 8, (1, 2, 16)),
}


@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_pools(mesh, name):
    shape, axis, spec, n_shards, block_shape = SHARDED[name]
    sharding = NamedSharding(mesh, spec)
    layout = PoolLayout.from_pools(
        "m", [device(shape, BF16, sharding), device(shape, FP8, sharding)], block_axis=axis
    )
    for a, itemsize in zip(layout.arrays, (2, 1), strict=True):
        assert a.n_shards == n_shards
        assert a.shard_block_shape == block_shape
        assert a.pieces == n_shards * math.prod(block_shape[:axis])
        assert a.piece_bytes == math.prod(block_shape[axis:]) * itemsize
        assert a.block_bytes == n_shards * math.prod(block_shape) * itemsize
    k, v = layout.arrays
    assert layout.offsets == (0, k.block_bytes)
    assert layout.payload_bytes == k.block_bytes + v.block_bytes
    assert layout.slot_bytes == -(-layout.payload_bytes // PAGE) * PAGE


@pytest.mark.parametrize(
    ("row_bytes", "slot_bytes"),
    [(4, PAGE), (4096, PAGE), (4100, 2 * PAGE), (8192, 2 * PAGE), (3 * 4096 + 1, 4 * PAGE)],
)
def test_slot_bytes_round_up_to_a_page(row_bytes, slot_bytes):
    layout = PoolLayout.from_pools("m", [device((2, row_bytes), np.uint8)])
    assert layout.payload_bytes == row_bytes
    assert layout.slot_bytes == slot_bytes


# --- the slot format, byte for byte -------------------------------------------------------------

LAYOUTS = {
    # name: arrays (dtype, shard block shape, block axis, n_shards)
    "per-layer": [("bfloat16", (4, 16), 0, 1), ("bfloat16", (4, 16), 0, 1)],
    "mixed dtypes, odd sizes": [("float32", (3, 5), 0, 1), ("int8", (7,), 0, 1)],
    "stacked": [("bfloat16", (2, 4, 8), 1, 1), ("float8_e5m2", (2, 4, 8), 1, 1)],
    "sharded": [("bfloat16", (4, 2, 16), 0, 4), ("float32", (3,), 0, 2)],
    "stacked, sharded": [("bfloat16", (2, 2, 16), 1, 4), ("float8_e4m3fn", (2, 3, 4), 2, 8)],
    "over a page": [("float32", (1030,), 0, 1), ("int8", (5,), 0, 3)],
}


def make_layout(name: str) -> PoolLayout:
    return PoolLayout(
        "m",
        tuple(
            ArrayLayout(f"a{i}", dtype, shape, axis, shards)
            for i, (dtype, shape, axis, shards) in enumerate(LAYOUTS[name])
        ),
    )


def expected_pieces(layout: PoolLayout) -> list[tuple[int, int, int, int, tuple[int, ...]]]:
    """(array, shard, byte offset in the slot, length, outer index) of every piece, from the
    documented format: arrays in order, each [shard][outer][inner], packed without gaps."""
    out, at = [], 0
    for i, a in enumerate(layout.arrays):
        outer = a.shard_block_shape[: a.block_axis]
        inner = a.shard_block_shape[a.block_axis :]
        piece = math.prod(inner) * np.dtype(a.dtype).itemsize
        for shard in range(a.n_shards):
            for index in np.ndindex(*outer):
                out.append((i, shard, at, piece, index))
                at += piece
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offsets_and_piece_table_follow_the_format(name):
    layout = make_layout(name)
    pieces = expected_pieces(layout)
    offsets, lengths = layout.piece_table
    assert offsets.dtype == np.int64 and lengths.dtype == np.int64
    assert offsets.tolist() == [p[2] for p in pieces]
    assert lengths.tolist() == [p[3] for p in pieces]
    assert layout.payload_bytes == sum(p[3] for p in pieces)
    starts = {p[0]: p[2] for p in reversed(pieces)}
    assert layout.offsets == tuple(starts[i] for i in range(len(layout.arrays)))
    assert layout.slot_bytes % PAGE == 0
    assert layout.payload_bytes <= layout.slot_bytes < layout.payload_bytes + PAGE


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_host_view_shapes_and_strides(name):
    layout = make_layout(name)
    n_slots, base = 3, 512
    buffer = np.zeros(base + n_slots * layout.slot_bytes, np.uint8)
    for i, a in enumerate(layout.arrays):
        view = layout.host_view(buffer, i, n_slots, offset=base)
        itemsize = np.dtype(a.dtype).itemsize
        outer = a.shard_block_shape[: a.block_axis]
        inner = a.shard_block_shape[a.block_axis :]
        piece = math.prod(inner) * itemsize
        inner_strides = tuple(math.prod(inner[k + 1 :]) * itemsize for k in range(len(inner)))
        outer_strides = tuple(math.prod(outer[k + 1 :]) * piece for k in range(len(outer)))
        shape = (*outer, n_slots, *inner)
        strides = (*outer_strides, layout.slot_bytes, *inner_strides)
        if a.n_shards > 1:
            shape = (a.n_shards, *shape)
            strides = (math.prod(outer) * piece, *strides)
        assert view.dtype == np.dtype(a.dtype)
        assert view.shape == shape
        assert view.strides == strides
        assert view.ctypes.data == buffer.ctypes.data + base + layout.offsets[i]
        assert view.flags.writeable


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_writes_through_host_views_land_at_the_documented_offsets(rng, arrays, name):
    layout = make_layout(name)
    n_slots, base = 4, 100  # an offset that is not even aligned: host_view must honour it
    size = base + n_slots * layout.slot_bytes + 64
    buffer = np.zeros(size, np.uint8)
    written = []
    for i, a in enumerate(layout.arrays):
        view = layout.host_view(buffer, i, n_slots, offset=base)
        data = arrays.random(rng, view.shape, a.dtype)
        view[...] = data
        if a.n_shards == 1:
            data = data[None]  # the documented [shard] axis, left out for one shard
        written.append(data)
    expected = np.zeros(size, np.uint8)  # every untouched byte (padding, margins) stays 0
    for slot in range(n_slots):
        for i, shard, at, length, outer in expected_pieces(layout):
            a = layout.arrays[i]
            piece = written[i][(shard, *outer, slot)]
            assert piece.nbytes == length
            start = base + slot * layout.slot_bytes + at
            expected[start : start + length] = np.ascontiguousarray(piece).view(np.uint8).ravel()
            assert piece.shape == a.shard_block_shape[a.block_axis :]
    np.testing.assert_array_equal(buffer, expected)


def test_host_view_over_a_bytearray_and_its_own_slots(arrays, rng):
    """The views of different arrays and slots never overlap: writing one leaves the rest."""
    layout = make_layout("stacked, sharded")
    buffer = bytearray(2 * layout.slot_bytes)
    v0 = layout.host_view(buffer, 0, 2)
    v1 = layout.host_view(buffer, 1, 2)
    v0[:, :, 1] = arrays.random(rng, v0[:, :, 1].shape, v0.dtype)
    assert not np.any(v1.view(np.uint8))
    assert not np.any(arrays.bits(v0[:, :, 0]))
    assert bytes(buffer[: layout.slot_bytes]) == bytes(layout.slot_bytes)


# --- fingerprint, description --------------------------------------------------------------------

GOLDEN = PoolLayout(
    "golden-model",
    (
        ArrayLayout("layer0.k", "bfloat16", (4, 16), 0, 1),
        ArrayLayout("layer0.v", "bfloat16", (4, 16), 0, 1),
        ArrayLayout("layer1.kv", "float8_e4m3fn", (2, 2, 16), 1, 4),
    ),
)
GOLDEN_DESCRIPTION = (
    '{"arrays":[{"block_axis":0,"dtype":"bfloat16","n_shards":1,"name":"layer0.k",'
    '"shard_block_shape":[4,16]},{"block_axis":0,"dtype":"bfloat16","n_shards":1,'
    '"name":"layer0.v","shard_block_shape":[4,16]},{"block_axis":1,"dtype":"float8_e4m3fn",'
    '"n_shards":4,"name":"layer1.kv","shard_block_shape":[2,2,16]}],"format":1,'
    '"model_id":"golden-model"}'
)
# Changing this value invalidates every pool in /dev/shm and on disk: bump the format version.
GOLDEN_FINGERPRINT = "b64e31cbd772adf961d0db21f4cad199"


def test_fingerprint_golden_value():
    assert json.dumps(GOLDEN.describe(), sort_keys=True, separators=(",", ":")) == (
        GOLDEN_DESCRIPTION
    )
    assert isinstance(GOLDEN.fingerprint, bytes)
    assert GOLDEN.fingerprint.hex() == GOLDEN_FINGERPRINT


def test_fingerprint_is_stable(mesh):
    """Equal layouts, however they were built, have the same fingerprint."""
    again = PoolLayout.from_description(json.loads(GOLDEN_DESCRIPTION))
    assert again == GOLDEN
    assert again.fingerprint.hex() == GOLDEN_FINGERPRINT
    sharded = NamedSharding(mesh, P(None, None, "a"))
    from_devices = PoolLayout.from_pools(
        "golden-model",
        [device((NB, 4, 16), BF16), device((NB, 4, 16), BF16)],
        names=["layer0.k", "layer0.v"],
    )
    stacked = PoolLayout.from_pools(
        "golden-model", [device((2, NB, 8, 16), FP8, sharded)], block_axis=1, names=["layer1.kv"]
    )
    combined = PoolLayout("golden-model", from_devices.arrays + stacked.arrays)
    assert combined == GOLDEN
    assert combined.fingerprint.hex() == GOLDEN_FINGERPRINT
    assert combined.fingerprint == PoolLayout("golden-model", combined.arrays).fingerprint


def _with_array(layout: PoolLayout, index: int, **changes) -> PoolLayout:
    arrays = list(layout.arrays)
    arrays[index] = dataclasses.replace(arrays[index], **changes)
    return PoolLayout(layout.model_id, tuple(arrays))


CHANGES = {
    "model_id": lambda g: PoolLayout("golden-model-2", g.arrays),
    "dtype": lambda g: _with_array(g, 0, dtype="float16"),
    "dtype, same size": lambda g: _with_array(g, 2, dtype="float8_e5m2"),
    "shape": lambda g: _with_array(g, 1, shard_block_shape=(4, 17)),
    "shape, same size": lambda g: _with_array(g, 1, shard_block_shape=(16, 4)),
    "block_axis": lambda g: _with_array(g, 2, block_axis=2),
    "n_shards": lambda g: _with_array(g, 2, n_shards=8),
    "array order": lambda g: PoolLayout(g.model_id, g.arrays[::-1]),
    "an array less": lambda g: PoolLayout(g.model_id, g.arrays[:2]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_fingerprint_changes_with_the_format(change):
    other = CHANGES[change](GOLDEN)
    assert other != GOLDEN
    assert len(other.fingerprint) == 16
    assert other.fingerprint != GOLDEN.fingerprint


def test_fingerprint_from_pools_tells_block_axis_and_sharding_apart(mesh):
    """Device arrays with the same per-shard block shape but another block axis or another
    number of shards make other formats."""
    plain = PoolLayout.from_pools("m", [device((NB, 2, 4, 8), BF16)])
    assert plain.arrays[0].shard_block_shape == (2, 4, 8)
    axis1 = PoolLayout.from_pools("m", [device((2, NB, 4, 8), BF16)], block_axis=1)
    assert axis1.arrays[0].shard_block_shape == (2, 4, 8)
    sharded = PoolLayout.from_pools(
        "m", [device((NB, 2, 16, 8), BF16, NamedSharding(mesh, P(None, None, "a")))]
    )
    assert sharded.arrays[0].shard_block_shape == (2, 4, 8)
    assert sharded.arrays[0].n_shards == 4
    other_model = PoolLayout.from_pools("m2", [device((NB, 2, 4, 8), BF16)])
    other_dtype = PoolLayout.from_pools("m", [device((NB, 2, 4, 8), np.float16)])
    other_shape = PoolLayout.from_pools("m", [device((NB, 2, 8, 4), BF16)])
    prints = [x.fingerprint for x in (plain, axis1, sharded, other_model, other_dtype, other_shape)]
    assert len(set(prints)) == len(prints)
    # the number of blocks in the device pool is not part of the format
    assert PoolLayout.from_pools("m", [device((NB + 3, 2, 4, 8), BF16)]) == plain


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_describe_round_trip(name):
    layout = make_layout(name)
    text = json.dumps(layout.describe())
    back = PoolLayout.from_description(json.loads(text))
    assert back == layout
    assert back.fingerprint == layout.fingerprint
    assert back.describe() == layout.describe()
    assert layout.describe()["format"] == PoolLayout.FORMAT_VERSION


# --- bad input ---------------------------------------------------------------------------------


def rejected(call, argument: str) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert isinstance(info.value, TpuSyncError) and isinstance(info.value, ValueError)
    assert argument in str(info.value), f"the message does not name {argument!r}: {info.value}"
    return info.value


def test_no_arrays():
    rejected(lambda: PoolLayout.from_pools("m", []), "arrays")
    rejected(lambda: PoolLayout("m", ()), "arrays")


def test_duplicate_names():
    x = device((NB, 4, 16), BF16)
    rejected(lambda: PoolLayout.from_pools("m", [x, x], names=["k", "k"]), "arrays")
    a = ArrayLayout("k", "bfloat16", (4, 16), 0, 1)
    rejected(lambda: PoolLayout("m", (a, a)), "arrays")


@pytest.mark.parametrize("names", [["k"], ["k", "v", "w"], []])
def test_names_length_mismatch(names):
    x = device((NB, 4, 16), BF16)
    exc = rejected(lambda: PoolLayout.from_pools("m", [x, x], names=names), "names")
    assert f"{len(names)} names for 2 pools" in str(exc)


@pytest.mark.parametrize("block_axis", [3, 4, -1])
def test_block_axis_out_of_range(block_axis):
    x = device((NB, 4, 16), BF16)
    exc = rejected(lambda: PoolLayout.from_pools("m", [x], block_axis=block_axis), "block_axis")
    assert "rank 3" in str(exc)


def test_block_axis_out_of_range_for_a_later_pool():
    pools = [device((2, NB, 4), BF16), device((NB, 4), BF16)]
    exc = rejected(lambda: PoolLayout.from_pools("m", pools, block_axis=2), "block_axis")
    assert "pools[1]" in str(exc) and "rank 2" in str(exc)


def test_host_arrays_are_not_device_pools():
    """A numpy array where a device array belongs is a clear InvalidArgumentError naming it."""
    rejected(
        lambda: PoolLayout.from_pools("m", [device((NB, 4), BF16), np.zeros((NB, 4), BF16)]),
        "pools[1]",
    )
