"""transfer(): the one call that moves arrays or lists of blocks, validated first, run async."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tpusync import _jax_path, _native_path
from tpusync._layout import DeviceSide, HostSide, Move, check_pair, resolve
from tpusync._plan import BlockList, is_identity, pair_block_lists
from tpusync.device_pool import DevicePool
from tpusync.errors import (
    InvalidArgumentError,
    NativePathUnavailableError,
    TpuSyncError,
    TransferFailedError,
    TransferTimeoutError,
)

__all__ = ["Transfer", "TransferFuture", "transfer", "transfer_batch"]

Path = Literal["auto", "native", "jax"]
_PATHS = ("auto", "native", "jax")
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


@dataclass(frozen=True)
class Transfer:
    """One (src, dst) pair of a :func:`transfer_batch`, with the same meaning as
    :func:`transfer`'s arguments."""

    src: Any
    dst: Any
    src_blocks: BlockList = None
    dst_blocks: BlockList = None
    block_axis: int = 0


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
        array or a :class:`~tpusync.HostBuffer`.
      dst: a :class:`~tpusync.DevicePool` (the only device arrays tpusync writes), a writable
        numpy array or a :class:`~tpusync.HostBuffer`.
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

    Everything is validated before the first byte moves: a rejected call raises a
    :class:`~tpusync.errors.TpuSyncError` and changes nothing. Moves are of bits, not values
    (NaN payloads survive). Returns a :class:`TransferFuture`.
    """
    return transfer_batch([Transfer(src, dst, src_blocks, dst_blocks, block_axis)], path=path)


def transfer_batch(transfers: Iterable[Transfer], *, path: Path = "auto") -> TransferFuture:
    """Moves many (src, dst) pairs — e.g. one per layer, or K and V apart — under one future.

    Every pair is validated before any moves; the native engine runs them as one job.
    """
    if path not in _PATHS:
        raise InvalidArgumentError(f"path: expected one of {_PATHS}, got {path!r}")
    items = list(transfers)
    for i, item in enumerate(items):
        if not isinstance(item, Transfer):
            raise InvalidArgumentError(
                f"transfers[{i}]: expected tpusync.Transfer(src, dst, ...), "
                f"got {type(item).__name__}"
            )
    moves = [_plan_move(item) for item in items]
    _check_distinct_destinations(moves)
    _adopt_pool_sources(moves)
    engine = _choose_engine(moves, path)
    future = TransferFuture()
    future.path = engine
    future.nbytes = sum(move.nbytes for move in moves)
    runner = _native_path.run if engine == "native" else _jax_path.run
    if future.nbytes == 0:
        future.set_running_or_notify_cancel()
        future.set_result(0)
        return future
    _get_executor().submit(_execute, future, runner, moves)
    return future


def _plan_move(item: Transfer) -> Move:
    if not isinstance(item.block_axis, int) or isinstance(item.block_axis, bool):
        raise InvalidArgumentError(
            f"block_axis: expected an int, got {type(item.block_axis).__name__}"
        )
    src = resolve(item.src, "src", destination=False)
    dst = resolve(item.dst, "dst", destination=True)
    if (
        isinstance(src, HostSide)
        and isinstance(dst, HostSide)
        and src.views[0].ndim != dst.views[0].ndim
    ):
        from tpusync.errors import ShapeMismatchError

        raise ShapeMismatchError(
            f"dst: rank {dst.views[0].ndim} differs from src's rank {src.views[0].ndim}"
        )
    check_pair(src, dst, item.block_axis)
    src_count = src.shard_shape[item.block_axis]
    dst_count = dst.shard_shape[item.block_axis]
    src_idx, dst_idx = pair_block_lists(item.src_blocks, item.dst_blocks, src_count, dst_count)
    if isinstance(dst, DeviceSide) and dst.pool is not None:
        dst.pool._check_writable(dst_idx, item.block_axis, "dst_blocks")
    whole = is_identity(src_idx, dst_idx, src_count, dst_count)
    return Move(src, dst, src_idx, dst_idx, item.block_axis, whole)


def _check_distinct_destinations(moves: Sequence[Move]) -> None:
    seen: dict[int, int] = {}
    for i, move in enumerate(moves):
        target = move.dst.pool if isinstance(move.dst, DeviceSide) else None
        if target is None:
            continue
        key = id(target)
        if key in seen:
            # Two writes into one pool in one batch would each see the other's half-done state
            # on the pure-JAX path; ask for one pair per pool instead.
            raise InvalidArgumentError(
                f"transfers[{i}]: writes into the same DevicePool as transfers[{seen[key]}]; "
                "merge them into one pair (concatenate the block lists)"
            )
        seen[key] = i


def _adopt_pool_sources(moves: Sequence[Move]) -> None:
    """A source given as ``pool.array`` of a pool this batch writes is read through the pool:
    the raw write's donated identity step replaces that array, and the read must follow it."""
    pools = {id(p): p for move in moves for p in move.pools()}
    for move in moves:
        src = move.src
        if isinstance(src, DeviceSide) and src.pool is None:
            for pool in pools.values():
                if pool._array is src.array:
                    src.pool, src.given = pool, None


def _choose_engine(moves: Sequence[Move], path: Path) -> str:
    if path == "jax":
        return "jax"
    reasons = []
    explicit = path == "native"
    for move in moves:
        for side in (move.src, move.dst):
            if isinstance(side, DeviceSide):
                write = side is move.dst
                reason = _native_path.unavailable_reason(side.array, write, explicit)
                if reason:
                    reasons.append(f"{side.argument}: {reason}")
        if (
            isinstance(move.src, DeviceSide)
            and isinstance(move.dst, DeviceSide)
            and _native_path.pjrt_device(move.src.array)
        ):
            reasons.append("dst: device-to-device copies on a PJRT backend run in JAX")
    if not reasons:
        return "native"
    if path == "native":
        raise NativePathUnavailableError(
            "path='native' cannot run here: " + "; ".join(reasons) + ". Use path='auto'."
        )
    return "jax"


def _pools_locked(moves: Sequence[Move]) -> contextlib.ExitStack:
    pools: dict[int, DevicePool] = {}
    for move in moves:
        for pool in move.pools():
            pools[id(pool)] = pool
    stack = contextlib.ExitStack()
    for key in sorted(pools):  # one global order: no lock-order deadlocks
        stack.enter_context(pools[key]._lock)
    return stack


def _execute(
    future: TransferFuture, runner: Callable[[list[Move]], int], moves: list[Move]
) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        with _pools_locked(moves):
            for move in moves:
                for side in (move.src, move.dst):
                    if isinstance(side, DeviceSide) and side.array.is_deleted():
                        from tpusync.device_pool import _check_alive

                        _check_alive(side.array, side.argument)
            runner(moves)
    except TpuSyncError as exc:
        future.set_exception(exc)
    except BaseException as exc:
        error = TransferFailedError(f"the transfer failed while moving bytes: {exc}")
        error.__cause__ = exc
        future.set_exception(error)
    else:
        future.set_result(future.nbytes)
