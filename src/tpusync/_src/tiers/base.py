"""The block interface every tier below DRAM implements (disk, shared filesystem, remote, and
another DRAM pool: :class:`~tpusync.tiers.HostPool` implements it slot to slot), what such a
tier needs of the DRAM pool it moves blocks to and from (:class:`SlotPool`, which
:class:`~tpusync.tiers.HostPool` implements; this module imports no concrete tier), and
:class:`BlockTier`, the base that owns the block transaction once for the media of this package.

Blocks move between such a tier and a DRAM pool (a :class:`SlotPool`) slot to slot: ``put``
reads committed DRAM slots (pinned while read) and stores them with their key, layout
fingerprint, length and checksum; ``get`` reserves DRAM slots, reads into them straight
from the medium, verifies every block's checksum over the bytes read, and commits only the good
ones. A block that is absent or fails verification is a miss: ``get`` raises
:class:`~tpusync.errors.BlocksMissingError` with a ``loaded`` mask after committing the rest.

A tier may also answer ``free`` (blocks it can still take now) and ``usable_capacity`` (the
slots it can reach now, when that is less than ``capacity``: a disk tier whose filesystem has no
room for more slab files), and ``read_only`` (searched and promoted from, never written); the KV
store's tier stack evicts by them (:func:`tier_free`, :func:`tier_usable_capacity`,
:func:`tier_read_only` answer for any tier).

A medium built on :class:`BlockTier` implements only its own part: which keys it still needs
to store (``_new_keys``), storing pinned DRAM slots (``_store``), loading into reserved DRAM
slots (``_reading`` and ``_load``, each block's verdict a :class:`Load`), removing what failed
(``_discard``) and its index (``contains``, ``keys``, ``delete``).
"""

from __future__ import annotations

import contextlib
import enum
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tpusync._src.tiers._keys import check_keys
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.slots import Pinned, Reservation
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import BlocksMissingError, InvalidArgumentError

__all__ = [
    "BlockTier",
    "Load",
    "LoadStatus",
    "LowerTier",
    "ScatteringTier",
    "SlotPool",
    "is_slot_pool",
    "tier_free",
    "tier_read_only",
    "tier_usable_capacity",
]


@runtime_checkable
class SlotPool(Protocol):
    """The slot interface of a DRAM pool, as a lower tier uses it (``put`` reads from one,
    ``get`` loads into one): blocks of ``layout`` in numbered slots, each found by its key.

    A slot to write is taken by :meth:`reserve` (invisible to readers), filled through
    :meth:`slot_memory` or :meth:`slot_addresses`, then published by :meth:`commit` with its
    checksum, or freed by :meth:`abort`; whoever reserved must do one of the two. A slot to
    read is held by :meth:`pin` (never reused while pinned) and released by one :meth:`unpin`."""

    layout: PoolLayout

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        """Takes a free slot for every key not yet present; TierFullError (taking nothing)
        when too few are free."""
        ...

    def commit(self, reservation: Reservation, checksums: np.ndarray) -> None:
        """Publishes reserved slots whose bytes are fully written, with their checksums."""
        ...

    def abort(self, reservation: Reservation) -> None:
        """Frees reserved slots without publishing them."""
        ...

    def pin(self, keys: Sequence[bytes]) -> Pinned:
        """Pins the slots of the present keys; returns them with their recorded checksums."""
        ...

    def unpin(self, pinned: Pinned) -> None: ...

    def drop_corrupt(self, keys: Sequence[bytes]) -> None:
        """Drops blocks a reader found corrupt (a pinned one's slot is reused after unpin)."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def hash_slots(self, slots: np.ndarray | Sequence[int], *, inline: bool = False) -> np.ndarray:
        """Each slot's block checksum, computed from its bytes in memory."""
        ...

    def slot_memory(self, slot: int) -> memoryview:
        """The writable bytes of one slot (``layout.slot_bytes``, page-aligned); release the
        view when done."""
        ...

    def slot_addresses(self, slots: np.ndarray) -> contextlib.AbstractContextManager[np.ndarray]:
        """The addresses (uint64) of ``slots``, valid inside the ``with``, for native I/O."""
        ...


# The types found to be SlotPools: an isinstance check against a Protocol inspects each member
# (tens of microseconds), and a put or get checks its pool each call.
_SLOT_POOL_TYPES: set[type] = set()


def is_slot_pool(pool: object) -> bool:
    """Whether ``pool`` has the whole :class:`SlotPool` interface (answered once per type)."""
    kind = type(pool)
    if kind in _SLOT_POOL_TYPES:
        return True
    if isinstance(pool, SlotPool):
        _SLOT_POOL_TYPES.add(kind)
        return True
    return False


@runtime_checkable
class LowerTier(Protocol):
    layout: PoolLayout
    stats: TierStats

    @property
    def capacity(self) -> int:
        """Blocks the tier can hold."""
        ...

    @property
    def used(self) -> int:
        """Blocks the tier holds."""
        ...

    def put(self, keys: Sequence[bytes], source: SlotPool) -> int:
        """Stores the DRAM blocks under ``keys``; returns how many were written (keys already
        stored are skipped; keys absent from ``source`` raise ``BlocksMissingError``)."""
        ...

    def get(self, keys: Sequence[bytes], target: SlotPool) -> None:
        """Loads the blocks under ``keys`` into ``target`` (see the module docstring)."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def keys(self) -> list[bytes]: ...

    def close(self) -> None: ...


@runtime_checkable
class ScatteringTier(Protocol):
    """A lower tier that can land blocks straight in the caller's memory, checking each where
    it lands (a store node, the cluster's peers, the disk tier): the KV store then loads a hit
    into the engine's CPU tensors with no DRAM staging copy (:mod:`tpusync._src.kv._direct`)."""

    def get_scattered(self, keys: Sequence[bytes], scatter: Scatter) -> list[bool]:
        """Receives the blocks under ``keys`` (distinct) into the places ``scatter`` gives
        them; returns which arrived verified (the places of the others may hold anything)."""
        ...


def tier_read_only(tier: Any) -> bool:
    """Whether ``tier`` is only read (its ``read_only``; False for a tier that does not say)."""
    return bool(getattr(tier, "read_only", False))


def tier_free(tier: Any) -> int:
    """Blocks ``tier`` can still take now: its ``free``, else ``capacity - used``."""
    if tier.capacity >= sys.maxsize:
        return sys.maxsize
    free = getattr(tier, "free", None)
    return int(free) if free is not None else tier.capacity - tier.used


def tier_usable_capacity(tier: Any) -> int:
    """The slots ``tier`` can reach now: its ``usable_capacity``, else its ``capacity``."""
    usable = getattr(tier, "usable_capacity", None)
    return tier.capacity if usable is None else int(usable)


class LoadStatus(enum.IntEnum):
    """A block's fate in a load, before its checksum is checked."""

    OK = 0  # read whole; its checksum is still to be verified
    ABSENT = 1  # not stored
    CORRUPT = 2  # stored but not valid (a bad header or MAC, a wrong size): removed
    FOREIGN = 3  # of another format version: left alone, a miss
    ERROR = 4  # could not be read (I/O error): removed where the medium says so


@dataclass(frozen=True)
class Load:
    """What a medium's ``_load`` found for one reserved block: its status, the checksum it
    recorded for it (verified by :class:`BlockTier` over the bytes read), a reason for logs,
    and whatever the medium needs later to remove it (``token``: e.g. the file's inode)."""

    status: LoadStatus
    checksum: int = 0
    reason: str = ""
    token: Any = None
    error: OSError | None = None


class BlockTier(ABC):
    """The block transaction, once: ``put`` pins DRAM slots, checks them, and hands them to the
    medium; ``get`` reserves DRAM slots, has the medium read into them, verifies every block's
    checksum over the bytes read, commits the good ones, aborts the others, and raises
    :class:`~tpusync.errors.BlocksMissingError` (with a ``loaded`` mask) for the misses.

    Subclasses set ``layout`` and ``stats`` and implement the medium's hooks. ``_what`` names
    the tier in messages (e.g. ``"disk pool /mnt/nvme/kv"``)."""

    layout: PoolLayout
    stats: TierStats
    read_only: bool = False
    #: verify the DRAM blocks' checksums before storing them (a medium that others read
    #: without our index: a bad block there would be served to every reader)
    verify_source: bool = False

    @property
    def _what(self) -> str:
        return type(self).__name__

    # --- what a medium implements ----------------------------------------------------------

    @abstractmethod
    def _check_open(self) -> None:
        """Raises unless the tier is open in this process."""

    @abstractmethod
    def _new_keys(self, keys: list[bytes], overwrite: bool) -> list[bytes]:
        """Which of the (unique) ``keys`` still need storing."""

    @abstractmethod
    def _store(
        self, keys: list[bytes], source: SlotPool, slots: np.ndarray, checksums: np.ndarray
    ) -> tuple[int, BaseException | None]:
        """Stores the pinned ``source`` slots under ``keys``; returns how many were written and
        the error that stopped the rest (None when all went)."""

    @abstractmethod
    def _reading(self, keys: list[bytes]) -> contextlib.AbstractContextManager[list[bytes]]:
        """A context in which the (unique) ``keys`` worth reading (those possibly stored) stay
        readable: their list, in order."""

    @abstractmethod
    def _load(self, reservation: Reservation, target: SlotPool) -> list[Load]:
        """Reads the reserved blocks into their ``target`` slots: one :class:`Load` each."""

    @abstractmethod
    def _discard(self, failed: list[tuple[bytes, Load]]) -> None:
        """Removes blocks that failed (corrupt, or unreadable), where the medium should."""

    # --- the transaction -------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], source: SlotPool) -> int:
        """Stores the DRAM blocks under ``keys`` from ``source``; returns how many were written.

        Keys already stored and repeated keys are skipped. Raises, before anything is
        written, :class:`~tpusync.errors.BlocksMissingError` when ``source`` lacks some keys
        (its ``loaded`` mask is False exactly for those). The source slots are pinned while
        they are read and unpinned before returning."""
        return self._put(keys, source, overwrite=False)

    def _put(self, keys: Sequence[bytes], source: SlotPool, *, overwrite: bool) -> int:
        keys = check_keys(keys)
        self._check_open()
        self._check_peer(source, "source")
        candidates = self._new_keys(list(dict.fromkeys(keys)), overwrite)
        if not candidates:
            return 0
        pinned = source.pin(candidates)
        corrupt: list[bytes] = []
        try:
            self._check_present(keys, candidates, pinned)
            if self.verify_source:
                corrupt = self._check_source(keys, candidates, source, pinned)
            written, error = self._store(candidates, source, pinned.slots, pinned.checksums)
        finally:
            source.unpin(pinned)
            if corrupt:
                source.drop_corrupt(corrupt)
        self.stats.add(puts=written, bytes_in=written * self.layout.payload_bytes)
        if error is not None:
            raise error
        return written

    @staticmethod
    def _check_present(keys: list[bytes], candidates: list[bytes], pinned: Pinned) -> None:
        if pinned.present.all():
            return
        absent = {k for k, p in zip(candidates, pinned.present.tolist(), strict=True) if not p}
        raise BlocksMissingError(
            f"keys: {len(absent)} of {len(candidates)} blocks to store are not in the source "
            f"pool (e.g. {next(iter(absent)).hex()}); nothing was written",
            loaded=[k not in absent for k in keys],
        )

    @staticmethod
    def _check_source(
        keys: list[bytes], candidates: list[bytes], source: SlotPool, pinned: Pinned
    ) -> list[bytes]:
        """Raises (listing the DRAM blocks that failed their checksum, to be dropped) unless
        every pinned block's bytes match its recorded checksum."""
        bad = source.hash_slots(pinned.slots) != pinned.checksums
        if not bad.any():
            return []
        corrupt = [k for k, b in zip(candidates, bad.tolist(), strict=True) if b]
        dropped = set(corrupt)
        try:
            raise BlocksMissingError(
                f"keys: {len(corrupt)} blocks in source failed their checksum (e.g. "
                f"{corrupt[0].hex()}) and were dropped from it; nothing was written",
                loaded=[k not in dropped for k in keys],
                corrupt=len(corrupt),
            )
        finally:
            source.drop_corrupt(corrupt)

    def get(self, keys: Sequence[bytes], target: SlotPool) -> None:
        """Loads the blocks under ``keys`` into ``target``, straight into its slots.

        Each block is read into a slot reserved in ``target``, its checksum computed over the
        bytes read and compared with the recorded one; the good blocks are committed in
        ``target``, the others aborted. Keys ``target`` already holds count as loaded (nothing
        is read for them). Raises :class:`~tpusync.errors.TierFullError` (reading nothing) when
        ``target`` has too few free slots, and :class:`~tpusync.errors.BlocksMissingError`
        (with a ``loaded`` mask and ``corrupt`` count) when any key is absent, fails
        verification (counted, and removed) or cannot be read."""
        keys = check_keys(keys)
        self._check_open()
        self._check_peer(target, "target")
        loads: dict[bytes, Load] = {}
        served: set[bytes] = set()
        with self._reading(list(dict.fromkeys(keys))) as present:
            reservation = target.reserve(present) if present else None
            if reservation is not None:
                served = self._load_verified(reservation, target, loads)
        failed = [(k, x) for k, x in loads.items() if x.status in (LoadStatus.CORRUPT, _ERROR)]
        if failed:
            self._discard(failed)
        reserved = set(loads)
        others = [k for k in dict.fromkeys(keys) if k not in reserved]
        held = dict(zip(others, target.contains(others), strict=True)) if others else {}
        mask = [k in served if k in reserved else held[k] for k in keys]
        self._report(keys, mask, loads, len(served))

    def _load_verified(
        self, reservation: Reservation, target: SlotPool, loads: dict[bytes, Load]
    ) -> set[bytes]:
        """Loads, verifies and commits (or aborts) every reserved slot; fills ``loads``."""
        try:
            results = self._load(reservation, target)
            ok = np.array([r.status == LoadStatus.OK for r in results], dtype=bool)
            expected = np.array([r.checksum for r in results], dtype=np.uint64)
            good = ok.copy()
            if ok.any():
                good[ok] = target.hash_slots(reservation.slots[ok]) == expected[ok]
        except BaseException:
            target.abort(reservation)
            raise
        for i in np.flatnonzero(ok & ~good).tolist():
            results[i] = Load(LoadStatus.CORRUPT, reason="payload checksum mismatch",
                              token=results[i].token)  # fmt: skip
        verdict = reservation.subset(good)
        pending: Reservation | None = verdict  # neither committed nor aborted yet
        try:
            if (~good).any():
                target.abort(reservation.subset(~good))
            if good.any():
                target.commit(verdict, expected[good])
            pending = None
        finally:
            if pending is not None and len(pending.slots):  # nothing was published
                target.abort(pending)
        loads.update(zip(reservation.keys, results, strict=True))
        return {k for k, g in zip(reservation.keys, good.tolist(), strict=True) if g}

    def _report(
        self, keys: list[bytes], mask: list[bool], loads: dict[bytes, Load], served: int
    ) -> None:
        counts = {s: 0 for s in LoadStatus}
        for load in loads.values():
            counts[load.status] += 1
        absent = sum(
            1
            for k, hit in zip(keys, mask, strict=True)
            if not hit and (k not in loads or loads[k].status == LoadStatus.ABSENT)
        )
        corrupt = counts[LoadStatus.CORRUPT]
        hits = sum(mask)
        unique = dict(zip(keys, mask, strict=True))
        self.stats.add(  # a hit: a block this tier served (not one the target already held)
            hits=served,
            misses=sum(not hit for hit in unique.values()),
            checksum_failures=corrupt,
            bytes_out=served * self.layout.payload_bytes,
        )
        if hits == len(keys):
            return
        error = BlocksMissingError(
            f"keys: {len(keys) - hits} of {len(keys)} blocks not served ({absent} absent, "
            f"{corrupt} failed their checksum, {counts[LoadStatus.FOREIGN]} of another format, "
            f"{counts[_ERROR]} unreadable)",
            loaded=mask,
            corrupt=corrupt,
        )
        cause = next((x.error for x in loads.values() if x.error is not None), None)
        if cause is not None:
            raise error from cause
        raise error

    def _check_peer(self, pool: Any, name: str) -> None:
        if not is_slot_pool(pool):  # e.g. a HostPool
            raise InvalidArgumentError(f"{name}: expected a HostPool, got {type(pool).__name__}")
        if pool.layout.fingerprint != self.layout.fingerprint:
            raise InvalidArgumentError(
                f"{name}: the HostPool holds another block layout (model "
                f"{pool.layout.model_id!r}, {pool.layout.payload_bytes} B blocks) than this "
                f"{self._what} (model {self.layout.model_id!r}, {self.layout.payload_bytes} B "
                "blocks)"
            )


_ERROR = LoadStatus.ERROR


@contextlib.contextmanager
def readable(keys: list[bytes]) -> Iterator[list[bytes]]:
    """A ``_reading`` for a medium without an index to hold: every key is worth a read."""
    yield keys
