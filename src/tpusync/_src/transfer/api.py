"""transfer(): the one call that moves arrays or lists of blocks, validated first, run async."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Generator, Iterable, Sequence
from typing import Any

from tpusync._src.engines.base import DeviceSide, Engine, Move
from tpusync._src.memory.device_pool import DevicePool, check_alive, lock_of
from tpusync._src.transfer.plan import (
    BlockList,
    Transfer,
    adopt_pool_sources,
    block_array,
    check_distinct_destinations,
    plan_move,
)
from tpusync._src.transfer.select import PATHS, Path, choose_engine
from tpusync._src.transfer.trees import is_side, leaf_pairs
from tpusync.errors import (
    InvalidArgumentError,
    TpuSyncError,
    TransferFailedError,
    TransferTimeoutError,
)

__all__ = ["Transfer", "TransferFuture", "pools_locked", "transfer", "transfer_batch"]

_WORKERS = 4


class TransferFuture(concurrent.futures.Future):
    """The result of :func:`transfer`: ``concurrent.futures.Future`` semantics, and awaitable.

    ``result(timeout)`` returns the number of bytes written to destinations, raises
    :class:`~tpusync.errors.TransferTimeoutError` on timeout, and re-raises the transfer's error
    (a :class:`~tpusync.errors.TpuSyncError`) otherwise. ``cancel()`` succeeds only before the
    transfer starts. ``path`` is the engine that runs it (``"native"`` or ``"jax"``) and ``nbytes``
    the bytes it moves.
    """

    path: str
    nbytes: int

    def result(self, timeout: float | None = None) -> int:
        try:
            return super().result(timeout)
        except TimeoutError as exc:
            if isinstance(exc, TpuSyncError) or self.done():
                raise
            raise TransferTimeoutError(
                f"the transfer of {self.nbytes} bytes did not finish within {timeout} s; "
                "call result() again to keep waiting"
            ) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        except TimeoutError as exc:
            if isinstance(exc, TpuSyncError) or self.done():
                raise
            raise TransferTimeoutError(
                f"the transfer of {self.nbytes} bytes did not finish within {timeout} s"
            ) from None

    def __await__(self) -> Generator[Any, None, int]:
        return asyncio.wrap_future(self).__await__()


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                _WORKERS, thread_name_prefix="tpusync-transfer"
            )
        return _executor


def _forget_executor_after_fork() -> None:
    global _executor, _executor_lock
    _executor = None  # its threads did not survive the fork
    _executor_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_executor_after_fork)


def transfer(
    src: Any,
    dst: Any,
    *,
    src_blocks: BlockList = None,
    dst_blocks: BlockList = None,
    block_axis: int = 0,
    path: Path = "auto",
) -> TransferFuture:
    """Moves ``src_blocks[i]`` of ``src`` to ``dst_blocks[i]`` of ``dst``, asynchronously.

    Args:
      src: a ``jax.Array`` (single-device or sharded), a :class:`~tpusync.DevicePool`, a numpy
        array or a :class:`~tpusync.HostBuffer`; or a pytree of them (see below).
      dst: a :class:`~tpusync.DevicePool` (the only device arrays tpusync writes), a writable
        numpy array or a :class:`~tpusync.HostBuffer`; or a pytree of them with the structure
        of ``src``.
      src_blocks, dst_blocks: block indices along ``block_axis``; None means every block of that
        side. Both lists have the same length; destination indices do not repeat.
      block_axis: the axis that indexes blocks, the same on both sides (vLLM's
        ``(2, num_blocks, ...)`` pools use 1). Every block must be contiguous in memory on the
        host side; outer axes may be strided (e.g. one array's region of a host pool's slots).
      path: ``"auto"`` (native where it runs, else pure JAX), ``"native"`` (raises
        :class:`~tpusync.errors.NativePathUnavailableError` where it does not run), or ``"jax"``.

    The host side of a sharded device array holds its distinct addressable shards along a
    leading axis, ``[shard][blocks...]``, ordered by the shards' start indices (row-major). A
    replicated shard is read once and written to every replica. The leading axis may be left out
    when the array has one distinct shard.

    **Pytrees.** ``src`` and ``dst`` may be pytrees (nested dicts, lists, tuples, ... as
    ``jax.tree_util`` sees them, with tpusync's pools and buffers as leaves) of the same
    structure, e.g. ``{"layer0": {"k": pool_k0, "v": pool_v0}, ...}`` and a dict of host buffers
    shaped alike. Every leaf pair is one pair of a single batch (as :func:`transfer_batch`: one
    plan, one engine run, one future), with the same ``src_blocks``, ``dst_blocks`` and
    ``block_axis`` for every leaf. Errors name the leaf by its key path (``src['layer0']['k']``);
    trees of different structure are refused, naming both structures. The future's result is the
    bytes written over all leaves.

    Everything is validated before the first byte moves: a rejected call raises a
    :class:`~tpusync.errors.TpuSyncError` and changes nothing. Moves are of bits, not values
    (NaN payloads survive). A call inside ``jax.jit`` (or another JAX transformation), where the
    arrays are tracers, is refused: call it outside the jitted function. Returns a
    :class:`TransferFuture`.
    """
    _check_path(path)
    item = Transfer(src, dst, src_blocks, dst_blocks, block_axis)
    if is_side(src) and is_side(dst):  # the common case pays no tree handling
        return _run([(item, "src", "dst", "dst")], path)
    return _run(_leaf_items(item, "src", "dst"), path)


def transfer_batch(transfers: Iterable[Transfer], *, path: Path = "auto") -> TransferFuture:
    """Moves many (src, dst) pairs — e.g. one per layer, or K and V apart — under one future.

    A pair's ``src`` and ``dst`` may be pytrees of the same structure, as in :func:`transfer`;
    its leaves are then named ``transfers[i].src['layer0']['k']`` in errors. Every pair is
    validated before any moves; the native engine runs them as one job.
    """
    _check_path(path)
    items: list[Named] = []
    for i, item in enumerate(transfers):
        if not isinstance(item, Transfer):
            raise InvalidArgumentError(
                f"transfers[{i}]: expected tpusync.Transfer(src, dst, ...), "
                f"got {type(item).__name__}"
            )
        if is_side(item.src) and is_side(item.dst):
            items.append((item, "src", "dst", f"transfers[{i}]"))
        else:
            items += _leaf_items(item, f"transfers[{i}].src", f"transfers[{i}].dst")
    return _run(items, path)


# A pair to plan: the Transfer, its sides' names in errors, and the pair's name in a batch.
Named = tuple[Transfer, str, str, str]


def _leaf_items(item: Transfer, src_name: str, dst_name: str) -> list[Named]:
    """One named pair per leaf of a pytree pair, all with the item's block lists (checked and
    converted once here, so that each leaf only checks their range)."""
    src_blocks = block_array(item.src_blocks, "src_blocks")
    dst_blocks = block_array(item.dst_blocks, "dst_blocks")
    return [
        (Transfer(s, d, src_blocks, dst_blocks, item.block_axis), s_name, d_name, d_name)
        for s, d, s_name, d_name in leaf_pairs(item.src, item.dst, src_name, dst_name)
    ]


def _check_path(path: Any) -> None:
    if path not in PATHS:
        raise InvalidArgumentError(f"path: expected one of {PATHS}, got {path!r}")


def _run(items: Sequence[Named], path: str) -> TransferFuture:
    """Validates and plans every named pair, chooses one engine and starts it on a worker."""
    moves = [plan_move(item, src_name, dst_name) for item, src_name, dst_name, _ in items]
    check_distinct_destinations(moves, [label for *_, label in items])
    adopt_pool_sources(moves)
    engine = choose_engine(moves, path)
    future = TransferFuture()
    future.path = engine.name
    future.nbytes = sum(move.nbytes for move in moves)
    if future.nbytes == 0:
        future.set_running_or_notify_cancel()
        future.set_result(0)
        return future
    _get_executor().submit(_execute, future, engine, moves)
    return future


def pools_locked(moves: Sequence[Move]) -> contextlib.ExitStack:
    """The locks of every DevicePool the moves touch, taken in one global order (no lock-order
    deadlocks); hold them while an engine runs the moves."""
    pools: dict[int, DevicePool] = {}
    for move in moves:
        for pool in move.pools():
            pools[id(pool)] = pool
    stack = contextlib.ExitStack()
    for key in sorted(pools):  # one global order: no lock-order deadlocks
        stack.enter_context(lock_of(pools[key]))
    return stack


def _execute(future: TransferFuture, engine: Engine, moves: list[Move]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        with pools_locked(moves):
            for move in moves:
                for side in (move.src, move.dst):
                    if isinstance(side, DeviceSide) and side.array.is_deleted():
                        check_alive(side.array, side.argument)
            engine.run(moves)
    except TpuSyncError as exc:
        future.set_exception(exc)
    except BaseException as exc:
        error = TransferFailedError(f"the transfer failed while moving bytes: {exc}")
        error.__cause__ = exc
        future.set_exception(error)
    else:
        future.set_result(future.nbytes)
