"""Partial versions: a version that changes some leaves (an adapter) on top of a kept base. A
subscriber holding the base pulls only the changed leaves; one that holds another version, or
none, pulls the rest from the base's chunks; every commit is one whole version, never a delta
on another base; the base's chunks stay while a kept version reads them and go after; what a
partial version cannot be is refused at publish, naming the leaf."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync._src.weights.manifest import LeafEntry, Manifest
from tpusync.errors import InvalidArgumentError, WeightSyncError
from tpusync.weights import Publisher, Subscriber, WeightsPoolOptions

SECRET = secrets.token_bytes(32)
POOL = WeightsPoolOptions(chunk_bytes=1 << 14, keep=2, capacity_bytes=1 << 23)


def _mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))


def _leaf(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = np.float32) -> jax.Array:
    sharding = NamedSharding(_mesh((4, 2)), P("data", None) if len(shape) > 1 else P())
    return jax.device_put(rng.standard_normal(shape).astype(dtype), sharding)


def _model(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "layers": [{"w": _leaf(rng, (256, 64)), "norm": _leaf(rng, (64,))} for _ in range(2)],
        "lora": {"a": _leaf(rng, (64, 8)), "b": _leaf(rng, (8, 64))},
    }


def _adapter(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"lora": {"a": _leaf(rng, (64, 8)), "b": _leaf(rng, (8, 64))}}


def _on(base: dict[str, Any], adapter: dict[str, Any]) -> dict[str, Any]:
    return {**base, **adapter}


def _target(params: dict[str, Any], mesh_shape: tuple[int, int] = (2, 4)) -> Any:
    mesh = _mesh(mesh_shape)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P("model") if x.ndim == 1 else P())
        ),
        params,
    )


def _same(got: Any, want: Any) -> bool:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in pairs)


@pytest.fixture
def publisher(shm_names: Any) -> Iterator[Publisher]:
    with Publisher(shm_names(), secret=SECRET, pool=POOL) as pub:
        yield pub


@pytest.mark.parametrize("in_place", [False, True])
def test_a_subscriber_on_the_base_pulls_only_the_changed_leaves(publisher, in_place) -> None:
    base = _model(1)
    publisher.publish(base, 1)
    with Subscriber(
        publisher.name, _target(base), secret=SECRET, address=publisher.address, in_place=in_place
    ) as sub:
        sub.update(1)
        adapter_bytes = 2 * 64 * 8 * 4
        for version, seed in ((2, 20), (3, 30)):  # two adapters on the same base
            publisher.publish(_adapter(seed), version, base=1)
            report = sub.pull(version)
            assert report.leaves_kept == 4 and report.nbytes == adapter_bytes
            assert _same(sub.commit(), _on(base, _adapter(seed)))  # v3 holds none of v2's


def test_a_subscriber_on_another_version_or_none_pulls_the_base_too(publisher) -> None:
    old, base = _model(1), _model(2)
    publisher.publish(old, 1)
    with Subscriber(
        publisher.name, _target(old), secret=SECRET, address=publisher.address
    ) as on_old:
        on_old.update(1)
        publisher.publish(base, 2)
        publisher.publish(_adapter(30), 3, base=2)
        report = on_old.pull(3)  # holds version 1: nothing of it is read by version 3
        assert report.leaves_kept == 0
        assert _same(on_old.commit(), _on(base, _adapter(30)))
    with Subscriber(
        publisher.name, _target(base, (1, 8)), secret=SECRET, address=publisher.address
    ) as late:
        assert _same(late.update(3), _on(base, _adapter(30)))


def test_a_partial_version_on_a_partial_version_reads_both_bases(publisher) -> None:
    base = _model(1)
    publisher.publish(base, 1)
    publisher.publish(_adapter(20), 2, base=1)
    norms = {"layers": [{"norm": _leaf(np.random.default_rng(3), (64,))}, {}]}
    publisher.publish(norms, 3, base=2)  # lora from 2, one norm from 3, the rest from 1
    want = _on(base, _adapter(20))
    want["layers"] = [{**want["layers"][0], "norm": norms["layers"][0]["norm"]}, base["layers"][1]]
    with Subscriber(publisher.name, _target(base), secret=SECRET, address=publisher.address) as sub:
        assert _same(sub.update(3), want)


def test_a_bases_chunks_stay_while_read_and_go_after(shm_names) -> None:
    pool = WeightsPoolOptions(chunk_bytes=1 << 14, keep=1, capacity_bytes=1 << 23)
    with Publisher(shm_names(), secret=SECRET, pool=pool) as pub:
        base = _model(1)
        pub.publish(base, 1)
        used_by_base = pub.pool.used
        pub.publish(_adapter(20), 2, base=1)  # keep=1: version 1 is dropped, its chunks read
        assert pub.versions == [2] and pub.pool.used > used_by_base
        with Subscriber(pub.name, _target(base), secret=SECRET, address=pub.address) as sub:
            assert _same(sub.update(2), _on(base, _adapter(20)))
            with pytest.raises(InvalidArgumentError, match=r"base: version 1 is not kept"):
                pub.publish(_adapter(30), 3, base=1)
            pub.publish(_model(4), 4)  # a full version: nothing reads version 1 or 2 now
            assert pub.pool.used == used_by_base
            assert _same(sub.update(4), _model(4))


def test_in_place_keeps_only_what_its_buffers_hold(publisher) -> None:
    """In place, the buffers hold what the last pull wrote, committed or not: after an
    uncommitted pull of one adapter, an adapter on the same base brings back every leaf the
    first changed."""
    base = _model(1)
    publisher.publish(base, 1)
    with Subscriber(
        publisher.name, _target(base), secret=SECRET, address=publisher.address, in_place=True
    ) as sub:
        sub.update(1)
        publisher.publish({"lora": {"a": _adapter(20)["lora"]["a"]}}, 2, base=1)
        sub.pull(2)  # not committed: the buffers hold version 2's lora.a
        publisher.publish({"lora": {"b": _adapter(30)["lora"]["b"]}}, 3, base=1)
        report = sub.pull(3)
        assert report.leaves_kept == 4  # lora.a is pulled again: version 3 has version 1's
        want = _on(base, {"lora": {"a": base["lora"]["a"], "b": _adapter(30)["lora"]["b"]}})
        assert _same(sub.commit(), want)
        publisher.publish(_adapter(40), 4, base=3)  # on the committed version: all kept
        assert sub.pull(4).leaves_kept == 4
        assert _same(sub.commit(), _on(base, _adapter(40)))


def test_a_number_a_restarted_publisher_reuses_keeps_nothing(shm_names) -> None:
    name = shm_names()
    with Publisher(name, secret=SECRET, pool=POOL) as first:
        first.publish(_model(1), 10)
        sub = Subscriber(name, _target(_model(1)), secret=SECRET, address=first.address)
        sub.update(10)
    with Publisher(name, secret=SECRET, pool=POOL) as second:  # from an older checkpoint
        sub._address = second.address  # the sampler finds it where the registry says
        second.publish(_model(2), 10)
        second.publish(_adapter(30), 11, base=10)
        report = sub.pull(11)
        assert report.leaves_kept == 0  # version 10 again, but other bytes
        assert _same(sub.commit(), _on(_model(2), _adapter(30)))
        sub.close()


def test_a_list_shorter_than_the_bases_is_refused(publisher) -> None:
    publisher.publish(_model(1), 1)
    norm = _leaf(np.random.default_rng(5), (64,))
    with pytest.raises(InvalidArgumentError, match=r"params\['layers'\]: a list of 1.*put None"):
        publisher.publish({"layers": [{"norm": norm}]}, 2, base=1)  # which layer?
    publisher.publish({"layers": [None, {"norm": norm}]}, 2, base=1)  # the second


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"extra": np.zeros(3, np.float32)}, r"\['extra'\]: not a leaf of version 1"),
        ({"lora": {"a": np.zeros((64, 9), np.float32)}}, r"float32\[64, 9\], but version 1"),
        ({"lora": {"a": np.zeros((64, 8), np.float16)}}, r"float16\[64, 8\], but version 1"),
        ({"lora": None}, "at least one leaf"),
    ],
)
def test_what_a_partial_version_cannot_be_is_refused(publisher, change, match) -> None:
    publisher.publish(_model(1), 1)
    used = publisher.pool.used
    with pytest.raises(InvalidArgumentError, match=match):
        publisher.publish(change, 2, base=1)
    with pytest.raises(InvalidArgumentError, match="base: version 7 is not kept"):
        publisher.publish(_adapter(2), 2, base=7)
    assert publisher.pool.used == used and publisher.versions == [1]
    publisher.publish(_adapter(2), 2, base=1)  # nothing was left half made


def _manifest_body() -> dict[str, Any]:
    box = ((0, 4), (0, 4))
    leaves = (
        LeafEntry("[0]", (4, 4), "float32", (box,), (0,)),
        LeafEntry("[1]", (4, 4), "float32", (box,), (64,), origin=1),
    )
    manifest = Manifest(
        "w", 2, 1, 4096, 64, leaves, np.zeros(1, np.uint64), {"l": [0, 1]}, 1,
        {1: np.zeros(1, np.uint64)},
    )  # fmt: skip
    return json.loads(manifest.to_bytes()[8:])


def _parsed(body: dict[str, Any]) -> Manifest:
    text = json.dumps(body).encode()
    version = body["version"]
    return Manifest.from_bytes(len(text).to_bytes(8, "little") + text, name="w", version=version)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b["leaves"][1].update(origin=5),  # not one of the origins
        lambda b: b["leaves"][1].update(origin=2),  # itself
        lambda b: b.update(origins={"2": "00" * 8}),  # not below the version
        lambda b: b.update(origins={"x": "00" * 8}),  # not a number
        lambda b: b.update(
            version=100, origins={"1": "00" * 8, **{str(i): "" for i in range(3, 80)}}
        ),  # more origins than a version may read
        lambda b: b["leaves"][1].update(offsets=[4096 - 32]),  # past the origin's stream
        lambda b: b.update(base=2),  # not below the version
    ],
)
def test_a_malformed_partial_manifest_is_refused(damage) -> None:
    parsed = _parsed(_manifest_body())
    assert parsed.leaves[1].origin == 1
    assert [s[:2] for s in parsed.streams] == [(("v", 2), 0), (("v", 1), 1)]
    body = _manifest_body()
    damage(body)
    with pytest.raises(WeightSyncError, match="malformed"):
        _parsed(body)
