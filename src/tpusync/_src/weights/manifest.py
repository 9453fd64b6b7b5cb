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

The helpers both sides share are here too: the pool layout of a stream's chunks
(:func:`chunk_layout`) and the leaf paths a manifest names (:func:`tree_paths`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes  # jax's own dependency: bfloat16 and the float8 types
import numpy as np

from tpusync._src.tiers.layout import ArrayLayout, PoolLayout
from tpusync._src.weights.plan import Box, leaf_plan
from tpusync.errors import InvalidArgumentError, WeightSyncError

__all__ = [
    "FORMAT",
    "LeafEntry",
    "Manifest",
    "announcement_key",
    "check_name",
    "check_version",
    "chunk_key",
    "chunk_layout",
    "manifest_key",
    "tree_paths",
]

FORMAT = 2  # 2: no pool slots or path (a same-host subscriber asks the lease)
STREAM_ALIGNMENT = 64
_MAX_LEAVES = 1 << 16
_MAX_DIMS = 16
_MAX_CHUNKS = 1 << 24
_MAX_MANIFEST_BYTES = 1 << 30
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")


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


@dataclass(frozen=True)
class LeafEntry:
    """One leaf: its tree path, global shape, dtype name, distinct shard boxes (the
    publisher's layout) and where each box's bytes start in the version's stream."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    boxes: tuple[Box, ...]
    offsets: tuple[int, ...]

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

    ``checksums[i]`` is chunk ``i``'s block checksum (the tiers' scheme)."""

    name: str
    version: int
    parent: int | None
    chunk_bytes: int
    total_bytes: int
    leaves: tuple[LeafEntry, ...]
    checksums: np.ndarray

    @property
    def n_chunks(self) -> int:
        return len(self.checksums)

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
                }
                for leaf in self.leaves
            ],
            "checksums": self.checksums.astype("<u8").tobytes().hex(),
        }
        text = json.dumps(body, separators=(",", ":")).encode()
        return len(text).to_bytes(8, "little") + text

    @classmethod
    def from_bytes(cls, data: bytes, *, name: str, version: int) -> Manifest:
        """A manifest read from a peer, every field checked (``WeightSyncError`` naming the
        field when one is wrong); it must be the manifest of ``name``'s ``version``."""
        try:
            return _parse(data, name, version)
        except (KeyError, TypeError, ValueError, OverflowError, InvalidArgumentError) as error:
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
    leaves_in = body["leaves"]
    if not isinstance(leaves_in, list) or len(leaves_in) > _MAX_LEAVES:
        raise ValueError("leaves: expected a list")
    leaves = []
    for i, item in enumerate(leaves_in):
        shape = tuple(_int(d, f"leaves[{i}].shape", 0, 1 << 40) for d in item["shape"])
        if len(shape) > _MAX_DIMS or not _DTYPE.fullmatch(item["dtype"]):
            raise ValueError(f"leaves[{i}]: a shape or dtype out of bounds")
        dtype = dtype_of(item["dtype"])
        boxes = tuple(tuple((int(a), int(b)) for a, b in box) for box in item["boxes"])
        offsets = tuple(_int(o, f"leaves[{i}].offsets", 0, total) for o in item["offsets"])
        if len(boxes) != len(offsets) or not isinstance(item["path"], str):
            raise ValueError(f"leaves[{i}]: one offset per box and a path are required")
        if math.prod(shape):
            _check_tiling(shape, dtype.itemsize, boxes)
        entry = LeafEntry(item["path"], shape, item["dtype"], boxes, offsets)
        for b, offset in enumerate(offsets):
            if offset + entry.box_bytes(b) > total:
                raise ValueError(f"leaves[{i}]: box {b} runs past the stream's end")
        leaves.append(entry)
    return Manifest(name, version, parent, chunk_bytes, total, tuple(leaves), checksums)


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
