"""Pytrees of transfer sides: a tree of sources and a tree of destinations as leaf pairs.

JAX users keep a KV cache as a pytree (e.g. ``{"layer0": {"k": pool, "v": pool}, ...}``);
:func:`leaf_pairs` flattens both trees with tpusync's sides as leaves, checks that they have the
same structure and names each leaf by its key path (``src['layer0']['k']``), so that every error
about a leaf says which one it is. A call with one array on each side never comes here (see
:func:`is_side`).
"""

from __future__ import annotations

from typing import Any, cast

import jax
import numpy as np

from tpusync._src.memory.device_pool import DevicePool
from tpusync._src.memory.host_buffer import HostBuffer
from tpusync.errors import InvalidArgumentError

__all__ = ["SIDE_TYPES", "is_side", "leaf_pairs"]

# What one side of a transfer can be. A tracer is one too, so that resolve() refuses it by name
# (not every tracer is an instance of jax.Array).
SIDE_TYPES: tuple[type, ...] = (np.ndarray, HostBuffer, DevicePool, jax.Array, jax.core.Tracer)

_SIDES = "a jax.Array, tpusync.DevicePool, tpusync.HostBuffer or numpy.ndarray"
_SHORT = 120  # characters of a tree structure that an error message shows

LeafPair = tuple[Any, Any, str, str]


def is_side(obj: Any) -> bool:
    """True for one array or pool (a leaf), False for a pytree of them (or anything else)."""
    return isinstance(obj, SIDE_TYPES)


def leaf_pairs(src: Any, dst: Any, src_name: str, dst_name: str) -> list[LeafPair]:
    """``(src_leaf, dst_leaf, src_leaf_name, dst_leaf_name)`` for every leaf, in tree order.

    Raises :class:`~tpusync.errors.InvalidArgumentError` when the two trees' structures differ
    (naming both), or when a side is None (JAX's empty tree, here almost surely a mistake).
    Leaves that are not sides are returned as they are: resolve() refuses them by name."""
    for obj, name in ((src, src_name), (dst, dst_name)):
        if obj is None:
            raise InvalidArgumentError(f"{name}: expected {_SIDES} or a pytree of them, got None")
    src_leaves, src_tree = jax.tree_util.tree_flatten_with_path(src, is_leaf=is_side)
    dst_leaves, dst_tree = jax.tree_util.tree_flatten_with_path(dst, is_leaf=is_side)
    if cast(Any, src_tree) != dst_tree:  # PyTreeDef's stub declares no comparison
        raise _structure_error(
            (src, src_name, src_tree, src_leaves), (dst, dst_name, dst_tree, dst_leaves)
        )
    keystr = jax.tree_util.keystr
    return [
        (s, d, src_name + keystr(path), dst_name + keystr(path))
        for (path, s), (_, d) in zip(src_leaves, dst_leaves, strict=True)
    ]


def _structure_error(src: tuple[Any, ...], dst: tuple[Any, ...]) -> InvalidArgumentError:
    """Both structures (shortened) and the first leaf without a partner. A tree facing a single
    array names the tree's side; otherwise the destination (which must follow the source)."""
    src_obj, src_name, src_tree, src_leaves = src
    dst_obj, dst_name, dst_tree, dst_leaves = dst
    if is_side(src_obj) != is_side(dst_obj):
        (tree, name, structure), (other, other_structure) = (
            ((src_obj, src_name, src_tree), (dst_name, dst_tree))
            if is_side(dst_obj)
            else ((dst_obj, dst_name, dst_tree), (src_name, src_tree))
        )
        return InvalidArgumentError(
            f"{name}: expected {_SIDES} like {other}, got a {type(tree).__name__} with tree "
            f"structure {_short(structure)} while {other}'s is {_short(other_structure)}; pass "
            "one array on each side, or pytrees of the same structure on both"
        )
    keystr = jax.tree_util.keystr
    src_paths = [keystr(path) for path, _ in src_leaves]
    dst_paths = [keystr(path) for path, _ in dst_leaves]
    src_set, dst_set = set(src_paths), set(dst_paths)
    only_src = [p for p in src_paths if p not in dst_set]
    only_dst = [p for p in dst_paths if p not in src_set]
    if only_src:
        detail = f" ({src_name}{only_src[0]} has no counterpart in {dst_name})"
    elif only_dst:
        detail = f" ({dst_name}{only_dst[0]} has no counterpart in {src_name})"
    else:
        detail = " (the same key paths in different containers, e.g. a list and a tuple)"
    return InvalidArgumentError(
        f"{dst_name}: tree structure {_short(dst_tree)} differs from {src_name}'s "
        f"{_short(src_tree)}{detail}; pass pytrees of the same structure, with one destination "
        "array or pool for every source leaf"
    )


def _short(tree: Any) -> str:
    text = str(tree)
    if len(text) <= _SHORT:
        return text
    return text[: _SHORT - 20] + " ... " + text[-15:]
