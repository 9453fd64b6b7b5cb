"""What :class:`~tpusync.kv.KVCacheStore`'s calls answer: a lookup's handle
(:class:`LookupResult`, with pins on its blocks), a load's and a save's results, a save's future
and a restored session."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["LoadResult", "LookupResult", "SaveFuture", "SaveResult", "SessionRestore"]

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
