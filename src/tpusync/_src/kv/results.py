"""What :class:`~tpusync.kv.KVCacheStore`'s calls answer: a lookup's handle
(:class:`LookupResult`, with pins on its blocks), a load's and a save's results, a layer-by-layer
load's and a save's futures and a restored session."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tpusync.errors import InvalidArgumentError

__all__ = [
    "LayerLoad",
    "LoadResult",
    "LookupResult",
    "SaveFuture",
    "SaveResult",
    "SessionRestore",
]

_handle_ids = itertools.count(1)


class HandleOwner(Protocol):
    """The store a :class:`LookupResult` came from (what its context manager releases it to)."""

    def release(self, result: LookupResult) -> None: ...


@dataclass(eq=False)
class LookupResult:
    """The longest cached prefix of a token list, with pins on its blocks (see the module
    docstring). ``cached_tokens`` is a multiple of the block size; ``tiers[i]`` names the tier
    block ``i`` was found in. On a full hit the caller still recomputes the last token (for its
    logits): load every block, then prefill from ``min(cached_tokens, len(tokens) - 1)``. A hit
    may be longer than the DRAM tier holds: it then loads through DRAM chunk by chunk."""

    cached_tokens: int
    total_tokens: int
    keys: tuple[bytes, ...]
    tiers: tuple[str, ...]
    _store: HandleOwner | None = field(repr=False)
    _id: int = field(default_factory=lambda: next(_handle_ids), repr=False)
    _state: str = field(default="open", repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def open(self) -> bool:
        """True until loaded or released."""
        return self._state == "open"

    def __enter__(self) -> LookupResult:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state == "open" and self._store is not None:
            self._store.release(self)


# A handle's lifecycle, kept by the store that made it (its only writer, under its handles lock):
# "open" -> "loading" -> "loaded" (or back to "open" when the load fails), "open" -> "released",
# and "closed" when the store closes. These functions are the one place that touches it.


def handle_id(result: LookupResult) -> int:
    """The handle's number, unique in this process (a collected handle's ``id()`` may recur)."""
    return result._id


def handle_state(result: LookupResult) -> str:
    return result._state


def set_handle_state(result: LookupResult, state: str) -> None:
    result._state = state


def made_by(result: LookupResult, owner: HandleOwner) -> bool:
    """Whether ``owner`` (a store) made this handle."""
    return result._store is owner


@dataclass(frozen=True)
class LoadResult:
    """What a load put into the device blocks: the first ``loaded_blocks`` blocks
    (``loaded_tokens`` tokens) are valid; recompute from ``loaded_tokens`` on."""

    loaded_tokens: int
    loaded_blocks: int
    requested_blocks: int
    bytes: int
    seconds: float
    promoted_blocks: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class LayerLoad:
    """A load running in the background that fills the store's device pools one after another
    (in the order the store was given them: an engine's layers), so that a reader of pool
    ``i`` (attention on layer ``i``) may start while the later pools are copied.

    Blocks become readable before their checksums are compared: only :meth:`result` says which
    blocks are valid (a block that failed is reported as not loaded, never read again from a
    lower tier into the same device block). A caller that read a failed block must discard
    what it computed from it: vLLM does for the blocks the connector reports after the step."""

    def __init__(self, pools: int) -> None:
        self._pools = pools
        self._written = 0  # pools 0 .. _written - 1 hold their blocks
        self._finished = False
        self._changed = threading.Condition()
        self._future: concurrent.futures.Future[LoadResult] = concurrent.futures.Future()

    def _pool_written(self, index: int) -> None:
        with self._changed:
            self._written = max(self._written, index + 1)
            self._changed.notify_all()

    def _finish(self, result: LoadResult | None, error: BaseException | None) -> None:
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(result)  # type: ignore[arg-type]
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    def wait_for(self, pool_index: int, timeout: float | None = None) -> bool:
        """Waits until pool ``pool_index`` holds this load's blocks (or the load has ended,
        loaded or not); returns False if ``timeout`` seconds passed first."""
        if not 0 <= pool_index < self._pools:
            raise InvalidArgumentError(
                f"pool_index: {pool_index} is not one of the store's {self._pools} device pools"
            )
        with self._changed:
            return self._changed.wait_for(
                lambda: self._finished or self._written > pool_index, timeout
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until the load has ended (loaded or not); False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._finished, timeout)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> LoadResult:
        """The finished load (as :meth:`~tpusync.kv.KVCacheStore.load` returns it); raises
        what the load raised, or ``TimeoutError``."""
        return self._future.result(timeout)


@dataclass(frozen=True)
class SaveResult:
    """A finished save: ``stored_blocks`` were copied into DRAM, ``skipped_blocks`` were
    already cached (not copied again)."""

    stored_blocks: int
    skipped_blocks: int
    bytes: int
    seconds: float


class SaveFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The future of a save: its result is the :class:`SaveResult` once the blocks are durable
    in DRAM; :attr:`released` completes (with None) as soon as the device blocks are no longer
    read, even when the save fails."""

    def __init__(self) -> None:
        super().__init__()
        self.released: concurrent.futures.Future[None] = concurrent.futures.Future()

    def __await__(self) -> Any:
        return asyncio.wrap_future(self).__await__()


@dataclass(frozen=True)
class SessionRestore:
    """A restored session: its ``tokens``, of which the first ``loaded_tokens`` have their KV
    in the device blocks (all of them unless a block was lost or corrupt: recompute the rest)."""

    session_id: str
    tokens: np.ndarray
    loaded_tokens: int
    bytes: int
    seconds: float


def run_layer_load(load: LayerLoad, call: Callable[[Callable[[int], None]], LoadResult]) -> None:
    """Runs ``call(after_pool)`` (the store's load) for ``load`` and records how it ended."""
    try:
        result = call(load._pool_written)
    except BaseException as error:  # handed to the waiter: result() raises it
        load._finish(None, error)
        return
    load._finish(result, None)
