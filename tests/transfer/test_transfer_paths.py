"""transfer() moves the right bits on both engines: every direction, dtype, rank, block list and
sharding, compared bit for bit with a numpy reference computed on the bits.

The ``rng`` fixture gives both engines the same random data for a case, so "both equal the
reference" means "bit-identical to each other"; ``test_engines_agree_bit_for_bit`` also compares
them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpusync
from tpusync import DevicePool, HostBuffer, Transfer, transfer, transfer_batch

PATHS = ("native", "jax")
DTYPES = [
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(np.int8),
    np.dtype(np.int32),
]
EXTRA_DTYPES = [np.dtype(np.bool_), np.dtype(np.float16)]
TIMEOUT = 60.0

# Every direction a transfer can take; see run_case.
KINDS = (
    "d2h",  # jax.Array -> numpy
    "d2h_buffer",  # DevicePool -> HostBuffer
    "d2h_strided",  # jax.Array -> one layer's region of a host slot pool (a HostBuffer)
    "h2d",  # numpy -> DevicePool
    "h2d_buffer",  # HostBuffer -> DevicePool
    "h2d_strided",  # one layer's region of a host slot pool (a HostBuffer) -> DevicePool
    "d2d",  # DevicePool -> another DevicePool
    "d2d_array",  # jax.Array -> DevicePool
    "within",  # DevicePool -> itself, disjoint source and destination blocks
    "h2h",  # numpy -> numpy
    "h2h_strided",  # region of a numpy slot pool -> region of a HostBuffer slot pool
)

N_LAYERS = 3


def at(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


def with_blocks(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], n, *shape[axis + 1 :])


def as_indices(blocks: Any, count: int) -> np.ndarray:
    if blocks is None:
        return np.arange(count, dtype=np.int64)
    return np.asarray(list(blocks), dtype=np.int64).reshape(-1)


def reference(dst: np.ndarray, src: np.ndarray, src_blocks: Any, dst_blocks: Any, axis: int):
    """dst with src_blocks[i] of src written to dst_blocks[i] (on bits: no value semantics)."""
    out = dst.copy()
    s = as_indices(src_blocks, src.shape[axis])
    d = as_indices(dst_blocks, dst.shape[axis])
    assert len(s) == len(d)
    out[at(axis, d)] = np.take(src, s, axis=axis)
    return out


def moved_bytes(shape: tuple[int, ...], axis: int, dtype: np.dtype, n_moved: int) -> int:
    per_block = int(np.prod(shape[axis + 1 :], dtype=np.int64)) * dtype.itemsize
    return int(np.prod(shape[:axis], dtype=np.int64)) * n_moved * per_block


def put(x: np.ndarray, sharding: Any = None) -> jax.Array:
    """A device array holding a private copy of x: on CPU, device_put of aligned numpy memory
    may alias it (even with may_alias=False), and pools are written in place."""
    target = sharding if sharding is not None else jax.devices()[0]
    return jax.device_put(np.array(x, copy=True), target)


def host_slots(
    ar: Any,
    rng: np.random.Generator,
    shape: tuple[int, ...],
    axis: int,
    dtype: Any,
    buffer: bool = True,
):
    """A host pool (a HostBuffer's array, or numpy) whose slot holds one block of each of
    N_LAYERS layers (the layer axis follows the block axis), and the strided region of layer 1,
    shaped like ``shape``."""
    full_shape = (*shape[: axis + 1], N_LAYERS, *shape[axis + 1 :])
    full = ar.random(rng, full_shape, dtype)
    if buffer:  # the view keeps the buffer's memory alive
        memory = HostBuffer(full_shape, dtype).array
        memory[...] = full
        full = memory
    return full, full[at(axis + 1, 1)]


def wait(future: tpusync.TransferFuture, path: str, nbytes: int) -> None:
    assert isinstance(future, tpusync.TransferFuture)
    assert future.path == path
    assert future.result(timeout=TIMEOUT) == nbytes
    assert future.done() and future.exception() is None


@dataclass(frozen=True)
class Case:
    dtype: np.dtype
    shape: tuple[int, ...]  # the source's shape; the destination has n_dst blocks
    axis: int
    n_dst: int
    src_blocks: Any
    dst_blocks: Any


def run_case(
    ar: Any,
    kind: str,
    path: str,
    rng: np.random.Generator,
    case: Case,
    requested: str | None = None,
) -> np.ndarray:
    """Runs one case on engine ``path`` (asking for ``requested``, by default ``path``) and
    checks destination, source and untouched memory; returns the destination's bits."""
    dtype, shape, axis = case.dtype, case.shape, case.axis
    n_src = shape[axis]
    requested = requested or path
    if kind == "within":
        return _run_within(ar, path, rng, case, requested)
    dst_shape = with_blocks(shape, axis, case.n_dst)
    src_np = ar.random(rng, shape, dtype)
    init_np = ar.random(rng, dst_shape, dtype)
    src_bits = ar.bits(src_np).copy()
    expected = reference(ar.bits(init_np), src_bits, case.src_blocks, case.dst_blocks, axis)
    n_moved = len(as_indices(case.src_blocks, n_src))
    nbytes = moved_bytes(shape, axis, dtype, n_moved)

    keep: list[tuple[str, Any, np.ndarray]] = []  # (what, how to read it, bits it must keep)
    if kind in ("d2h", "d2h_strided", "d2d_array"):
        src: Any = put(src_np)
        keep.append(("source array", src, src_bits))
    elif kind in ("d2h_buffer", "d2d"):
        src = DevicePool(put(src_np), name="src")
        keep.append(("source pool", src, src_bits))
    elif kind in ("h2d", "h2h"):
        src = src_np.copy()
        keep.append(("source numpy", src, src_bits))
    elif kind == "h2d_buffer":
        src = HostBuffer(shape, dtype)
        src.array[...] = src_np
        keep.append(("source HostBuffer", src, src_bits))
    elif kind in ("h2d_strided", "h2h_strided"):
        full, src = host_slots(ar, rng, shape, axis, dtype, buffer=kind == "h2d_strided")
        src[...] = src_np
        keep.append(("source slot pool", full, ar.bits(full).copy()))
    else:
        raise AssertionError(kind)

    if kind in ("d2h", "h2h"):
        dst: Any = init_np.copy()
        read = lambda: dst  # noqa: E731
    elif kind == "d2h_buffer":
        dst = HostBuffer(dst_shape, dtype)
        dst.array[...] = init_np
        read = lambda: dst.array  # noqa: E731
    elif kind in ("d2h_strided", "h2h_strided"):
        full_dst, dst = host_slots(ar, rng, dst_shape, axis, dtype)
        dst[...] = init_np
        others = ar.bits(full_dst).copy()
        others[at(axis + 1, 1)] = expected
        read = lambda: dst  # noqa: E731
        keep.append(("other layers of the destination slot pool", full_dst, others))
    else:  # a pool
        dst = DevicePool(put(init_np), name="dst")
        read = lambda: dst.array  # noqa: E731

    wait(
        transfer(
            src,
            dst,
            src_blocks=case.src_blocks,
            dst_blocks=case.dst_blocks,
            block_axis=axis,
            path=requested,
        ),
        path,
        nbytes,
    )
    got = ar.bits(read()).copy()
    ar.assert_same(got, expected, f"{kind} on {path}: destination")
    for what, obj, want in keep:
        current = obj.array if isinstance(obj, DevicePool | HostBuffer) else obj
        ar.assert_same(current, want, f"{kind} on {path}: {what} changed")
    return got


def _run_within(
    ar: Any, path: str, rng: np.random.Generator, case: Case, requested: str
) -> np.ndarray:
    """Source blocks are pool blocks [0, n_src), destination blocks [n_src, n_src + n_dst)."""
    dtype, shape, axis = case.dtype, case.shape, case.axis
    n_src = shape[axis]
    pool_np = ar.random(rng, with_blocks(shape, axis, n_src + case.n_dst), dtype)
    pool_bits = ar.bits(pool_np).copy()
    src_idx = as_indices(case.src_blocks, n_src)
    dst_idx = as_indices(case.dst_blocks, case.n_dst) + n_src
    expected = pool_bits.copy()
    expected[at(axis, dst_idx)] = np.take(pool_bits, src_idx, axis=axis)
    pool = DevicePool(put(pool_np))
    future = transfer(
        pool, pool, src_blocks=src_idx, dst_blocks=dst_idx, block_axis=axis, path=requested
    )
    wait(future, path, moved_bytes(shape, axis, dtype, len(src_idx)))
    got = ar.bits(pool.array).copy()
    ar.assert_same(got, expected, f"within on {path}")
    return got


def block_lists(kind: str, n_src: int, n_dst: int, rng: np.random.Generator):
    """(src_blocks, dst_blocks) of one named kind, for n_src source and n_dst destination blocks."""
    k = min(n_src, n_dst)
    if kind == "empty":
        return [], []
    if kind == "single":
        return [n_src - 1], [0]
    if kind == "all":  # needs n_src == n_dst
        return None, None
    if kind == "all_src":  # every source block to scattered destinations
        return None, rng.permutation(n_dst)[:n_src].tolist()
    if kind == "reversed":
        return list(range(k))[::-1], list(range(k))
    if kind == "scattered":
        count = max(1, k // 2)
        return (
            rng.choice(n_src, count, replace=False).tolist(),
            rng.choice(n_dst, count, replace=False).tolist(),
        )
    if kind == "repeated_src":  # one source block to several destinations
        return [n_src // 2] * k, rng.permutation(n_dst)[:k].tolist()
    if kind == "index_types":  # range, numpy int32 and tuple all work
        return range(k - 1, -1, -1), np.arange(k, dtype=np.int32)
    raise AssertionError(kind)


# --- the matrix: dtypes, shapes, block lists × every direction × both engines ---------------------


KV_SHAPE = (6, 4, 2, 8)  # (num_blocks, block_size, kv_heads, head_dim)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES + EXTRA_DTYPES, ids=str)
def test_dtypes(arrays, rng, path, kind, dtype):
    src_blocks, dst_blocks = [5, 0, 3], [2, 7, 4]
    case = Case(dtype, KV_SHAPE, 0, 9, src_blocks, dst_blocks)
    run_case(arrays, kind, path, rng, case)


SHAPES = [
    pytest.param((16,), 0, id="rank1"),
    pytest.param((7, 24), 0, id="rank2"),
    pytest.param((5, 3, 6), 1, id="rank3-axis1"),
    pytest.param((3, 4, 5), 2, id="rank3-axis2-scalar-blocks"),
    pytest.param((8, 16, 2, 32), 0, id="kv-(blocks,block_size,heads,dim)"),
    pytest.param((2, 8, 4, 2, 16), 1, id="kv-(2,blocks,...)-axis1"),
    pytest.param((3, 2, 5, 2, 3), 2, id="rank5-axis2"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("shape", "axis"), SHAPES)
def test_shapes(arrays, rng, path, kind, shape, axis):
    n_src = shape[axis]
    n_dst = n_src + 3
    src_blocks, dst_blocks = block_lists("scattered", n_src, n_dst, rng)
    case = Case(np.dtype(ml_dtypes.bfloat16), shape, axis, n_dst, src_blocks, dst_blocks)
    run_case(arrays, kind, path, rng, case)


LISTS = [
    "empty",
    "single",
    "all",
    "all_src",
    "reversed",
    "scattered",
    "repeated_src",
    "index_types",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lists", LISTS)
def test_block_lists(arrays, rng, path, kind, lists):
    n_src = 10
    n_dst = n_src if lists in ("all", "reversed") else 13
    src_blocks, dst_blocks = block_lists(lists, n_src, n_dst, rng)
    case = Case(np.dtype(ml_dtypes.bfloat16), (n_src, 3, 4), 0, n_dst, src_blocks, dst_blocks)
    run_case(arrays, kind, path, rng, case)


@pytest.mark.parametrize("kind", KINDS)
def test_long_block_lists(arrays, rng, path, kind):
    """Thousands of small scattered blocks (runs of neighbours and isolated ones)."""
    n_src, n_dst = 5000, 6000
    # a run of neighbours on both sides (merged into one copy by the native engine), then
    # 3000 scattered blocks (sources may repeat, destinations may not)
    src_blocks = np.concatenate([np.arange(1000, 1500), rng.choice(n_src, 3000)])
    rest = np.setdiff1d(np.arange(n_dst), np.arange(2000, 2500))
    dst_blocks = np.concatenate([np.arange(2000, 2500), rng.choice(rest, 3000, replace=False)])
    case = Case(np.dtype(np.int8), (n_src, 2, 3), 0, n_dst, src_blocks, dst_blocks)
    run_case(arrays, kind, path, rng, case)


@pytest.mark.parametrize("kind", ["d2h", "h2d", "d2d", "within", "h2h"])
def test_zero_sized_blocks_and_pools(arrays, rng, path, kind):
    """Blocks of zero bytes, and sides with zero blocks, move nothing and finish at once."""
    run_case(arrays, kind, path, rng, Case(np.dtype(np.float32), (4, 0, 3), 0, 5, [1, 2], [0, 4]))
    run_case(arrays, kind, path, rng, Case(np.dtype(np.float32), (0, 2), 0, 3, [], []))


def test_engines_agree_bit_for_bit(arrays, rng):
    """The same inputs through both engines: identical destination bits (NaN payloads too)."""
    results = {}
    seed = int(rng.integers(1 << 32))
    case = Case(np.dtype(ml_dtypes.bfloat16), (2, 6, 4, 8), 1, 7, [4, 0, 5], [6, 1, 3])
    for path in PATHS:
        for kind in KINDS:
            same_data = np.random.default_rng(seed)
            results[path, kind] = run_case(arrays, kind, path, same_data, case)
    for kind in KINDS:
        arrays.assert_same(results["native", kind], results["jax", kind], kind)
    nan_bits = np.uint16(0x7FBF)
    assert any(np.any(v == nan_bits) for v in results.values()), "no NaN payload was moved"


# --- sub-byte and path choice ---------------------------------------------------------------------


@pytest.mark.parametrize("requested", ["auto", "jax"])
@pytest.mark.parametrize("kind", ["d2h", "h2d", "d2d", "within", "h2h"])
def test_int4_moves_through_the_jax_path(arrays, rng, requested, kind):
    """int4 is packed on device: "auto" picks the pure-JAX engine for it (host-only copies stay
    native: there is no device side)."""
    case = Case(np.dtype(ml_dtypes.int4), (6, 4, 8), 0, 7, [5, 0, 2], [6, 1, 3])
    engine = "native" if requested == "auto" and kind == "h2h" else "jax"
    run_case(arrays, kind, engine, rng, case, requested=requested)


def test_auto_picks_native_on_cpu(arrays, rng):
    src = put(arrays.random(rng, (4, 8), np.float32))
    dst = np.zeros((4, 8), np.float32)
    future = transfer(src, dst)
    assert future.path == "native"
    assert future.result(TIMEOUT) == 4 * 8 * 4
    arrays.assert_same(dst, src)


# --- moves within one pool (or host array) whose source and destination blocks overlap ------------


OVERLAPS = {
    "swap": ([0, 1], [1, 0]),
    "reverse": (list(range(8)), list(range(7, -1, -1))),
    "shift-up": (list(range(0, 7)), list(range(1, 8))),
    "shift-down": (list(range(1, 8)), list(range(0, 7))),
    "rotate": ([0, 1, 2, 3], [1, 2, 3, 0]),
}


@pytest.mark.parametrize("overlap", list(OVERLAPS))
@pytest.mark.parametrize("block_elems", [8, 1 << 16], ids=["small", "256KiB-blocks"])
def test_within_pool_overlapping_blocks(arrays, rng, path, overlap, block_elems):
    """src_blocks[i] -> dst_blocks[i] all at once, as if the sources were read first (what the
    pure-JAX gather-then-scatter does), also when the two lists share blocks."""
    src_blocks, dst_blocks = OVERLAPS[overlap]
    base = arrays.random(rng, (8, block_elems), np.int32)
    expected = reference(base, base, src_blocks, dst_blocks, 0)
    pool = DevicePool(put(base))
    wait(
        transfer(pool, pool, src_blocks=src_blocks, dst_blocks=dst_blocks, path=path),
        path,
        len(src_blocks) * block_elems * 4,
    )
    arrays.assert_same(pool.array, expected, f"pool after {overlap} on {path}")


@pytest.mark.parametrize("overlap", list(OVERLAPS))
def test_host_to_same_host_array_overlapping_blocks(arrays, rng, path, overlap):
    src_blocks, dst_blocks = OVERLAPS[overlap]
    host = arrays.random(rng, (8, 1 << 16), np.int32)
    expected = reference(host, host, src_blocks, dst_blocks, 0)
    wait(
        transfer(host, host, src_blocks=src_blocks, dst_blocks=dst_blocks, path=path),
        path,
        len(src_blocks) * host.shape[1] * 4,
    )
    arrays.assert_same(host, expected, f"host array after {overlap} on {path}")


def test_source_is_the_destination_pools_own_array(arrays, rng, path):
    """pool.array passed as the source of a write into that pool (disjoint blocks)."""
    base = arrays.random(rng, (6, 16), np.float32)
    pool = DevicePool(put(base))
    expected = reference(base, base, [0, 1], [4, 5], 0)
    wait(
        transfer(pool.array, pool, src_blocks=[0, 1], dst_blocks=[4, 5], path=path),
        path,
        2 * 16 * 4,
    )
    arrays.assert_same(pool.array, expected, f"pool on {path}")


# --- aliasing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["numpy", "aligned-numpy", "HostBuffer"])
@pytest.mark.parametrize("blocks", ["all", "some"])
def test_pool_does_not_alias_host_source(arrays, rng, path, source, blocks):
    """After host->device, writing the host memory does not change the pool (and back)."""
    shape = (8, 64, 16)  # 4 KiB blocks
    data = arrays.random(rng, shape, np.float32)
    if source == "HostBuffer":
        host_obj: Any = HostBuffer(shape, np.float32)
        host = host_obj.array
    elif source == "aligned-numpy":
        raw = np.empty(data.nbytes + 4096, np.uint8)
        offset = (-raw.ctypes.data) % 4096
        host = raw[offset : offset + data.nbytes].view(np.float32).reshape(shape)
        host_obj = host
    else:
        host = host_obj = np.empty(shape, np.float32)
    host[...] = data
    pool = DevicePool(put(arrays.random(rng, shape, np.float32)))
    src_blocks = None if blocks == "all" else [3, 1, 6]
    expected = reference(arrays.bits(pool.array), arrays.bits(data), src_blocks, src_blocks, 0)
    transfer(host_obj, pool, src_blocks=src_blocks, dst_blocks=src_blocks, path=path).result(
        TIMEOUT
    )
    arrays.assert_same(pool.array, expected, "pool after host->device")
    host[...] = arrays.random(rng, shape, np.float32)  # the caller reuses its buffer
    arrays.assert_same(pool.array, expected, "pool after the host buffer was rewritten")

    back = np.empty(shape, np.float32)
    transfer(pool, back, path=path).result(TIMEOUT)
    back[...] = 0
    arrays.assert_same(pool.array, expected, "pool after its host copy was rewritten")


# --- transfer_batch -------------------------------------------------------------------------------


def test_batch_of_layers_to_host_slots_and_back(arrays, rng, path):
    """K and V pools of 3 layers to one host slot pool (slot = every layer's K and V of one
    block) under one future, then back into fresh pools."""
    layers, n_blocks, n_slots = 3, 10, 12
    block = (4, 2, 8)  # block_size, kv_heads, head_dim
    dtype = ml_dtypes.bfloat16
    k = [arrays.random(rng, (n_blocks, *block), dtype) for _ in range(layers)]
    v = [arrays.random(rng, (n_blocks, *block), dtype) for _ in range(layers)]
    pools = {
        (kv, i): DevicePool(put(x)) for kv, xs in (("k", k), ("v", v)) for i, x in enumerate(xs)
    }
    slots = arrays.random(rng, (n_slots, layers, 2, *block), dtype)
    expected = arrays.bits(slots).copy()
    src_blocks, dst_blocks = [7, 2, 9, 0], [11, 0, 5, 6]
    items = []
    for (kv, i), pool in pools.items():
        j = 0 if kv == "k" else 1
        items.append(Transfer(pool, slots[:, i, j], src_blocks, dst_blocks))
        source = k[i] if kv == "k" else v[i]
        expected[:, i, j] = reference(
            expected[:, i, j], arrays.bits(source), src_blocks, dst_blocks, 0
        )
    per_move = moved_bytes((n_blocks, *block), 0, np.dtype(dtype), len(src_blocks))
    wait(transfer_batch(items, path=path), path, per_move * len(items))
    arrays.assert_same(slots, expected, "host slots")

    fresh = {key: DevicePool(put(arrays.random(rng, (n_blocks, *block), dtype))) for key in pools}
    want = {}
    items = []
    for (kv, i), pool in fresh.items():
        j = 0 if kv == "k" else 1
        items.append(Transfer(slots[:, i, j], pool, dst_blocks, src_blocks))
        want[kv, i] = reference(
            arrays.bits(pool.array), expected[:, i, j], dst_blocks, src_blocks, 0
        )
    wait(transfer_batch(items, path=path), path, per_move * len(items))
    for key, pool in fresh.items():
        arrays.assert_same(pool.array, want[key], f"pool {key}")


def test_batch_of_mixed_directions(arrays, rng, path):
    a = arrays.random(rng, (6, 8), np.int32)
    b = arrays.random(rng, (6, 8), np.int32)
    host = arrays.random(rng, (6, 8), np.int32)
    pool_a, pool_b = DevicePool(put(a)), DevicePool(put(b))
    host_out = np.zeros((6, 8), np.int32)
    items = [
        Transfer(pool_a, host_out, [0, 1], [2, 3]),  # device -> host
        Transfer(host, pool_a, [4], [5]),  # host -> device, a block the batch does not read
        Transfer(pool_a, pool_b, [0], [1]),  # device -> device
        Transfer(host, host_out, [5], [0]),  # host -> host
    ]
    with pytest.raises(tpusync.errors.InvalidArgumentError, match=r"transfers\[4\]"):
        # pool_b written by two pairs: rejected as a whole, nothing moves (checked below)
        transfer_batch([*items, Transfer(host, pool_b, [1], [2])], path=path)
    future = transfer_batch(items, path=path)
    assert future.result(TIMEOUT) == 4 * 8 * (2 + 1 + 1 + 1)
    exp_out = np.zeros((6, 8), np.int32)
    exp_out[[2, 3]] = a[[0, 1]]
    exp_out[0] = host[5]
    arrays.assert_same(host_out, exp_out, "host_out")
    exp_a = a.copy()
    exp_a[5] = host[4]
    arrays.assert_same(pool_a.array, exp_a, "pool_a")
    exp_b = b.copy()
    exp_b[1] = a[0]
    arrays.assert_same(pool_b.array, exp_b, "pool_b")


# --- sharded arrays over the 8 fake devices -------------------------------------------------------


def distinct_shards(sharding: Any, shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The distinct shards' indices in the documented host order: by start indices, row-major."""
    keys = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        keys.add(tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True)))
    return [tuple(slice(a, b) for a, b in key) for key in sorted(keys)]


def host_layout(global_array: np.ndarray, sharding: Any) -> np.ndarray:
    """[shard][blocks...]: the host side of a sharded array."""
    return np.stack([global_array[i] for i in distinct_shards(sharding, global_array.shape)])


def assert_every_replica(ar: Any, array: jax.Array, expected_global: np.ndarray, what: str):
    """Every addressable shard (every replica) holds its slice of expected_global."""
    assert len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
        ar.assert_same(
            np.asarray(shard.data),
            expected_global[shard.index],
            f"{what}: shard on device {shard.device.id} (replica {shard.replica_id})",
        )


SHARDINGS = {
    # name: (global shape, block axis, partition spec, distinct shards)
    "heads-over-a (2 replicas each)": ((6, 4, 8, 16), 0, P(None, None, "a"), 4),
    "heads-over-a,b": ((6, 4, 8, 16), 0, P(None, None, ("a", "b")), 8),
    "block_size-over-b,heads-over-a": ((6, 4, 8, 16), 0, P(None, "b", "a"), 8),
    "fully-replicated": ((6, 4, 8, 16), 0, P(), 1),
    "kv-(2,blocks,...)-K/V-over-b": ((2, 6, 4, 8, 16), 1, P("b", None, None, "a"), 8),
    "dim-over-b-only (4 replicas)": ((6, 4, 2, 16), 0, P(None, None, None, "b"), 2),
}
SHARDED_KINDS = ("d2h", "d2h_buffer", "h2d", "h2d_buffer", "d2d", "d2d_array", "within")


@pytest.mark.parametrize("kind", SHARDED_KINDS)
@pytest.mark.parametrize("name", list(SHARDINGS))
def test_sharded(arrays, rng, mesh, path, name, kind):
    shape, axis, spec, n_shards = SHARDINGS[name]
    dtype = np.dtype(ml_dtypes.bfloat16)
    sharding = NamedSharding(mesh, spec)
    n = shape[axis]
    src_blocks, dst_blocks = [4, 0, 5, 2], [1, 3, 2, 5]
    check_sharded(
        arrays,
        rng,
        path,
        kind,
        sharding,
        shape,
        axis,
        dtype,
        n_shards,
        src_blocks,
        dst_blocks,
        n_host=n + 2,
    )


def check_sharded(
    ar,
    rng,
    path,
    kind,
    sharding,
    shape,
    axis,
    dtype,
    n_shards,
    src_blocks,
    dst_blocks,
    n_host,
    leading_axis=True,
):
    layout = distinct_shards(sharding, shape)
    assert len(layout) == n_shards
    shard_shape = tuple(s.stop - s.start for s in layout[0])
    n = shape[axis]
    per_shard = moved_bytes(shard_shape, axis, dtype, len(as_indices(src_blocks, n)))
    if kind in ("d2h", "d2h_buffer"):
        global_np = ar.random(rng, shape, dtype)
        host_shape = (n_shards, *with_blocks(shard_shape, axis, n_host))
        init = ar.random(rng, host_shape, dtype)
        src: Any = put(global_np, sharding)
        if kind == "d2h_buffer":
            src = DevicePool(src)
        shards = host_layout(ar.bits(global_np), sharding)
        expected = np.stack(
            [
                reference(ar.bits(init)[g], shards[g], src_blocks, dst_blocks, axis)
                for g in range(n_shards)
            ]
        )
        if kind == "d2h":
            dst: Any = init.copy()
        else:
            dst = HostBuffer(host_shape, dtype)
            dst.array[...] = init
        if not leading_axis:
            dst = (dst.array if kind == "d2h_buffer" else dst)[0]
            expected = expected[0]
        wait(
            transfer(
                src, dst, src_blocks=src_blocks, dst_blocks=dst_blocks, block_axis=axis, path=path
            ),
            path,
            per_shard * n_shards,
        )
        ar.assert_same(
            dst.array if isinstance(dst, HostBuffer) else dst, expected, f"host side of {kind}"
        )
        current = src.array if isinstance(src, DevicePool) else src
        assert_every_replica(ar, current, global_np, "source")
        return
    init_global = ar.random(rng, shape, dtype)
    pool = DevicePool(put(init_global, sharding))
    copies = len(pool.array.addressable_shards)
    if kind in ("h2d", "h2d_buffer"):
        host_shape = (n_shards, *with_blocks(shard_shape, axis, n_host))
        host_np = ar.random(rng, host_shape, dtype)
        expected = ar.bits(init_global).copy()
        for g, index in enumerate(layout):
            expected[index] = reference(
                expected[index], ar.bits(host_np)[g], src_blocks, dst_blocks, axis
            )
        if kind == "h2d":
            src = host_np.copy()
        else:
            src = HostBuffer(host_shape, dtype)
            src.array[...] = host_np
        if not leading_axis:
            src = (src.array if kind == "h2d_buffer" else src)[0]
        moved = per_shard * copies
    elif kind in ("d2d", "d2d_array"):
        global_np = ar.random(rng, shape, dtype)
        src = put(global_np, sharding)
        if kind == "d2d":
            src = DevicePool(src)
        expected = reference(ar.bits(init_global), ar.bits(global_np), src_blocks, dst_blocks, axis)
        moved = per_shard * copies
    elif kind == "within":
        # disjoint source and destination blocks (overlapping ones: see their own test)
        order = rng.permutation(n)
        src_blocks, dst_blocks = order[: n // 2], order[n // 2 : 2 * (n // 2)]
        src = pool
        expected = reference(
            ar.bits(init_global), ar.bits(init_global), src_blocks, dst_blocks, axis
        )
        moved = moved_bytes(shard_shape, axis, dtype, len(src_blocks)) * copies
    else:
        raise AssertionError(kind)
    wait(
        transfer(
            src, pool, src_blocks=src_blocks, dst_blocks=dst_blocks, block_axis=axis, path=path
        ),
        path,
        moved,
    )
    assert_every_replica(ar, pool.array, expected, f"pool after {kind}")


@pytest.mark.parametrize("kind", ["d2h", "d2h_buffer", "h2d", "h2d_buffer"])
@pytest.mark.parametrize("name", ["fully-replicated", "dim-over-b-only (4 replicas)"])
def test_sharded_host_side_layouts(arrays, rng, mesh, path, name, kind):
    """A fully replicated array takes a host side without the shard axis (here a view of a
    larger array); a partially replicated one (2 distinct shards on 4 replicas each) moves
    whole with None block lists."""
    shape, axis, spec, n_shards = SHARDINGS[name]
    sharding = NamedSharding(mesh, spec)
    if n_shards == 1:
        check_sharded(
            arrays,
            rng,
            path,
            kind,
            sharding,
            shape,
            axis,
            np.dtype(np.float32),
            n_shards,
            [1, 0],
            [4, 2],
            n_host=7,
            leading_axis=False,
        )
    else:
        check_sharded(
            arrays,
            rng,
            path,
            kind,
            sharding,
            shape,
            axis,
            np.dtype(np.float32),
            n_shards,
            None,
            None,
            n_host=shape[axis],
        )


def test_replicated_write_reaches_every_replica(arrays, rng, mesh, path):
    """A pool replicated over all 8 devices: a host->device write lands on all 8 copies, and
    moved bytes count every replica."""
    sharding = NamedSharding(mesh, P())
    init = arrays.random(rng, (5, 32), np.float32)
    pool = DevicePool(put(init, sharding))
    host = arrays.random(rng, (3, 32), np.float32)
    future = transfer(host, pool, src_blocks=[2, 0], dst_blocks=[1, 4], path=path)
    assert future.result(TIMEOUT) == 2 * 32 * 4 * 8
    expected = reference(init, host, [2, 0], [1, 4], 0)
    assert_every_replica(arrays, pool.array, expected, "replicated pool")


# --- hypothesis: random shapes, axes, dtypes, block lists, directions -----------------------------


@st.composite
def random_cases(draw: Any, kinds: tuple[str, ...] = KINDS) -> tuple[str, Case, int]:
    rank = draw(st.integers(1, 5))
    axis = draw(st.integers(0, rank - 1))
    dims = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    n_src = draw(st.integers(1, 12))
    n_dst = draw(st.integers(1, 12))
    dims[axis] = n_src
    dtype = draw(st.sampled_from(DTYPES + EXTRA_DTYPES))
    kind = draw(st.sampled_from(kinds))
    if n_src == n_dst and draw(st.booleans()):
        src_blocks = dst_blocks = None
    else:
        count = draw(st.integers(0, n_dst))
        src_blocks = draw(st.lists(st.integers(0, n_src - 1), min_size=count, max_size=count))
        dst_blocks = draw(st.permutations(range(n_dst)))[:count]
    seed = draw(st.integers(0, 2**32 - 1))
    return kind, Case(dtype, tuple(dims), axis, n_dst, src_blocks, dst_blocks), seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_cases())
def test_random_moves_match_numpy(arrays, path, case):
    kind, spec, seed = case
    run_case(arrays, kind, path, np.random.default_rng(seed), spec)


@st.composite
def random_sharded_cases(draw: Any):
    """A random rank-2..4 array sharded over the mesh on non-block axes (or replicated)."""
    rank = draw(st.integers(2, 4))
    axis = draw(st.integers(0, rank - 1))
    spec: list[Any] = [None] * rank
    dims = [draw(st.integers(1, 3)) for _ in range(rank)]
    others = [i for i in range(rank) if i != axis]
    for mesh_axis, size in (("a", 4), ("b", 2)):
        choice = draw(st.sampled_from([None, *others]))
        if choice is None:
            continue
        spec[choice] = mesh_axis if spec[choice] is None else (spec[choice], mesh_axis)
        dims[choice] *= size
    n = draw(st.integers(1, 8))
    dims[axis] = n
    count = draw(st.integers(0, n))
    src_blocks = draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count))
    dst_blocks = draw(st.permutations(range(n)))[:count]
    kind = draw(st.sampled_from(SHARDED_KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    return kind, tuple(dims), axis, P(*spec), dtype, src_blocks, dst_blocks, seed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_sharded_cases())
def test_random_sharded_moves_match_numpy(arrays, mesh, path, case):
    kind, shape, axis, spec, dtype, src_blocks, dst_blocks, seed = case
    sharding = NamedSharding(mesh, spec)
    n_shards = len(distinct_shards(sharding, shape))
    check_sharded(
        arrays,
        np.random.default_rng(seed),
        path,
        kind,
        sharding,
        shape,
        axis,
        dtype,
        n_shards,
        src_blocks,
        dst_blocks,
        n_host=shape[axis],
    )


def test_a_non_default_device_layout_goes_to_the_jax_path() -> None:
    """The native engine reads row-major shards only; an array with a transposed device layout
    (and the cached answer for the default one) must say so, and auto-pick pure JAX."""
    from jax.experimental.layout import Format, Layout

    from tpusync._src.engines.native import unavailable_reason

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    make = jax.jit(
        lambda: jnp.arange(12.0).reshape(3, 4), out_shardings=Format(Layout((1, 0)), sharding)
    )
    transposed = make()
    for _ in range(2):  # the second answer comes from the per-layout cache
        assert unavailable_reason(transposed) == "non-default device layout (1, 0): pure JAX"
        assert unavailable_reason(jnp.zeros((3, 4))) is None
    out = np.empty((3, 4), np.float32)
    tpusync.transfer(transposed, out).result(timeout=30)
    np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 4))


def test_a_pool_updated_to_another_device_layout_is_asked_again() -> None:
    """A DevicePool keeps its native-path answer across updates only while the device layout
    stays the same: an update to a transposed array must move through pure JAX, and an
    update back to the default layout must return to the native engine."""
    from jax.experimental.layout import Format, Layout

    from tpusync._src.engines.native import pool_unavailable_reason

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rows = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    pool = DevicePool(jnp.asarray(rows))
    assert pool_unavailable_reason(pool) is None
    transposed = jax.jit(lambda x: x * 1, out_shardings=Format(Layout((1, 0)), sharding))
    pool.update(transposed(jnp.asarray(rows)))
    assert pool_unavailable_reason(pool) == "non-default device layout (1, 0): pure JAX"
    out = np.empty((4, 6), np.float32)
    tpusync.transfer(pool, out).result(timeout=30)
    np.testing.assert_array_equal(out, rows)
    pool.update(jnp.asarray(rows[::-1].copy()))
    assert pool_unavailable_reason(pool) is None
    tpusync.transfer(pool, out).result(timeout=30)
    np.testing.assert_array_equal(out, rows[::-1])


def test_overlap_check_is_exact_on_random_segment_tables() -> None:
    """The native path's overlap check (a bounding-range shortcut, then an exact sweep) agrees
    with a brute-force check on random tables, overlapping or not."""
    from tpusync._src.engines.native import overlaps

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        lengths = rng.integers(1, 64, n)
        # destinations are disjoint, as in every transfer (a block is written once)
        dst = np.cumsum(rng.integers(64, 128, n)) + int(rng.integers(0, 4000))
        src = rng.integers(0, 5000, n)
        table = np.stack([src, dst, lengths], axis=1).astype(np.uint64)
        brute = any(
            s < d + m and d < s + k
            for s, k in zip(src.tolist(), lengths.tolist(), strict=True)
            for d, m in zip(dst.tolist(), lengths.tolist(), strict=True)
        )
        assert overlaps(table) == brute
