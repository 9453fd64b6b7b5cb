"""The reshard plan (tpusync._src.weights.plan) against real JAX shardings on the 8 CPU devices:
every target shard assembled from its pieces' bytes, read from the source shards' C-order bytes
through the plan's runs, equals the target shard JAX itself gives, for random shapes, dtypes
and meshes (hypothesis); pieces tile each target exactly; plans are cached; bad boxes are
refused."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync.errors import InvalidArgumentError
from tpusync.weights import leaf_plan, shard_boxes

MESHES = [(8, 1), (2, 4), (4, 2), (1, 8)]


def _mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("x", "y"))


def _specs(ndim: int) -> list[P]:
    axes = [None, "x", "y", ("x", "y")]
    out = [P()]
    for first in axes:
        for second in axes if ndim > 1 else [None]:
            names = [first, second][:ndim]
            flat = [a for n in names if n for a in ((n,) if isinstance(n, str) else n)]
            if len(flat) == len(set(flat)):
                out.append(P(*names))
    return out


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([8, 16, 24])) for _ in range(ndim))
    dtype = draw(st.sampled_from([np.float32, np.int8, np.uint16, np.int32]))  # no x64 here
    src_mesh, dst_mesh = draw(st.sampled_from(MESHES)), draw(st.sampled_from(MESHES))
    src_spec = draw(st.sampled_from(_specs(ndim)))
    dst_spec = draw(st.sampled_from(_specs(ndim)))
    return shape, np.dtype(dtype), (src_mesh, src_spec), (dst_mesh, dst_spec)


def _fits(shape, mesh_shape, spec) -> bool:
    sizes = {"x": mesh_shape[0], "y": mesh_shape[1]}
    for dim, names in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        n = math.prod(sizes[a] for a in ((names,) if isinstance(names, str) else names or ()))
        if dim % n:
            return False
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_every_target_shard_assembled_from_its_pieces_equals_jaxs(layout):
    shape, dtype, (src_mesh, src_spec), (dst_mesh, dst_spec) = layout
    if not (_fits(shape, src_mesh, src_spec) and _fits(shape, dst_mesh, dst_spec)):
        return
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    data = data.view(dtype).reshape(shape)
    source = NamedSharding(_mesh(src_mesh), src_spec)
    target = NamedSharding(_mesh(dst_mesh), dst_spec)
    src_boxes, src_of = shard_boxes(source, shape)
    dst_boxes, dst_of = shard_boxes(target, shape)
    plan = leaf_plan(shape, dtype.itemsize, src_boxes, dst_boxes)
    assert leaf_plan(shape, dtype.itemsize, src_boxes, dst_boxes) is plan  # cached
    # the source shards as a trainer holds them: JAX's own shards, as C-order bytes
    array = jax.device_put(data, source)
    shard_bytes = {}
    for shard in array.addressable_shards:
        shard_bytes[src_of[shard.device]] = np.asarray(shard.data).tobytes()
    expected = {
        dst_of[s.device]: np.asarray(s.data)
        for s in jax.device_put(data, target).addressable_shards
    }
    for t, pieces in enumerate(plan.pieces):
        tshape = tuple(b - a for a, b in dst_boxes[t])
        out = np.zeros(math.prod(tshape) * dtype.itemsize, dtype=np.uint8)
        filled = np.zeros_like(out, dtype=bool)
        for piece in pieces:
            src_offsets, run = piece.source_offsets()
            dst_offsets, dst_run = piece.target_offsets()
            assert run * len(src_offsets) == piece.nbytes == dst_run * len(dst_offsets)
            raw = np.frombuffer(shard_bytes[piece.source], dtype=np.uint8)
            moved = np.concatenate([raw[o : o + run] for o in src_offsets])
            targets = np.concatenate([np.arange(o, o + dst_run) for o in dst_offsets])
            assert not filled[targets].any()  # pieces never overlap
            out[targets] = moved
            filled[targets] = True
        assert filled.all()  # and tile the target
        np.testing.assert_array_equal(out.view(dtype).reshape(tshape).view(np.uint8),
                                      expected[t].view(np.uint8))  # fmt: skip


def test_the_same_layout_is_one_whole_run_per_shard_and_replicas_share_a_box():
    shape = (16, 8)
    sharding = NamedSharding(_mesh((2, 4)), P("x", None))  # 2 boxes, 4 replicas each
    boxes, of_device = shard_boxes(sharding, shape)
    assert len(boxes) == 2 and sorted(set(of_device.values())) == [0, 1]
    plan = leaf_plan(shape, 2, boxes, boxes)
    for t, pieces in enumerate(plan.pieces):
        (piece,) = pieces
        offsets, run = piece.source_offsets()
        assert piece.source == t and len(offsets) == 1 and run == 8 * 8 * 2
    assert plan.bytes_from(0) == plan.bytes_from(1) == 8 * 8 * 2


def test_a_replicated_target_needs_every_source_shard_once():
    shape = (8, 16)
    source = NamedSharding(_mesh((8, 1)), P("x", None))
    target = NamedSharding(_mesh((1, 8)), P())
    plan = leaf_plan(shape, 4, shard_boxes(source, shape)[0], shard_boxes(target, shape)[0])
    assert len(plan.target_boxes) == 1 and len(plan.pieces[0]) == 8
    assert sum(p.nbytes for p in plan.pieces[0]) == 8 * 16 * 4


@pytest.mark.parametrize(
    ("source", "target", "match"),
    [
        ([((0, 16),)], [((0, 17),)], r"target_boxes\[0\]: .* is not a non-empty box"),
        ([((0, 8),)], [((0, 8),)], r"source_boxes: the boxes cover 8 of the array's 16"),
        ([((0, 16),)], [], r"target_boxes: no boxes"),
        ([((0, 16), (0, 1))], [((0, 16),)], r"source_boxes\[0\]"),
    ],
)
def test_boxes_that_do_not_tile_the_array_are_refused(source, target, match):
    with pytest.raises(InvalidArgumentError, match=match):
        leaf_plan((16,), 4, source, target)
