"""A published weights version's manifest: what a subscriber needs to find, check and reshard
every byte, and the version's commit record (it is written after every chunk).

A version is one byte stream: every leaf's distinct source shards (C order), each starting on a
64-byte boundary, cut into chunks of ``chunk_bytes`` (the publisher's pool slots; the last one
zero-padded). Each chunk carries its checksum here, so a subscriber verifies the bytes that
land in its own buffers against the trainer's, whichever path they took.

The manifest travels as JSON in the publisher's pool (parts of ``chunk_bytes``, an 8-byte length
first). A manifest comes from a peer: :meth:`Manifest.from_bytes` bounds and checks every field
before any of it is used.

A version is a plain ``int`` (``0 <= version < 2**62``, e.g. the training step) from
``Publisher.publish`` to ``Subscriber.commit``: the arguments, the publisher's books, the
manifest, the reports and ``Subscriber.version`` all hold that one number (checked once, by
:func:`check_version`). It is not wrapped: a version carries nothing besides its number, callers
already hold training steps, and a wrapper would be unwrapped again at every boundary below.
It takes another form only where a boundary needs one, each made here or in one line:

- the pool and the data plane name a version's pieces by keys (:func:`chunk_key`,
  :func:`manifest_key`), and the registry lists the version by its announcement
  (:func:`announcement_key`, the manifest's first part); nothing turns a key back into a
  version;
- the manifest's JSON carries the number as it is;
- a KV store's namespace names the weights by a string: ``Subscriber.commit`` passes
  ``str(version)`` to ``set_weight_version``.

The manifest also says what a subscriber needs to build its own target without being told:
the tree's skeleton (:func:`tree_skeleton`: dicts with string keys, lists, tuples and None
around numbered leaves; a tree with any other node has none) and each leaf's sharding as data
(the publisher's mesh axes and ``PartitionSpec``, :func:`sharding_data`), read back by
:mod:`tpusync._src.weights.structure`.

The helpers both sides share are here too: the pool layout of a stream's chunks
(:func:`chunk_layout`) and the leaf paths a manifest names (:func:`tree_paths`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_dtypes  # jax's own dependency: bfloat16 and the float8 types
import numpy as np

from tpusync._src.tiers.layout import ArrayLayout, PoolLayout
from tpusync._src.weights.plan import Box, leaf_plan
from tpusync.errors import InvalidArgumentError, WeightSyncError

__all__ = [
    "AMAX_DTYPES",
    "FORMAT",
    "MAX_ORIGINS",
    "LeafEntry",
    "Manifest",
    "announcement_key",
    "channels_of",
    "check_name",
    "check_version",
    "chunk_key",
    "chunk_layout",
    "manifest_key",
    "publisher_node_id",
    "rebuild_tree",
    "sharding_data",
    "structure_digest",
    "tree_paths",
    "tree_skeleton",
]

FORMAT = 5  # 5: partial versions (4: per-channel maxima; 3: the skeleton and shardings)
STREAM_ALIGNMENT = 64
_MAX_LEAVES = 1 << 16
_MAX_DIMS = 16
_MAX_CHUNKS = 1 << 24
MAX_ORIGINS = 64  # the earlier versions a partial one reads
_MAX_PARTS = 1 << 12  # trainer processes
_MAX_MANIFEST_BYTES = 1 << 30
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_AXES = 16
_MAX_DEPTH = 64
_MAX_KEY = 256


def _key(kind: bytes, name: str, version: int, index: int) -> bytes:
    digest = hashlib.blake2b(digest_size=32, person=b"tpusync-w-" + kind)
    digest.update(f"{name}\0{version}\0{index}".encode())
    return digest.digest()


def chunk_key(name: str, version: int, index: int) -> bytes:
    """The pool key of chunk ``index`` of ``version`` of the weights called ``name``."""
    return _key(b"chunk", name, version, index)


def manifest_key(name: str, version: int, part: int) -> bytes:
    """The pool key of part ``part`` of the manifest of ``version``."""
    return _key(b"manif", name, version, part)


def announcement_key(name: str, version: int) -> bytes:
    """The key the registry lists for ``version`` (its manifest's first part, which a
    subscriber holds for its whole pull)."""
    return manifest_key(name, version, 0)


def relay_key(name: str, version: int) -> bytes:
    """The key a relay lists in the registry while it holds every chunk of ``version``."""
    return _key(b"relay", name, version, 0)


DIGEST_BYTES = 32  # a chunk's SHA-256, for the chunks relays serve


AMAX_DTYPES = ("float32", "bfloat16")  # the leaves a publisher gives maxima of


def channels_of(shape: tuple[int, ...]) -> int:
    """A leaf's channels (its scales' count per channel): its last axis, or 1 below 2-D."""
    return int(shape[-1]) if len(shape) >= 2 else 1


def structure_digest(leaves: list[tuple[str, tuple[int, ...], str]]) -> str:
    """A version's structure as 32 hex digits: each leaf's path, shape and dtype name, in
    order. The publisher lists it per version in its head; a subscriber tells a structure it
    already knows fits its target from it without reading a manifest."""
    text = json.dumps([[path, list(shape), dtype] for path, shape, dtype in leaves])
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"tpusync-w-struct").hexdigest()


def publisher_node_id(name: str) -> str:
    """The node id the publisher of the weights ``name`` registers (the registry lists its
    address under it)."""
    return f"weights-{name}"


def chunk_layout(name: str, chunk_bytes: int) -> PoolLayout:
    """The pool layout of a weights stream's chunks (one uint8 array of ``chunk_bytes``)."""
    return PoolLayout(
        f"weights:{name}", (ArrayLayout("chunk", "uint8", (int(chunk_bytes),), 0, 1),)
    )


def tree_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    """The leaves of ``tree`` with their paths (``jax.tree_util.keystr``: the paths a manifest
    names its leaves by) and the treedef."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) for p, _ in with_paths], [x for _, x in with_paths], treedef


class _NoSkeleton(Exception):
    """A node :func:`tree_skeleton` cannot write down."""


def tree_skeleton(tree: Any, paths: list[str]) -> Any:
    """``tree``'s structure as JSON data, its leaves numbered in flattening order: a dict with
    string keys is ``{"d": [[key, child], ...]}`` (keys sorted, as JAX flattens them), a list
    ``{"l": [...]}``, a tuple ``{"t": [...]}``, None ``null``. None when the tree holds any
    other node (a NamedTuple, a dataclass, a Flax ``FrozenDict``), or when the skeleton would not
    give back ``paths``: the manifest then carries the leaves by path only."""
    numbers = iter(range(len(paths)))

    def walk(node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _NoSkeleton
        if node is None:
            return None
        if type(node) is dict:
            if not all(type(k) is str and len(k) <= _MAX_KEY for k in node):
                raise _NoSkeleton
            return {"d": [[k, walk(node[k], depth + 1)] for k in sorted(node)]}
        if type(node) in (list, tuple):
            return {"l" if type(node) is list else "t": [walk(x, depth + 1) for x in node]}
        if isinstance(node, jax.Array | np.ndarray):
            return next(numbers, -1)
        raise _NoSkeleton

    try:
        skeleton = walk(tree, 0)
        _check_skeleton(skeleton, len(paths))  # what a subscriber will accept
        _check_skeleton_paths(skeleton, paths)
    except (_NoSkeleton, ValueError):
        return None
    return skeleton


def rebuild_tree(skeleton: Any, leaves: list[Any]) -> Any:
    """The tree a (checked) skeleton describes, with ``leaves[i]`` at leaf ``i``."""
    if skeleton is None:
        return None
    if type(skeleton) is int:
        return leaves[skeleton]
    if "d" in skeleton:
        return {k: rebuild_tree(child, leaves) for k, child in skeleton["d"]}
    if "l" in skeleton:
        return [rebuild_tree(child, leaves) for child in skeleton["l"]]
    return tuple(rebuild_tree(child, leaves) for child in skeleton["t"])


def _check_skeleton_paths(skeleton: Any, paths: list[str]) -> None:
    """Raises ValueError unless the tree ``skeleton`` describes flattens to ``paths``, its
    leaves numbered in that order (else a target built from it would put leaves in the wrong
    places)."""
    got_paths, got_leaves, _ = tree_paths(rebuild_tree(skeleton, list(range(len(paths)))))
    if got_paths != paths or got_leaves != list(range(len(paths))):
        raise ValueError("tree: the skeleton does not give back the leaves' paths in order")


def _check_skeleton(skeleton: Any, n_leaves: int) -> None:
    """Raises ValueError unless ``skeleton`` is a skeleton whose leaves are each of
    ``0 .. n_leaves - 1`` once (a peer's data: bounded in depth and size before it is walked)."""
    seen: set[int] = set()
    stack = [(skeleton, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > _MAX_DEPTH or nodes > 4 * _MAX_LEAVES:
            raise ValueError("tree: too deep or too large")
        if node is None:
            continue
        if type(node) is int:
            if not 0 <= node < n_leaves or node in seen:
                raise ValueError(f"tree: leaf {node} out of range or repeated")
            seen.add(node)
            continue
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError("tree: a node is not a dict, list, tuple, None or leaf")
        ((kind, children),) = node.items()
        if kind not in ("d", "l", "t") or not isinstance(children, list):
            raise ValueError(f"tree: unknown node {kind!r:.20}")
        if nodes + len(stack) + len(children) > 4 * _MAX_LEAVES:
            raise ValueError("tree: too large")
        if kind == "d":
            keys = [item[0] for item in children if isinstance(item, list) and len(item) == 2]
            if len(keys) != len(children) or not all(
                type(k) is str and len(k) <= _MAX_KEY for k in keys
            ):
                raise ValueError("tree: a dict entry is not [key, child] with a short string key")
            if keys != sorted(set(keys)):
                raise ValueError("tree: a dict's keys are repeated or not sorted")
            children = [item[1] for item in children]
        stack.extend((child, depth + 1) for child in children)
    if len(seen) != n_leaves:
        raise ValueError(f"tree: {len(seen)} leaves, the manifest lists {n_leaves}")


def sharding_data(sharding: Any, ndim: int) -> Any:
    """A leaf's sharding as data a subscriber can rebuild on its own devices: a
    ``NamedSharding``'s mesh axes (names and sizes, in order) and ``PartitionSpec``
    (``{"axes": [[name, size], ...], "spec": [None | name | [names]]}``); None for any other
    sharding (the boxes still say how the bytes were cut)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    axes = [[str(name), int(size)] for name, size in sharding.mesh.shape.items()]
    spec = [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
    spec += [None] * (ndim - len(spec))
    data = {"axes": axes, "spec": spec}
    try:
        _check_sharding(data, ndim)
    except ValueError:  # e.g. PartitionSpec.UNCONSTRAINED: not data a subscriber can use
        return None
    return data


def _check_sharding(data: Any, ndim: int) -> None:
    if not isinstance(data, dict) or set(data) != {"axes", "spec"}:
        raise ValueError("sharding: expected {axes, spec}")
    axes, spec = data["axes"], data["spec"]
    if not isinstance(axes, list) or not 1 <= len(axes) <= _MAX_AXES:
        raise ValueError("sharding.axes: expected 1 to 16 [name, size] pairs")
    names = []
    for item in axes:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError("sharding.axes: expected [name, size] pairs")
        if not _AXIS.fullmatch(item[0]):
            raise ValueError(f"sharding.axes: {item[0]!r:.80} is not an axis name")
        _int(item[1], "sharding.axes size", 1, 1 << 20)
        names.append(item[0])
    if len(set(names)) != len(names):
        raise ValueError("sharding.axes: a name is repeated")
    if not isinstance(spec, list) or len(spec) != ndim:
        raise ValueError(f"sharding.spec: expected one entry per dimension ({ndim})")
    used: list[str] = []
    for entry in spec:
        for name in entry if isinstance(entry, list) else [entry]:
            if name is None and not isinstance(entry, list):
                continue
            if name not in names:
                raise ValueError(f"sharding.spec: {name!r:.80} is not one of the mesh's axes")
            used.append(name)
    if len(set(used)) != len(used):
        raise ValueError("sharding.spec: an axis shards two dimensions")


@dataclass(frozen=True)
class LeafEntry:
    """One leaf: its tree path, global shape, dtype name, distinct shard boxes (the
    publisher's layout), where each box's bytes start in the version's stream, the
    publisher's sharding as data (:func:`sharding_data`; None when it has none to give), and
    where its per-channel absolute maxima start in the stream (float32, one per
    :attr:`channels`; None when the publisher gives none)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    boxes: tuple[Box, ...]
    offsets: tuple[int, ...]
    sharding: Any = None
    amax: int | None = None
    origin: int | None = None  # the version whose stream holds its bytes (None: this one)
    parts: tuple[int, ...] | None = None  # per box, the trainer process holding it (None: 0)

    @property
    def channels(self) -> int:
        """The leaf's channels: its last axis (a leaf of fewer than 2 dimensions has one)."""
        return channels_of(self.shape)

    @property
    def np_dtype(self) -> np.dtype:
        return dtype_of(self.dtype)

    def box_bytes(self, i: int) -> int:
        return math.prod(b - a for a, b in self.boxes[i]) * self.np_dtype.itemsize


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (bfloat16 and the float8 types through ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        found = getattr(ml_dtypes, name, None)
        if found is None:
            raise InvalidArgumentError(f"dtype: {name!r} is not a dtype this build knows") from None
        return np.dtype(found)


@dataclass(frozen=True)
class Manifest:
    """A version's manifest (see the module docstring).

    ``checksums[i]`` is chunk ``i``'s block checksum (the tiers' scheme); ``tree`` is the
    skeleton of :func:`tree_skeleton` (None: the leaves by path only). A partial version
    (``base``: the version it changes leaves of) has only its changed leaves in its own
    stream; every other leaf names the version whose stream holds it (``LeafEntry.origin``),
    and ``origins`` holds those streams' chunk checksums. A version of a multi-controller
    trainer has a stream per process (``parts``: the address and chunk checksums of each
    process's after the first, whose stream is this manifest's own); each box of a leaf names
    the process holding it (``LeafEntry.parts``). ``digests`` (a publisher's ``relays=True``)
    holds the SHA-256 of each chunk of this version's own stream: what a chunk served by a
    relay, which may know the secret, is checked against."""

    name: str
    version: int
    parent: int | None
    chunk_bytes: int
    total_bytes: int
    leaves: tuple[LeafEntry, ...]
    checksums: np.ndarray
    tree: Any = None
    base: int | None = None
    origins: dict[int, np.ndarray] = field(default_factory=dict)
    parts: tuple[tuple[str, np.ndarray], ...] = ()
    digests: bytes | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.checksums)

    def origin_of(self, leaf: LeafEntry) -> int:
        """The version whose stream holds ``leaf``'s bytes."""
        return self.version if leaf.origin is None else leaf.origin

    def stream_of(self, leaf: LeafEntry, box: int) -> tuple[str, int]:
        """The stream holding box ``box`` of ``leaf``: ``("v", version)`` (this publisher's
        stream of that version) or ``("p", process)`` (a trainer process's part)."""
        if leaf.parts is not None and leaf.parts[box]:
            return ("p", leaf.parts[box])
        return ("v", self.origin_of(leaf))

    @functools.cached_property
    def streams(self) -> tuple[tuple[tuple[str, int], int, str | None, int, np.ndarray], ...]:
        """Each stream a pull may read, this version's own first: ``(stream, first chunk,
        address (None: this manifest's publisher), version, checksums)``, numbered as one run
        of chunks across them all (a stream's chunk ``i`` is number ``first + i``)."""
        out = []
        first = 0
        listed = [(("v", self.version), None, self.version, self.checksums)]
        listed += [(("v", v), None, v, self.origins[v]) for v in sorted(self.origins)]
        listed += [(("p", p), a, self.version, c) for p, (a, c) in enumerate(self.parts, start=1)]
        for stream, address, version, checksums in listed:
            out.append((stream, first, address, version, checksums))
            first += len(checksums)
        return tuple(out)

    def stream_start(self, stream: tuple[str, int]) -> int:
        """Where ``stream`` starts in the run of all streams, in bytes."""
        for known, first, *_ in self.streams:
            if known == stream:
                return first * self.chunk_bytes
        raise KeyError(stream)

    @functools.cached_property
    def all_checksums(self) -> np.ndarray:
        """Every stream's chunk checksums, in the order of :attr:`streams`."""
        return np.concatenate([s[4] for s in self.streams])

    @functools.cached_property
    def layout_key(self) -> tuple[Any, ...]:
        """What a subscriber's plan of this version depends on, without its number: the
        streams' sizes and places, and each leaf's shape, dtype, boxes, offsets, maxima and
        stream (by its place among the streams). Versions of one layout share one plan."""
        index = {s[0]: k for k, s in enumerate(self.streams)}
        return (
            self.chunk_bytes,
            tuple((s[1], s[2], len(s[4])) for s in self.streams),
            tuple(
                (
                    e.shape,
                    e.dtype,
                    e.boxes,
                    e.offsets,
                    e.amax,
                    tuple(index[self.stream_of(e, b)] for b in range(len(e.boxes))),
                )
                for e in self.leaves
            ),
        )

    def leaf_sources(self) -> tuple[tuple[Any, ...], ...]:
        """Per leaf, what its bytes are: the version its stream belongs to, a digest of that
        stream's chunk checksums and where the leaf lies in it. Equal for two manifests only
        when the leaf's bytes are the same (a number a restarted publisher reuses included)."""
        digests = {
            s[0]: hashlib.blake2b(s[4].tobytes(), digest_size=16).digest() for s in self.streams
        }
        return tuple(
            (
                tuple(
                    (self.stream_of(e, b), digests[self.stream_of(e, b)])
                    for b in range(len(e.boxes))
                ),
                self.origin_of(e),
                e.dtype,
                e.boxes,
                e.offsets,
                e.amax,
            )
            for e in self.leaves
        )

    def chunk_sources(self, name: str, numbers: np.ndarray) -> list[tuple[int, str | None, bytes]]:
        """Where each chunk numbered across all streams is: its stream (the place in
        :attr:`streams`), the address of the publisher that holds it (None: this manifest's)
        and its key there."""
        starts = np.array([s[1] for s in self.streams])
        which = np.searchsorted(starts, numbers, side="right") - 1
        out = []
        for w, n in zip(which.tolist(), numbers.tolist(), strict=True):
            _, first, address, version, _ = self.streams[w]
            out.append((w, address, chunk_key(name, version, n - first)))
        return out

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "name": self.name,
            "version": self.version,
            "parent": self.parent,
            "chunk_bytes": self.chunk_bytes,
            "total_bytes": self.total_bytes,
            "leaves": [
                {
                    "path": leaf.path,
                    "shape": list(leaf.shape),
                    "dtype": leaf.dtype,
                    "boxes": [[list(d) for d in box] for box in leaf.boxes],
                    "offsets": list(leaf.offsets),
                    "sharding": leaf.sharding,
                    **({} if leaf.amax is None else {"amax": leaf.amax}),
                    **({} if leaf.origin is None else {"origin": leaf.origin}),
                    **({} if leaf.parts is None else {"parts": list(leaf.parts)}),
                }
                for leaf in self.leaves
            ],
            "tree": self.tree,
            "checksums": self.checksums.astype("<u8").tobytes().hex(),
            "base": self.base,
            "origins": {str(v): c.astype("<u8").tobytes().hex() for v, c in self.origins.items()},
            "parts": [[a, c.astype("<u8").tobytes().hex()] for a, c in self.parts],
            "digests": None if self.digests is None else self.digests.hex(),
        }
        text = json.dumps(body, separators=(",", ":")).encode()
        return len(text).to_bytes(8, "little") + text

    @classmethod
    def from_bytes(cls, data: bytes, *, name: str, version: int) -> Manifest:
        """A manifest read from a peer, every field checked (``WeightSyncError`` naming the
        field when one is wrong); it must be the manifest of ``name``'s ``version``."""
        try:
            return _parse(data, name, version)
        except (
            KeyError,
            TypeError,
            ValueError,
            OverflowError,
            RecursionError,  # JSON nested deeper than the parser goes
            InvalidArgumentError,
        ) as error:
            raise WeightSyncError(
                f"the manifest of version {version} of {name!r} is malformed ({error}); "
                "the publisher and this subscriber may run different tpusync releases"
            ) from None


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what}: expected an integer in [{low}, {high}], got {value!r:.80}")
    return value


@functools.lru_cache(maxsize=4096)
def _check_tiling(shape: tuple[int, ...], itemsize: int, boxes: tuple[Any, ...]) -> None:
    """Raises unless ``boxes`` tile ``shape`` (remembered: every version repeats its layout)."""
    leaf_plan(shape, itemsize, boxes, boxes)


def _parse(data: bytes, name: str, version: int) -> Manifest:
    if len(data) < 8:
        raise ValueError("shorter than its length field")
    length = int.from_bytes(data[:8], "little")
    if not 0 < length <= min(len(data) - 8, _MAX_MANIFEST_BYTES):
        raise ValueError(f"length field {length} beyond the {len(data) - 8} bytes read")
    body = json.loads(data[8 : 8 + length])
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"format: expected {FORMAT}")
    if body["name"] != name or body["version"] != version:
        raise ValueError(f"it names {body['name']!r} version {body['version']!r}")
    parent = body["parent"]
    if parent is not None:
        _int(parent, "parent", 0, 2**62)
    chunk_bytes = _int(body["chunk_bytes"], "chunk_bytes", 4096, 1 << 34)
    total = _int(body["total_bytes"], "total_bytes", 0, chunk_bytes * _MAX_CHUNKS)
    n_chunks = -(-total // chunk_bytes)
    checksums = np.frombuffer(bytes.fromhex(body["checksums"]), dtype="<u8").astype(np.uint64)
    if len(checksums) != n_chunks:
        raise ValueError(f"checksums: expected {n_chunks}")
    digests = body.get("digests")
    if digests is not None:
        digests = bytes.fromhex(digests)
        if len(digests) != DIGEST_BYTES * n_chunks:
            raise ValueError(f"digests: expected {n_chunks}")
    base = body["base"]
    if base is not None:
        _int(base, "base", 0, version - 1)
    origins_in = body["origins"]
    if not isinstance(origins_in, dict) or len(origins_in) > MAX_ORIGINS:
        raise ValueError(f"origins: expected at most {MAX_ORIGINS}")
    origins: dict[int, np.ndarray] = {}
    for key, text in origins_in.items():
        origin = _int(
            int(key) if key.isdigit() and len(key) < 20 else -1, "origins", 0, version - 1
        )
        origins[origin] = np.frombuffer(bytes.fromhex(text), dtype="<u8").astype(np.uint64)
    parts_in = body["parts"]
    if not isinstance(parts_in, list) or len(parts_in) > _MAX_PARTS:
        raise ValueError(f"parts: expected a list of at most {_MAX_PARTS}")
    parts = []
    for p, part in enumerate(parts_in, start=1):
        if not isinstance(part, list) or len(part) != 2 or not isinstance(part[0], str):
            raise ValueError(f"parts[{p}]: expected [address, checksums]")
        host, _, port = part[0].rpartition(":")
        if (
            not 0 < len(part[0]) <= 256
            or not host
            or not port.isdigit()
            or not 0 < int(port) < 65536
            or not part[0].isprintable()
            or " " in part[0]
        ):
            raise ValueError(f"parts[{p}]: {part[0]!r:.80} is not a host:port")
        if any(part[0] == known for known, _ in parts) or host in ("0.0.0.0", "::", "[::]"):
            raise ValueError(
                f"parts[{p}]: {part[0]!r:.80} is another process's address too, or no address "
                "to reach (give each trainer process's WeightsServerOptions its own host)"
            )
        parts.append(
            (part[0], np.frombuffer(bytes.fromhex(part[1]), dtype="<u8").astype(np.uint64))
        )
    listed = [*origins.values(), *(c for _, c in parts)]
    if n_chunks + sum(len(c) for c in listed) > _MAX_CHUNKS:
        raise ValueError("origins, parts: too many chunks")
    stream_bytes = {version: total, **{v: len(c) * chunk_bytes for v, c in origins.items()}}
    part_bytes = [total] + [len(c) * chunk_bytes for _, c in parts]
    leaves_in = body["leaves"]
    if not isinstance(leaves_in, list) or len(leaves_in) > _MAX_LEAVES:
        raise ValueError("leaves: expected a list")
    leaves = []
    for i, item in enumerate(leaves_in):
        if not isinstance(item, dict):
            raise ValueError(f"leaves[{i}]: expected an object")
        origin = item.get("origin")
        if origin is not None and (type(origin) is not int or origin not in origins):
            raise ValueError(f"leaves[{i}].origin: {origin!r:.40} is not one of the origins")
        end = stream_bytes[version if origin is None else origin]  # its stream's bytes
        shape = tuple(_int(d, f"leaves[{i}].shape", 0, 1 << 40) for d in item["shape"])
        if len(shape) > _MAX_DIMS or not _DTYPE.fullmatch(item["dtype"]):
            raise ValueError(f"leaves[{i}]: a shape or dtype out of bounds")
        dtype = dtype_of(item["dtype"])
        boxes = tuple(tuple((int(a), int(b)) for a, b in box) for box in item["boxes"])
        offsets = tuple(_int(o, f"leaves[{i}].offsets", 0, end) for o in item["offsets"])
        if len(boxes) != len(offsets) or not isinstance(item["path"], str):
            raise ValueError(f"leaves[{i}]: one offset per box and a path are required")
        if math.prod(shape):
            _check_tiling(shape, dtype.itemsize, boxes)
        sharding = item["sharding"]
        if sharding is not None:
            _check_sharding(sharding, len(shape))
        held_by = item.get("parts")
        if held_by is not None:
            if origin is not None or not isinstance(held_by, list) or len(held_by) != len(boxes):
                raise ValueError(f"leaves[{i}].parts: one process per box, and no origin")
            held_by = tuple(_int(p, f"leaves[{i}].parts", 0, len(parts)) for p in held_by)
            if item.get("amax") is not None:
                raise ValueError(f"leaves[{i}]: maxima of a leaf held in parts")
        amax = item.get("amax")
        if amax is not None:
            amax = _int(amax, f"leaves[{i}].amax", 0, end - 4 * channels_of(shape))
            if item["dtype"] not in AMAX_DTYPES:
                raise ValueError(f"leaves[{i}]: maxima of a {item['dtype']} leaf")
        entry = LeafEntry(
            item["path"], shape, item["dtype"], boxes, offsets, sharding, amax, origin, held_by
        )
        for b, offset in enumerate(offsets):
            if offset + entry.box_bytes(b) > (part_bytes[held_by[b]] if held_by else end):
                raise ValueError(f"leaves[{i}]: box {b} runs past the stream's end")
        leaves.append(entry)
    _check_disjoint(leaves, version)
    tree = body["tree"]
    if tree is not None:
        _check_skeleton(tree, len(leaves))
        _check_skeleton_paths(tree, [leaf.path for leaf in leaves])
    return Manifest(
        name,
        version,
        parent,
        chunk_bytes,
        total,
        tuple(leaves),
        checksums,
        tree,
        base,
        origins,
        tuple(parts),
        digests,
    )


def _check_disjoint(leaves: list[LeafEntry], version: int) -> None:
    """Raises ValueError unless no two regions of one stream overlap (boxes and maxima): a
    subscriber's scatter takes each run's length from where the next starts, so overlapping
    regions would leave target bytes unwritten under a checksum that passes."""
    regions = []
    for leaf in leaves:
        stream = (0, version if leaf.origin is None else leaf.origin)
        for b, offset in enumerate(leaf.offsets):
            held = (1, leaf.parts[b]) if leaf.parts is not None and leaf.parts[b] else stream
            regions.append((held, offset, offset + leaf.box_bytes(b)))
        if leaf.amax is not None:
            regions.append((stream, leaf.amax, leaf.amax + 4 * leaf.channels))
    regions = sorted(r for r in regions if r[2] > r[1])
    for (s1, _, end), (s2, start, _) in itertools.pairwise(regions):
        if s1 == s2 and start < end:
            raise ValueError(f"two regions of one stream {s1} overlap at byte {start}")


def check_name(name: Any) -> str:
    """A weights name: letters, digits, '.', '_' or '-' (it names a /dev/shm file)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"name: {name!r} must be 1 to 64 letters, digits, '.', '_' or '-'"
        )
    return name


def check_version(version: Any, argument: str = "version") -> int:
    """A version: an ``int`` in ``[0, 2**62)`` (see the module docstring)."""
    if type(version) is not int or not 0 <= version < 2**62:
        raise InvalidArgumentError(
            f"{argument}: expected a non-negative integer (a training step), got {version!r}"
        )
    return version
