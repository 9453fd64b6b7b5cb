"""transfer() and transfer_batch() on pytrees: a dict of K and V pools per layer moves
as one batch, mismatched trees are refused naming both structures, a call inside jax.jit is
refused by name, and a dtype mismatch names both dtypes and both shapes.

Every round trip compares bits with a numpy reference, on both engines (the ``path`` fixture).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpusync import DevicePool, HostBuffer, Transfer, transfer, transfer_batch
from tpusync.errors import (
    BlockIndexError,
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    TpuSyncError,
)
from tpusync.tiers import HostPool, PoolLayout

TIMEOUT = 60.0
BF16 = np.dtype(ml_dtypes.bfloat16)
# (dtype, block shape) of each layer's K and V: several dtypes and shapes in one tree
LAYERS = [
    (BF16, (4, 8)),
    (np.dtype(np.float32), (2, 16)),
    (np.dtype(np.int8), (3, 5)),
]
N_BLOCKS = 12
TRACED = (
    "transfer() cannot be called inside jax.jit (or other JAX transformations); call it "
    "outside the jitted function"
)


def put(x: np.ndarray) -> jax.Array:
    """A device array with a private copy of x (device_put may alias aligned numpy on CPU)."""
    return jax.device_put(np.array(x, copy=True), jax.devices()[0])


def take(tree: Any) -> Any:
    """The bits of every leaf of a tree of pools, buffers or arrays, as numpy copies."""

    def read(leaf: Any) -> np.ndarray:
        array = leaf.array if isinstance(leaf, DevicePool | HostBuffer) else leaf
        return np.array(array, copy=True)

    return jax.tree_util.tree_map(read, tree, is_leaf=lambda x: isinstance(x, DevicePool))


def assert_tree_bits(arrays: Any, actual: Any, expected: Any) -> None:
    paths, tree = jax.tree_util.tree_flatten_with_path(actual)
    assert tree == jax.tree_util.tree_structure(expected)
    for (path, a), e in zip(paths, jax.tree_util.tree_leaves(expected), strict=True):
        arrays.assert_same(a, e, jax.tree_util.keystr(path))


def _write(before: np.ndarray, source: np.ndarray, src: Any, dst: Any) -> np.ndarray:
    """The numpy reference: ``before`` with blocks ``src[i]`` of ``source`` at ``dst[i]``."""
    out = before.copy()
    out[np.asarray(dst)] = source[np.asarray(src)]
    return out


@pytest.fixture
def buffers() -> Iterator[Callable[[tuple[int, ...], Any], HostBuffer]]:
    """HostBuffers that are closed at the end of the test."""
    made: list[HostBuffer] = []

    def make(shape: tuple[int, ...], dtype: Any) -> HostBuffer:
        buffer = HostBuffer(shape, dtype)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:  # close() lets go of the views JAX drops only at a collection
        buffer.close()


def kv_pools(arrays: Any, rng: np.random.Generator) -> dict[str, dict[str, DevicePool]]:
    """{"layer0": {"k": DevicePool, "v": DevicePool}, ...} of random bits, one dtype and block
    shape per layer."""
    return {
        f"layer{i}": {
            kv: DevicePool(put(arrays.random(rng, (N_BLOCKS, *block), dtype)), name=f"l{i}{kv}")
            for kv in ("k", "v")
        }
        for i, (dtype, block) in enumerate(LAYERS)
    }


# --- item 1: pytrees of pools and buffers as one batch -------------------------------------------


def test_pytree_round_trip_dict_of_kv_pools(arrays, rng, buffers, path):
    """Device -> host -> device for a {layer: {k, v}} tree, the same block lists on every leaf;
    the result equals a per-leaf numpy reference bit for bit."""
    pools = kv_pools(arrays, rng)
    host = {
        name: {kv: buffers((8, *pool.shape[1:]), pool.dtype) for kv, pool in layer.items()}
        for name, layer in pools.items()
    }
    for leaf in jax.tree_util.tree_leaves(host, is_leaf=lambda x: isinstance(x, HostBuffer)):
        leaf.array[...] = arrays.random(rng, leaf.shape, leaf.dtype)
    device_before, host_before = take(pools), take(host)
    saved, slots = [3, 7, 0, 11], [5, 1, 2, 6]

    future = transfer(pools, host, src_blocks=saved, dst_blocks=slots, path=path)
    expected_bytes = sum(
        4 * int(np.prod(pool.shape[1:])) * pool.dtype.itemsize
        for layer in pools.values()
        for pool in layer.values()
    )
    assert future.result(TIMEOUT) == expected_bytes == future.nbytes
    assert future.path == path
    host_expected = jax.tree_util.tree_map(
        lambda h, d: _write(h, d, saved, slots), host_before, device_before
    )
    assert_tree_bits(arrays, take(host), host_expected)
    assert_tree_bits(arrays, take(pools), device_before)  # the source is untouched

    # and back into other blocks of the pools, through transfer_batch with a tree pair
    restored = [9, 4, 10, 8]
    batch = transfer_batch([Transfer(host, pools, slots, restored)], path=path)
    assert batch.result(TIMEOUT) == expected_bytes
    device_expected = jax.tree_util.tree_map(
        lambda d, h: _write(d, h, slots, restored), device_before, host_expected
    )
    assert_tree_bits(arrays, take(pools), device_expected)


def test_pytree_round_trip_nested_lists_tuples_and_a_host_pool(arrays, rng, path):
    """Lists and tuples of numpy arrays and plain jax.Arrays, and the strided views of an
    anonymous HostPool as a list destination; whole-array moves (no block lists) too."""
    sources = [
        (put(arrays.random(rng, (6, 3, 4), BF16)), put(arrays.random(rng, (6, 8), np.int8))),
        [put(arrays.random(rng, (6, 2, 2), np.float32))],
    ]
    pools = [
        (
            DevicePool(put(arrays.random(rng, (6, 3, 4), BF16))),
            DevicePool(put(arrays.random(rng, (6, 8), np.int8))),
        ),
        [DevicePool(put(arrays.random(rng, (6, 2, 2), np.float32)))],
    ]
    dst = jax.tree_util.tree_map(lambda a: arrays.random(rng, a.shape, a.dtype), take(sources))
    assert transfer(sources, dst, path=path).result(TIMEOUT) > 0
    assert_tree_bits(arrays, dst, take(sources))

    before = take(pools)
    assert transfer(dst, pools, src_blocks=[5, 0], dst_blocks=[1, 2], path=path).result(TIMEOUT)
    expected = jax.tree_util.tree_map(lambda p, s: _write(p, s, [5, 0], [1, 2]), before, dst)
    assert_tree_bits(arrays, take(pools), expected)

    leaves = jax.tree_util.tree_leaves(pools, is_leaf=lambda x: isinstance(x, DevicePool))
    layout = PoolLayout.from_pools("pytree-test", leaves, names=["a", "b", "c"])
    with HostPool(layout, 4) as tier:
        a, b, c = tier.views()
        slots_tree = [(a, b), [c]]
        transfer(pools, slots_tree, src_blocks=[1, 2, 3], dst_blocks=[3, 0, 1], path=path).result(
            TIMEOUT
        )
        for view, pool in zip((a, b, c), leaves, strict=True):
            arrays.assert_same(view[[3, 0, 1]], np.asarray(pool.array)[[1, 2, 3]], "slot views")
        del a, b, c, slots_tree, view  # the pool closes only when no view is left


def test_pytree_leaves_are_one_batch(arrays, rng, path):
    """The leaves are planned as one batch: one future over all of them, validated as a whole
    (a bad last leaf moves nothing), and two leaves writing one pool are refused by key path."""
    pool = DevicePool(put(arrays.random(rng, (8, 4), np.float32)))
    other = DevicePool(put(arrays.random(rng, (8, 4), np.float32)))
    src = {"a": arrays.random(rng, (8, 4), np.float32), "b": arrays.random(rng, (8, 4), np.float32)}
    before = take({"pool": pool, "other": other})
    with pytest.raises(InvalidArgumentError, match=re.escape("dst['b']: writes into the same")):
        transfer(src, {"a": pool, "b": pool}, path=path)
    bad = {"a": src["a"], "b": arrays.random(rng, (8, 4), np.int32)}
    with pytest.raises(DtypeMismatchError, match=re.escape("dst['b']: dtype float32")):
        transfer(bad, {"a": pool, "b": other}, src_blocks=[0], dst_blocks=[1], path=path)
    with pytest.raises(BlockIndexError, match="dst_blocks: block index 8"):
        transfer(src, {"a": pool, "b": other}, src_blocks=[0], dst_blocks=[8], path=path)
    with pytest.raises(BlockIndexError, match=re.escape("index -1 is out of range for 8 blocks")):
        transfer(src, {"a": pool, "b": other}, src_blocks=[-1], dst_blocks=[0], path=path)
    assert_tree_bits(arrays, take({"pool": pool, "other": other}), before)


def test_batch_pairs_keep_their_numbers_after_a_pytree_pair(arrays, rng, path):
    """A pytree pair expands into one move per leaf; the flat pairs after it are still named by
    their place in the batch."""
    a, b, c = (DevicePool(put(arrays.random(rng, (8, 4), np.float32))) for _ in range(3))
    host = arrays.random(rng, (8, 4), np.float32)
    tree = Transfer({"k": host, "v": host}, {"k": a, "v": b})
    with pytest.raises(
        InvalidArgumentError, match=re.escape("transfers[2]: writes into the same DevicePool as "
                                              "transfers[1]")
    ):  # fmt: skip
        transfer_batch([tree, Transfer(host, c), Transfer(host, c)], path=path)


@pytest.mark.parametrize(
    ("src_tree", "dst_tree", "argument", "detail"),
    [
        ({"k": 0, "v": 0}, {"k": 0}, "dst", "src['v'] has no counterpart in dst"),
        ({"k": 0}, {"k": 0, "v": 0}, "dst", "dst['v'] has no counterpart in src"),
        ([0, 0], (0, 0), "dst", "different containers"),
        ({"k": 0, "v": 0}, 0, "src", "got a dict"),
        (0, [0, 0], "dst", "got a list"),
    ],
    ids=["missing-leaf", "extra-leaf", "list-vs-tuple", "tree-vs-array", "array-vs-tree"],
)
def test_pytree_mismatched_structures_are_refused(
    arrays, rng, path, src_tree, dst_tree, argument, detail
):
    """Refused before anything moves, naming the argument, both structures and a leaf."""
    src = jax.tree_util.tree_map(lambda _: arrays.random(rng, (8, 4), np.float32), src_tree)
    dst = jax.tree_util.tree_map(lambda _: arrays.random(rng, (8, 4), np.float32), dst_tree)
    before = take(dst)
    with pytest.raises(InvalidArgumentError) as info:
        transfer(src, dst, path=path)
    message = str(info.value)
    assert message.startswith(f"{argument}: "), message
    assert str(jax.tree_util.tree_structure(src)) in message
    assert str(jax.tree_util.tree_structure(dst)) in message
    assert detail in message
    assert_tree_bits(arrays, take(dst), before)
    ok = arrays.random(rng, (8, 4), np.float32)
    with pytest.raises(InvalidArgumentError) as info:
        transfer_batch([Transfer(ok, ok.copy()), Transfer(src, dst)], path=path)
    assert str(info.value).startswith(f"transfers[1].{argument}: "), str(info.value)


def test_pytree_structures_are_shortened_in_errors(arrays, rng, path):
    def layers(n: int) -> dict[str, dict[str, np.ndarray]]:
        return {
            f"layer{i}": {kv: arrays.random(rng, (2, 3), np.float32) for kv in "kv"}
            for i in range(n)
        }

    src, dst = layers(40), layers(39)
    with pytest.raises(InvalidArgumentError) as info:
        transfer(src, dst, path=path)
    message = str(info.value)
    assert " ... " in message and "src['layer39']['k'] has no counterpart in dst" in message
    assert len(message) < 500, message


def test_pytree_leaf_errors_name_the_key_path(arrays, rng, path):
    src = {"layer0": {"k": arrays.random(rng, (8, 4), np.float32)}}
    dst = {"layer0": {"k": arrays.random(rng, (8, 5), np.float32)}}
    with pytest.raises(ShapeMismatchError, match=re.escape("dst['layer0']['k']: shape (8, 5)")):
        transfer(src, dst, path=path)
    with pytest.raises(InvalidArgumentError, match=re.escape("src['layer0']['k']: expected")):
        transfer({"layer0": {"k": "text"}}, dst, path=path)
    with pytest.raises(InvalidArgumentError, match=re.escape("src: expected")):
        transfer(None, dst, path=path)


# --- item 2: inside jax.jit ----------------------------------------------------------------------


def test_jit_refused_with_the_message(arrays, rng, path):
    host = arrays.random(rng, (8, 4), np.float32)
    before = host.copy()
    pool = DevicePool(put(arrays.random(rng, (8, 4), np.float32)))

    def traced(call: Callable[[jax.Array], Any]) -> str:
        with pytest.raises(InvalidArgumentError) as info:
            jax.jit(lambda x: (call(x), x)[1])(jnp.ones((8, 4), jnp.float32))
        assert isinstance(info.value, TpuSyncError)
        return str(info.value)

    assert traced(lambda x: transfer(x, host, path=path)) == f"src: {TRACED}"
    assert traced(lambda x: transfer(host, x, path=path)) == f"dst: {TRACED}"
    assert traced(lambda x: transfer({"k": x}, {"k": host}, path=path)) == f"src['k']: {TRACED}"
    assert traced(lambda x: transfer_batch([Transfer(pool, host, x[0].astype(int))])) == (
        f"src_blocks: {TRACED}"
    )
    arrays.assert_same(host, before, "host after refused calls")
    # the same call outside jit works
    transfer(pool, host, path=path).result(TIMEOUT)
    arrays.assert_same(host, np.asarray(pool.array), "host after the real call")


def test_jit_refused_under_grad_and_vmap(arrays, rng):
    """Other transformations give tracers too (not every tracer is a jax.Array)."""
    host = arrays.random(rng, (3, 4), np.float32)

    def f(x: jax.Array) -> jax.Array:
        transfer(x, host)
        return x.sum()

    for transform in (jax.grad, jax.vmap):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"src: {TRACED}")):
            transform(f)(jnp.ones((3, 4), jnp.float32))


# --- item 3: dtype mismatch message ------------------------------------------------------------


def test_dtype_message_exact(arrays, rng, path):
    pool = DevicePool(put(arrays.random(rng, (8, 4, 16), BF16)))
    host = arrays.random(rng, (8, 4, 16), np.float32)
    before = host.copy()
    with pytest.raises(DtypeMismatchError) as info:
        transfer(pool, host, path=path)
    assert str(info.value) == (
        "dst: dtype float32 (shape (8, 4, 16)) differs from src's dtype bfloat16 "
        "(shape (8, 4, 16)); both sides need the same dtype (tpusync moves bytes, it never "
        "converts)"
    )
    arrays.assert_same(host, before, "host after the refused call")
    same_width = arrays.random(rng, (8, 4, 16), np.float16)
    with pytest.raises(DtypeMismatchError) as info:
        transfer(same_width, pool, path=path)
    assert str(info.value) == (
        "dst: dtype bfloat16 (shape (8, 4, 16)) differs from src's dtype float16 "
        "(shape (8, 4, 16)); to move raw bits, pass a .view(float16) of the host array"
    )
    with pytest.raises(ShapeMismatchError) as info:  # host to host of another rank too
        transfer(host, arrays.random(rng, (8, 64), np.int8), path=path)
    assert str(info.value) == (
        "dst: rank 2 (shape (8, 64), dtype int8) differs from src's rank 3 (shape (8, 4, 16), "
        "dtype float32); both sides need the same rank"
    )
    with pytest.raises(DtypeMismatchError) as info:
        transfer({"k": pool}, {"k": host[None]}, path=path)
    assert str(info.value).startswith(
        "dst['k']: dtype float32 (shape (1, 8, 4, 16)) differs from src['k']'s dtype bfloat16 "
        "(shape (8, 4, 16))"
    )


# --- property: random trees round trip ------------------------------------------------------

DTYPES = [BF16, np.dtype(np.float32), np.dtype(np.int8)]

# few distinct shapes, so that the pure-JAX engine compiles few programs and the test stays quick
leaf_specs = st.tuples(st.sampled_from(DTYPES), st.sampled_from([(), (2, 3)]))
tree_specs = st.recursive(
    leaf_specs,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(["k", "v", "layer0", "layer1"]), children, min_size=1),
    ),
    max_leaves=6,
)


def is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], np.dtype)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=tree_specs, data=st.data())
def test_pytree_round_trip_property(arrays, rng, path, spec, data):
    """Any tree of random leaves: host -> pools -> host gives back the chosen blocks' bits."""
    n = 5
    count = data.draw(st.sampled_from([1, 3]), label="moved")
    src_blocks = data.draw(st.permutations(range(n)), label="src_blocks")[:count]
    dst_blocks = data.draw(st.permutations(range(n)), label="dst_blocks")[:count]

    def make(leaf: tuple[np.dtype, tuple[int, ...]]) -> np.ndarray:
        return arrays.random(rng, (n, *leaf[1]), leaf[0])

    host = jax.tree_util.tree_map(make, spec, is_leaf=is_spec)
    pools = jax.tree_util.tree_map(lambda a: DevicePool(put(make((a.dtype, a.shape[1:])))), host)
    back = jax.tree_util.tree_map(lambda a: arrays.random(rng, a.shape, a.dtype), host)
    device_before, back_before = take(pools), take(back)
    transfer(host, pools, src_blocks=src_blocks, dst_blocks=dst_blocks, path=path).result(TIMEOUT)
    transfer(pools, back, src_blocks=dst_blocks, dst_blocks=src_blocks, path=path).result(TIMEOUT)
    device_expected = jax.tree_util.tree_map(
        lambda d, h: _write(d, h, src_blocks, dst_blocks), device_before, host
    )
    back_expected = jax.tree_util.tree_map(
        lambda b, d: _write(b, d, dst_blocks, src_blocks), back_before, device_expected
    )
    assert_tree_bits(arrays, take(pools), device_expected)
    assert_tree_bits(arrays, back, back_expected)
