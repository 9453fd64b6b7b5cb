"""What a published version looks like, read from its manifest: so that a sampler told only a
weights name, a version and where to find it can build its own target.

:meth:`Subscriber.structure <tpusync._src.weights.subscriber.Subscriber.structure>` (and
:func:`tpusync._src.weights.subscriber.published_structure`) return a
:class:`PublishedStructure`: each leaf's path, shape, dtype and the publisher's sharding as data
(mesh axes and ``PartitionSpec``), and the tree they sit in. A sampler's devices are not the
trainer's, so :meth:`PublishedStructure.target` rebuilds the shardings on a mesh of the
sampler's (the same axis names, any sizes), or takes a ``PartitionSpec`` per leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpusync._src.weights.manifest import Manifest, rebuild_tree
from tpusync.errors import InvalidArgumentError

__all__ = ["PublishedLeaf", "PublishedStructure", "structure_of"]


@dataclass(frozen=True)
class PublishedLeaf:
    """One published leaf: its tree path (``jax.tree_util.keystr``), global shape and dtype;
    the publisher's mesh axes (name -> size, in order) and ``PartitionSpec`` when its array
    had a ``NamedSharding`` (else None)."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    mesh_axes: tuple[tuple[str, int], ...] | None
    spec: PartitionSpec | None


@dataclass(frozen=True)
class PublishedStructure:
    """A published version's structure (see the module docstring)."""

    name: str
    version: int
    leaves: tuple[PublishedLeaf, ...]
    _skeleton: Any = None

    @property
    def has_tree(self) -> bool:
        """Whether the publisher's tree can be rebuilt here (dicts with string keys, lists,
        tuples and None only); without it, build the target yourself from :attr:`leaves`."""
        return self._skeleton is not None

    def shapes(self) -> Any:
        """The published tree with a ``jax.ShapeDtypeStruct`` (no sharding) per leaf."""
        return self._tree([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.leaves])

    def target(self, mesh: Mesh, *, specs: Mapping[str, PartitionSpec] | None = None) -> Any:
        """A target for :class:`~tpusync.weights.Subscriber`: the published tree with a
        ``jax.ShapeDtypeStruct`` per leaf sharded ``NamedSharding(mesh, spec)``, where ``spec``
        is ``specs[path]`` when given, else the publisher's ``PartitionSpec`` (whose axis names
        ``mesh`` must have), else replicated.

        Raises InvalidArgumentError naming the leaf and the fix when ``mesh`` lacks an axis a
        publisher's spec names, or when ``specs`` names a path the version does not have."""
        if not isinstance(mesh, Mesh):
            raise InvalidArgumentError(
                f"mesh: expected a jax.sharding.Mesh of this process's devices, got "
                f"{type(mesh).__name__}"
            )
        specs = dict(specs or {})
        for path, spec in specs.items():
            if not isinstance(spec, PartitionSpec):
                raise InvalidArgumentError(
                    f"specs[{path!r}]: expected a jax.sharding.PartitionSpec, got "
                    f"{type(spec).__name__}"
                )
        unknown = sorted(set(specs) - {x.path for x in self.leaves})
        if unknown:
            raise InvalidArgumentError(
                f"specs: {unknown[:3]} are not paths of version {self.version} of "
                f"{self.name!r}; the paths are PublishedStructure.leaves[i].path"
            )
        out = []
        for leaf in self.leaves:
            spec = specs.get(leaf.path, leaf.spec if leaf.spec is not None else PartitionSpec())
            missing = sorted(_axis_names(spec) - set(mesh.axis_names))
            if missing:
                raise InvalidArgumentError(
                    f"mesh: the publisher shards {leaf.path} over the axes {missing}, which "
                    f"this mesh (axes {list(mesh.axis_names)}) lacks; name the mesh's axes so, "
                    f"or pass specs={{{leaf.path!r}: PartitionSpec(...)}}"
                )
            out.append(
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
            )
        return self._tree(out)

    def _tree(self, leaves: list[Any]) -> Any:
        if self._skeleton is None:
            raise InvalidArgumentError(
                f"version {self.version} of {self.name!r}: the publisher's tree has nodes "
                "this build cannot rebuild (only dicts with string keys, lists, tuples and "
                "None travel): build the target in the trainer's structure yourself, from "
                "PublishedStructure.leaves (path, shape, dtype, spec)"
            )
        return rebuild_tree(self._skeleton, leaves)


def _axis_names(spec: PartitionSpec) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        if isinstance(entry, tuple):
            names.update(entry)
        elif isinstance(entry, str):
            names.add(entry)
    return names


def structure_of(manifest: Manifest) -> PublishedStructure:
    """The structure a (checked) manifest describes."""
    leaves = []
    for entry in manifest.leaves:
        axes = spec = None
        if entry.sharding is not None:
            axes = tuple((name, size) for name, size in entry.sharding["axes"])
            spec = PartitionSpec(
                *(tuple(e) if isinstance(e, list) else e for e in entry.sharding["spec"])
            )
        leaves.append(PublishedLeaf(entry.path, entry.shape, entry.np_dtype, axes, spec))
    return PublishedStructure(manifest.name, manifest.version, tuple(leaves), manifest.tree)
