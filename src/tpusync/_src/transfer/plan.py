"""Plans a batch: each requested pair validated into a Move with explicit block lists.

Pure validation and index arithmetic: nothing moves, and a rejected pair changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from tpusync._src.engines.base import DeviceSide, HostSide, Move
from tpusync._src.memory.device_pool import current_array
from tpusync._src.transfer.endpoints import TRACED, check_pair, resolve
from tpusync.errors import BlockIndexError, InvalidArgumentError, ShapeMismatchError

__all__ = [
    "BlockList",
    "Transfer",
    "adopt_pool_sources",
    "block_array",
    "block_indices",
    "check_distinct_destinations",
    "is_identity",
    "pair_block_lists",
    "plan_move",
]

BlockList = Sequence[int] | np.ndarray | range | None


@dataclass(frozen=True)
class Transfer:
    """One (src, dst) pair of a :func:`transfer_batch`, with the same meaning as
    :func:`transfer`'s arguments."""

    src: Any
    dst: Any
    src_blocks: BlockList = None
    dst_blocks: BlockList = None
    block_axis: int = 0


def block_indices(blocks: BlockList, num_blocks: int, argument: str) -> np.ndarray | None:
    """Validates a block list; returns it as int64, or None for "all blocks"."""
    array = block_array(blocks, argument)
    if array is not None and array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= num_blocks:
            bad = low if low < 0 else high
            raise BlockIndexError(
                f"{argument}: block index {bad} is out of range for {num_blocks} blocks "
                f"(valid: 0..{num_blocks - 1})"
            )
    return array


def block_array(blocks: BlockList, argument: str) -> np.ndarray | None:
    """A block list's kind checked (flat integers) and converted to int64, its range not (see
    :func:`block_indices`); None stays None ("all blocks")."""
    if blocks is None:
        return None
    if isinstance(blocks, jax.core.Tracer):
        raise InvalidArgumentError(f"{argument}: {TRACED}")
    if isinstance(blocks, range):
        return np.arange(blocks.start, blocks.stop, blocks.step, dtype=np.int64)
    try:
        array = np.asarray(blocks)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{argument}: expected a sequence of block indices, got {type(blocks).__name__}"
        ) from exc
    if array.size == 0:
        array = array.astype(np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgumentError(
            f"{argument}: block indices must be integers, got dtype {array.dtype}"
        )
    if array.ndim != 1:
        raise InvalidArgumentError(
            f"{argument}: expected a flat list of block indices, got shape {array.shape}"
        )
    return array.astype(np.int64, copy=False)


def pair_block_lists(
    src_blocks: BlockList, dst_blocks: BlockList, src_count: int, dst_count: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validates both lists and returns them explicitly, equal in length."""
    src = block_indices(src_blocks, src_count, "src_blocks")
    dst = block_indices(dst_blocks, dst_count, "dst_blocks")
    if src is None:
        src = np.arange(src_count, dtype=np.int64)
    if dst is None:
        dst = np.arange(dst_count, dtype=np.int64)
    if len(src) != len(dst):
        what = "blocks" if src_blocks is None and dst_blocks is None else "block lists"
        raise InvalidArgumentError(
            f"dst_blocks: {len(dst)} destination {what} for {len(src)} source {what}; "
            "src_blocks[i] goes to dst_blocks[i], so both need the same length"
        )
    if len(dst) > 1:
        counts = np.bincount(dst)  # indices are in range and non-negative by now
        if counts.max() > 1:
            raise BlockIndexError(
                f"dst_blocks: destination block {int(np.argmax(counts > 1))} appears more "
                "than once; each destination block may be written once per transfer"
            )
    return src, dst


def is_identity(src: np.ndarray, dst: np.ndarray, src_count: int, dst_count: int) -> bool:
    """True when the transfer moves every block to the same index (a whole-array copy)."""
    n = len(src)
    return (
        n == src_count == dst_count
        and bool(np.array_equal(src, np.arange(n)))
        and bool(np.array_equal(dst, src))
    )


def plan_move(item: Transfer, src_name: str = "src", dst_name: str = "dst") -> Move:
    """Validates one pair and plans it as a Move (block lists explicit); changes nothing.

    ``src_name`` and ``dst_name`` are what errors call the two sides (a pytree leaf's key
    path, e.g. ``src['layer0']['k']``)."""
    if not isinstance(item.block_axis, int) or isinstance(item.block_axis, bool):
        raise InvalidArgumentError(
            f"block_axis: expected an int, got {type(item.block_axis).__name__}"
        )
    src = resolve(item.src, src_name, destination=False)
    dst = resolve(item.dst, dst_name, destination=True)
    if (
        isinstance(src, HostSide)
        and isinstance(dst, HostSide)
        and src.views[0].ndim != dst.views[0].ndim
    ):
        s_view, d_view = src.views[0], dst.views[0]
        raise ShapeMismatchError(
            f"{dst_name}: rank {d_view.ndim} (shape {d_view.shape}, dtype {d_view.dtype}) "
            f"differs from {src_name}'s rank {s_view.ndim} (shape {s_view.shape}, dtype "
            f"{s_view.dtype}); both sides need the same rank"
        )
    check_pair(src, dst, item.block_axis)
    src_count = src.shard_shape[item.block_axis]
    dst_count = dst.shard_shape[item.block_axis]
    src_idx, dst_idx = pair_block_lists(item.src_blocks, item.dst_blocks, src_count, dst_count)
    if dst.pool is not None:
        dst.pool.check_writable(dst_idx, item.block_axis, "dst_blocks")
    whole = is_identity(src_idx, dst_idx, src_count, dst_count)
    return Move(src, dst, src_idx, dst_idx, item.block_axis, whole)


def check_distinct_destinations(moves: Sequence[Move], labels: Sequence[str]) -> None:
    """Refuses a batch that writes one DevicePool in two pairs; ``labels`` name each move's
    pair in errors (``transfers[i]``, or a pytree leaf's key path)."""
    seen: dict[int, str] = {}
    for move, label in zip(moves, labels, strict=True):
        target = move.dst.pool if isinstance(move.dst, DeviceSide) else None
        if target is None:
            continue
        key = id(target)
        if key in seen:
            # Two writes into one pool in one batch would each see the other's half-done state
            # on the pure-JAX path; ask for one pair per pool instead.
            raise InvalidArgumentError(
                f"{label}: writes into the same DevicePool as {seen[key]}; "
                "merge them into one pair (concatenate the block lists)"
            )
        seen[key] = label


def adopt_pool_sources(moves: Sequence[Move]) -> None:
    """A source given as ``pool.array`` of a pool this batch writes is read through the pool:
    the raw write's donated identity step replaces that array, and the read must follow it."""
    pools = {id(p): p for move in moves for p in move.pools()}
    for move in moves:
        src = move.src
        if isinstance(src, DeviceSide) and src.pool is None:
            for pool in pools.values():
                if current_array(pool) is src.array:
                    src.pool, src.given = pool, None
