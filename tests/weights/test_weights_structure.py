"""A published version's structure, read by a sampler that has no target yet: the tree, each
leaf's shape, dtype and the publisher's sharding; a target built from it on another mesh pulls
the version bit for bit; trees that cannot travel, meshes without the publisher's axes and
malformed manifests are refused, naming what."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync._src.weights.manifest import (
    LeafEntry,
    Manifest,
    rebuild_tree,
    tree_paths,
    tree_skeleton,
)
from tpusync.cluster import MemoryRegistry
from tpusync.errors import InvalidArgumentError, VersionUnavailableError, WeightSyncError
from tpusync.weights import (
    Publisher,
    Subscriber,
    WeightsPoolOptions,
    published_structure,
)

SECRET = secrets.token_bytes(32)
POOL = WeightsPoolOptions(chunk_bytes=1 << 16, keep=2)


@pytest.fixture
def publisher(shm_names: Any) -> Iterator[Publisher]:
    with Publisher(shm_names(), secret=SECRET, pool=POOL) as pub:
        yield pub


def _mesh(shape: tuple[int, int], names: tuple[str, str] = ("data", "model")) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _params(seed: int) -> dict[str, Any]:
    """A model-like tree: nested dicts, a list of layers, a tuple, None, three dtypes and
    shardings over both axes, one axis, none, and two axes on one dimension."""
    mesh = _mesh((4, 2))
    rng = np.random.default_rng(seed)

    def put(shape: tuple[int, ...], dtype: Any, spec: P) -> jax.Array:
        raw = rng.standard_normal(shape).astype(dtype)
        return jax.device_put(raw, NamedSharding(mesh, spec))

    return {
        "embed": put((64, 32), jax.numpy.bfloat16, P("data", "model")),
        "layers": [
            {"w": put((32, 32), np.float32, P(None, "model")), "norm": put((32,), np.float32, P())}
            for _ in range(2)
        ],
        "head": (put((32, 64), jax.numpy.bfloat16, P(("data", "model"), None)), None),
    }


def _same_bits(got: Any, want: Any) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for a, b in zip(got_leaves, want_leaves, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_sampler_with_only_the_registry_builds_its_target_and_pulls(shm_names) -> None:
    registry = MemoryRegistry()
    params = _params(1)
    with Publisher(shm_names(), secret=SECRET, registry=registry, pool=POOL) as pub:
        pub.publish(params, 7)
        found = published_structure(pub.name, 7, secret=SECRET, registry=registry)
        assert found.version == 7 and found.has_tree
        shapes = found.shapes()
        assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(params)
        for got, want in zip(jax.tree.leaves(shapes), jax.tree.leaves(params), strict=True):
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
        by_path = {leaf.path: leaf for leaf in found.leaves}
        assert by_path["['embed']"].spec == P("data", "model")
        assert by_path["['head'][0]"].spec == P(("data", "model"), None)
        assert by_path["['layers'][1]['norm']"].mesh_axes == (("data", 4), ("model", 2))
        # the sampler's own mesh: the same axis names, other sizes
        target = found.target(_mesh((2, 4)))
        assert jax.tree.leaves(target)[0].sharding.mesh.shape == {"data": 2, "model": 4}
        with Subscriber(pub.name, target, secret=SECRET, registry=registry) as sub:
            _same_bits(sub.update(7), params)
            assert sub.structure(7).leaves == found.leaves
            with pytest.raises(VersionUnavailableError):
                sub.structure(8)


def test_a_mesh_without_the_publishers_axes_is_refused_unless_specs_say_how(publisher) -> None:
    params = _params(2)
    publisher.publish(params, 1)
    found = published_structure(publisher.name, 1, secret=SECRET, address=publisher.address)
    other = _mesh((2, 4), ("x", "y"))
    with pytest.raises(InvalidArgumentError, match=r"\['embed'\].*lacks.*specs="):
        found.target(other)
    with pytest.raises(InvalidArgumentError, match=r"specs: .*not paths"):
        found.target(_mesh((2, 4)), specs={"['nope']": P()})
    with pytest.raises(InvalidArgumentError, match=r"specs\[.*embed.*\]: expected a jax"):
        found.target(_mesh((2, 4)), specs={"['embed']": ("data", None)})
    specs = {leaf.path: P() for leaf in found.leaves}  # replicated on the sampler's mesh
    target = found.target(other, specs=specs)
    with Subscriber(publisher.name, target, secret=SECRET, address=publisher.address) as sub:
        _same_bits(sub.update(1), params)


class _Pair(NamedTuple):
    a: Any
    b: Any


def test_a_tree_with_other_nodes_gives_its_leaves_by_path_only(publisher) -> None:
    params = _params(3)
    publisher.publish(_Pair(params["embed"], params["layers"][0]["w"]), 1)
    found = published_structure(publisher.name, 1, secret=SECRET, address=publisher.address)
    assert not found.has_tree
    assert [leaf.path for leaf in found.leaves] == [".a", ".b"]
    with pytest.raises(InvalidArgumentError, match=r"build the target .* yourself"):
        found.shapes()


def test_the_skeleton_gives_back_the_tree() -> None:
    params = _params(4)
    paths, leaves, treedef = tree_paths(params)
    skeleton = tree_skeleton(params, paths)
    rebuilt = rebuild_tree(skeleton, leaves)
    assert jax.tree_util.tree_structure(rebuilt) == treedef
    assert all(a is b for a, b in zip(jax.tree.leaves(rebuilt), leaves, strict=True))
    assert tree_skeleton({1: np.zeros(1)}, ["[1]"]) is None  # a key that is not a string
    assert tree_skeleton(_Pair(np.zeros(1), np.zeros(1)), [".a", ".b"]) is None


def test_a_tree_too_large_to_describe_travels_by_path_only(publisher) -> None:
    """A skeleton a subscriber would refuse (here: 300,000 None nodes) is not written at all,
    so the version stays pullable."""
    params = {"pad": [None] * 300_000, "w": _params(6)["embed"]}
    publisher.publish(params, 1)
    found = published_structure(publisher.name, 1, secret=SECRET, address=publisher.address)
    assert not found.has_tree and [leaf.path for leaf in found.leaves] == ["['w']"]
    leaf = found.leaves[0]  # the target built by hand, in the trainer's structure
    w = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=params["w"].sharding)
    target = {"pad": [None] * 300_000, "w": w}
    with Subscriber(publisher.name, target, secret=SECRET, address=publisher.address) as sub:
        _same_bits(sub.update(1)["w"], params["w"])


def _nested(depth: int) -> Any:
    node: Any = {"l": [0, 1]}
    for _ in range(depth):
        node = {"l": [node]}
    return node


def _manifest_body() -> dict[str, Any]:
    """A well-formed manifest of two float32 (4, 4) leaves in a list, as JSON data."""
    box = ((0, 4), (0, 4))
    leaves = tuple(LeafEntry(f"[{i}]", (4, 4), "float32", (box,), (64 * i,)) for i in range(2))
    manifest = Manifest("w", 1, None, 4096, 128, leaves, np.zeros(1, np.uint64), {"l": [0, 1]})
    return json.loads(manifest.to_bytes()[8:])


def _parsed(body: dict[str, Any]) -> Manifest:
    text = json.dumps(body).encode()
    return Manifest.from_bytes(len(text).to_bytes(8, "little") + text, name="w", version=1)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b.update(tree={"l": [0, 0]}),  # a leaf twice
        lambda b: b.update(tree={"l": [0, 99]}),  # out of range
        lambda b: b.update(tree={"x": []}),  # an unknown node
        lambda b: b.update(tree={"d": [["b", 0], ["a", 1]]}),  # keys not sorted
        lambda b: b.update(tree={"d": [[1, 0]]}),  # a key that is not a string
        lambda b: b.update(tree=json.loads("[" * 80 + "]" * 80)),  # not a node
        lambda b: b.update(tree=_nested(70)),  # too deep
        lambda b: b.update(tree={"l": [0, 1] + [None] * 300_000}),  # too many nodes
        lambda b: b.update(tree={"l": [1, 0]}),  # leaves out of the paths' order
        lambda b: b.update(tree={"d": [["a", 0], ["b", 1]]}),  # not the leaves' paths
        lambda b: b["leaves"][0].update(sharding={"axes": [["x", 2]], "spec": ["y", None]}),
        lambda b: b["leaves"][0].update(sharding={"axes": [["x", 0]], "spec": [None, None]}),
        lambda b: b["leaves"][0].update(sharding={"axes": [["x", 2]], "spec": ["x", "x"]}),
        lambda b: b["leaves"][0].update(sharding={"axes": [["x y", 2]], "spec": [None, None]}),
        lambda b: b["leaves"][0].update(sharding={"axes": [["x", 2]], "spec": [None]}),
        lambda b: b["leaves"][1].update(offsets=[32]),  # overlaps leaf 0's bytes
    ],
)
def test_a_malformed_structure_in_a_manifest_is_refused(damage) -> None:
    assert _parsed(_manifest_body()).tree == {"l": [0, 1]}  # the undamaged one reads back
    body = _manifest_body()
    damage(body)
    with pytest.raises(WeightSyncError, match="malformed"):
        _parsed(body)


def test_json_nested_deeper_than_the_parser_goes_is_refused() -> None:
    body = _manifest_body()
    body["tree"] = "TREE"
    text = json.dumps(body).replace('"TREE"', '{"l":' * 5000 + "0" + "}" * 5000).encode()
    with pytest.raises(WeightSyncError, match="malformed"):
        Manifest.from_bytes(len(text).to_bytes(8, "little") + text, name="w", version=1)
