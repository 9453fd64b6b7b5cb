"""Dtype changes on the way in: a subscriber takes float leaves in another float dtype (float32
and bfloat16 to each other, to fp8 e4m3fn and e5m2 with per-tensor or per-channel scales made
from the maxima the publisher sends), each leaf bit for bit ``jnp.astype`` of the published
values (fp8: times the published factor), resharded onto another mesh; what cannot be
converted is refused before a chunk moves, naming the leaf and the fix."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync._native import core as _core
from tpusync._src.weights.manifest import LeafEntry, Manifest
from tpusync.errors import DtypeMismatchError, InvalidArgumentError, WeightSyncError
from tpusync.weights import Publisher, Subscriber, WeightsPoolOptions

SECRET = secrets.token_bytes(32)
POOL = WeightsPoolOptions(chunk_bytes=1 << 16, keep=2, capacity_bytes=1 << 22)
BF16, E4M3, E5M2 = (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
                    np.dtype(ml_dtypes.float8_e5m2))  # fmt: skip
F32 = np.dtype(np.float32)


def _mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))


def _bits(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# --- the native conversion against XLA's --------------------------------------------------------


def _every_bf16() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(BF16).reshape(256, 256)


def _random_f32_bits(rng: np.random.Generator) -> np.ndarray:
    """Every kind of float32: NaNs of any payload, infinities, subnormals, zeros of both signs."""
    raw = rng.integers(0, 1 << 32, (512, 256), dtype=np.uint64).astype(np.uint32)
    raw[0, :8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x7F7FFFFF, 1]
    return raw.view(np.float32)


CONVERSIONS = [
    (source, target, factors)
    for source in ("every bfloat16", "random float32 bits")
    for target in (F32, BF16, E4M3, E5M2)
    for factors in (("one", "per column") if target.itemsize == 1 else ("none",))
    if (source == "every bfloat16") != (target == BF16) or target.itemsize == 1
]


@pytest.mark.parametrize(
    ("source", "target", "factors"),
    CONVERSIONS,
    ids=[f"{s}-{t.name}-{f}" for s, t, f in CONVERSIONS],
)
def test_the_native_conversion_is_xlas_bit_for_bit(source, target, factors, rng) -> None:
    x = _every_bf16() if source == "every bfloat16" else _random_f32_bits(rng)
    f = (
        rng.uniform(0.01, 300, x.shape[-1]).astype(np.float32)
        if factors == "per column"
        else np.ones(1, np.float32)
    )
    got = np.empty(x.shape, target)
    _core.convert(x, got, f)
    values = jnp.asarray(x).astype(jnp.float32)
    if target.itemsize == 1:
        want = (values * jnp.asarray(f)).astype(target)
    else:
        want = values.astype(target)
    assert (_bits(got) == _bits(want)).all()


def test_the_native_maxima_are_numpys(rng) -> None:
    x = rng.standard_normal((33, 40)).astype(BF16)
    amax = np.zeros(40, np.float32)
    _core.channel_amax(x[:20], amax)
    _core.channel_amax(x[20:], amax)  # folded in, shard by shard
    assert (amax == np.abs(x.astype(np.float32)).max(axis=0)).all()
    x[5, 3] = np.nan
    _core.channel_amax(x, amax)
    assert np.isnan(amax[3]) and not np.isnan(np.delete(amax, 3)).any()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x: _core.convert(x, np.empty((2, 2), E4M3), np.ones(1, np.float32)), "shape"),
        (lambda x: _core.convert(x, np.empty(x.shape, E4M3), np.ones(3, np.float32)), "factors"),
        (lambda x: _core.convert(x.astype(np.int8), np.empty(x.shape, F32), x[0, :1]), "src"),
        (lambda x: _core.convert(x, np.empty(x.shape, np.int8), np.ones(1, np.float32)), "dst"),
        (lambda x: _core.channel_amax(x, np.zeros(3, np.float32)), "amax"),
    ],
)
def test_the_native_conversion_refuses_what_does_not_fit(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(np.ones((4, 8), np.float32))


# --- pulls that convert -------------------------------------------------------------------------


def _params(seed: int) -> dict[str, Any]:
    """bfloat16 and float32 leaves sharded 4x2, a 1-D one, an all-zero one, an int one."""
    mesh = _mesh((4, 2))
    rng = np.random.default_rng(seed)

    def put(raw: np.ndarray, spec: P) -> jax.Array:
        return jax.device_put(raw, NamedSharding(mesh, spec))

    return {
        "embed": put((rng.standard_normal((64, 32)) * 3).astype(BF16), P("data", "model")),
        "proj": put(rng.standard_normal((32, 48)).astype(np.float32), P(None, "model")),
        "norm": put(rng.standard_normal(32).astype(BF16), P("model")),
        "zero": put(np.zeros((16, 8), np.float32), P("data", None)),
        "ids": put(rng.integers(0, 100, (16, 8)).astype(np.int32), P()),
    }


def _reference(x: jax.Array, dtype: np.dtype, per: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``jnp.astype`` of the published values; fp8 times the factor made from the maxima,
    and the scale."""
    values = np.asarray(x).astype(np.float32)
    if dtype.itemsize != 1:
        return np.asarray(jnp.asarray(x).astype(dtype)), None
    amax = np.abs(values).max(axis=tuple(range(values.ndim - 1))) if values.ndim >= 2 else None
    amax = np.abs(values).max(keepdims=True) if amax is None else amax
    amax = amax.max() if per == "tensor" else amax
    top = np.float32(ml_dtypes.finfo(dtype).max)
    held = np.where(amax > 0, amax, np.float32(1))
    factor = np.where(amax > 0, top / held, np.float32(1)).astype(np.float32)
    scale = np.where(amax > 0, held / top, np.float32(1)).astype(np.float32)
    return np.asarray((jnp.asarray(values) * jnp.asarray(factor)).astype(dtype)), scale


@pytest.fixture
def publisher(shm_names: Any) -> Iterator[Publisher]:
    with Publisher(shm_names(), secret=SECRET, pool=POOL, amax=True) as pub:
        yield pub


TAKEN = {
    "to float32 and bfloat16": {"embed": F32, "proj": BF16, "norm": F32, "zero": BF16},
    "to fp8": {"embed": E4M3, "proj": E5M2, "norm": E4M3, "zero": E4M3},
}


@pytest.mark.parametrize("taken", list(TAKEN))
@pytest.mark.parametrize("per", ["tensor", "channel"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_pull_lands_each_leaf_converted_bit_for_bit(publisher, taken, per, in_place) -> None:
    mesh = _mesh((2, 4))
    specs = {"embed": P("model", "data"), "proj": P("data", None), "norm": P(), "zero": P()}
    versions = [_params(1), _params(2)]
    target = {
        path: jax.ShapeDtypeStruct(
            x.shape,
            TAKEN[taken].get(path, x.dtype),
            sharding=NamedSharding(mesh, specs.get(path, P())),
        )
        for path, x in versions[0].items()
    }
    with Subscriber(
        publisher.name,
        target,
        secret=SECRET,
        address=publisher.address,
        fp8_scales=per,
        in_place=in_place,
    ) as sub:
        for version, params in enumerate(versions, start=1):
            publisher.publish(params, version)
            got = sub.update(version)
            for path, x in params.items():
                want, scale = _reference(x, np.dtype(target[path].dtype), per)
                assert got[path].dtype == target[path].dtype
                assert got[path].sharding == target[path].sharding
                assert (_bits(got[path]) == _bits(want)).all(), path
                if scale is None:
                    assert f"['{path}']" not in sub.scales
                else:
                    assert (sub.scales[f"['{path}']"] == scale).all(), path


def test_what_cannot_be_converted_is_refused_before_a_chunk_moves(publisher, shm_names) -> None:
    params = _params(3)
    publisher.publish(params, 1)

    def target(path: str, dtype: Any) -> dict[str, Any]:
        return {
            p: jax.ShapeDtypeStruct(x.shape, dtype if p == path else x.dtype, sharding=x.sharding)
            for p, x in params.items()
        }

    for path, dtype, match in [
        ("ids", np.float32, r"\['ids'\]: dtype float32, published int32.*only from"),
        ("proj", np.float16, r"\['proj'\]: dtype float16.*give the target the published"),
    ]:
        with (
            Subscriber(
                publisher.name, target(path, dtype), secret=SECRET, address=publisher.address
            ) as sub,
            pytest.raises(DtypeMismatchError, match=match),
        ):
            sub.pull(1)
    with Publisher(shm_names(), secret=SECRET, pool=POOL) as plain:  # sends no maxima
        plain.publish(params, 1)
        with (
            Subscriber(
                plain.name, target("embed", E4M3), secret=SECRET, address=plain.address
            ) as sub,
            pytest.raises(DtypeMismatchError, match=r"Publisher\(amax=True\)"),
        ):
            sub.pull(1)


def test_a_leaf_that_is_not_finite_has_no_fp8_scale(publisher) -> None:
    params = _params(4)
    publisher.publish(params, 1)
    target = {
        p: jax.ShapeDtypeStruct(x.shape, E4M3 if p == "proj" else x.dtype, sharding=x.sharding)
        for p, x in params.items()
    }
    with Subscriber(publisher.name, target, secret=SECRET, address=publisher.address) as sub:
        sub.update(1)
        raw = np.asarray(params["proj"]).copy()
        raw[3, 5] = np.inf
        params["proj"] = jax.device_put(raw, params["proj"].sharding)
        publisher.publish(params, 2)
        with pytest.raises(WeightSyncError, match=r"\['proj'\].*not finite"):
            sub.pull(2)
        assert sub.version == 1 and sub.params["proj"].dtype == E4M3


def test_scalars_empty_leaves_and_tiny_maxima_convert(publisher) -> None:
    """A 0-d leaf, a leaf with no elements, and a leaf whose largest value is so small that
    max / amax overflows float32 (its factor is then float32's largest, its scale the
    inverse): every value finite, and q * scale gives the value back within fp8's step."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = {
        "scalar": jax.device_put(np.float32(3.5), cpu),
        "empty": jax.device_put(np.zeros((0, 8), np.float32), cpu),
        "tiny": jax.device_put(np.array([[1e-37, -5e-38], [0.0, 2e-38]], np.float32), cpu),
    }
    dtypes = {"scalar": BF16, "empty": BF16, "tiny": E4M3}
    publisher.publish(params, 1)
    target = {p: jax.ShapeDtypeStruct(x.shape, dtypes[p], sharding=cpu) for p, x in params.items()}
    with Subscriber(publisher.name, target, secret=SECRET, address=publisher.address) as sub:
        got = sub.update(1)
        assert float(got["scalar"]) == 3.5 and got["empty"].shape == (0, 8)
        scale = sub.scales["['tiny']"]
        assert scale == np.float32(1) / np.finfo(np.float32).max
        q = np.asarray(got["tiny"]).astype(np.float32)
        assert np.isfinite(q).all() and q[0, 0] == 36  # 1e-37 * 3.4e38 = 34.03: 36 in e4m3
        want = np.asarray(params["tiny"])
        assert np.allclose(q * scale, want, rtol=0.07, atol=0)


def test_bad_options_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match="amax"):
        Publisher("x", secret=SECRET, amax="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="fp8_scales"):
        Subscriber("x", {}, secret=SECRET, address="127.0.0.1:1", fp8_scales="row")


def _manifest_with(amax: Any, dtype: str = "float32") -> bytes:
    box = ((0, 4), (0, 4))
    leaf = LeafEntry("[0]", (4, 4), dtype, (box,), (0,))
    manifest = Manifest("w", 1, None, 4096, 80, (leaf,), np.zeros(1, np.uint64), {"l": [0]})
    body = json.loads(manifest.to_bytes()[8:])
    body["leaves"][0]["amax"] = amax
    text = json.dumps(body).encode()
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(
    ("amax", "dtype"),
    [
        (65, "float32"),  # past the stream's end
        (-1, "float32"),
        ("0", "float32"),
        (64, "int32"),  # maxima of an int leaf
        (8, "float32"),  # inside the leaf's own bytes
    ],
)
def test_malformed_maxima_in_a_manifest_are_refused(amax, dtype) -> None:
    assert Manifest.from_bytes(_manifest_with(64), name="w", version=1).leaves[0].amax == 64
    with pytest.raises(WeightSyncError, match="malformed"):
        Manifest.from_bytes(_manifest_with(amax, dtype), name="w", version=1)
