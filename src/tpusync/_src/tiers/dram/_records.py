"""The records index of a host pool (a base :class:`~tpusync.tiers.HostPool` builds on): one
record per slot in the mapped file, the in-memory index of committed keys, free slots, pins, and
the slot interface other tiers use (reserve, commit, abort, pin, unpin, drop, delete). Every
state change writes the slot's record first, so a crash leaves torn slots, never wrong blocks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tpusync._native import core as _core
from tpusync._src.tiers._keys import check_keys
from tpusync._src.tiers.dram.pool_file import COMMITTED, FREE, WRITING, scan_records
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.slots import Pinned, Reservation
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import InvalidArgumentError, PoolClosedError, TierFullError

__all__ = ["SlotRecords"]

log = logging.getLogger("tpusync.tiers")


class SlotRecords:
    """The records side of :class:`~tpusync.tiers.HostPool`: its index and slot interface.
    The pool sets the attributes below when it opens."""

    layout: PoolLayout
    capacity: int
    path: Path | None
    stats: TierStats
    _lock: threading.Lock
    _base: np.ndarray | None
    _records: np.ndarray
    _index: dict[bytes, int]
    _pins: np.ndarray
    _writing: set[bytes]
    _retired: set[int]
    _free: list[int]
    _sequence: int

    def _scan_records(self) -> list[int]:
        """Builds the index from the records: O(slots), no data is read. Torn and damaged
        records are freed (their blocks are lost, never served)."""
        records = self._records
        scan = scan_records(records, self.layout.payload_bytes)
        for slots, why in ((scan.torn, "torn by a crash"), (scan.damaged, "with damaged records")):
            if len(slots):
                records["state"][slots] = FREE
                self.stats.add(torn_discarded=len(slots))
                log.info("tpusync: %s: dropped %d blocks %s", self.path, len(slots), why)
        self._index.update(scan.index)
        self._sequence = scan.sequence
        used = set(self._index.values())
        return [s for s in range(self.capacity - 1, -1, -1) if s not in used]

    def __bool__(self) -> bool:
        return True  # a pool is a pool, open or closed (``len()`` of a closed one raises)

    def __len__(self) -> int:
        self._open_base()  # a closed pool has no count to tell: PoolClosedError
        return len(self._index)

    @property
    def used(self) -> int:
        """Blocks stored (:class:`~tpusync.errors.PoolClosedError` once closed)."""
        self._open_base()
        return len(self._index)

    @property
    def free(self) -> int:
        """Slots free (:class:`~tpusync.errors.PoolClosedError` once closed)."""
        self._open_base()
        return len(self._free)

    def keys(self) -> list[bytes]:
        """Committed keys, oldest commit first."""
        with self._lock:
            self._open_base()
            return list(self._index)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.contains_checked(check_keys(keys))

    def contains_checked(self, keys: list[bytes]) -> list[bool]:
        """:meth:`contains` of keys already checked (the KV store's own)."""
        with self._lock:
            self._open_base()
            index = self._index
            return [k in index for k in keys]

    def slot_of(self, key: bytes) -> int | None:
        return self._index.get(bytes(key))

    # --- the slot interface other tiers use -------------------------------------------------

    def reserve(self, keys: Sequence[bytes]) -> Reservation:
        """Takes a free slot for every key not yet present (first occurrence of each), in the
        writing state: invisible until :meth:`commit`, freed by :meth:`abort` or by a crash.
        Raises :class:`~tpusync.errors.TierFullError` and takes nothing when too few are free."""
        return self._reserve_checked(check_keys(keys))

    def _reserve_checked(self, keys: list[bytes]) -> Reservation:
        with self._lock:
            self._open_base()
            unique = set(keys)
            if (
                len(unique) == len(keys)
                and unique.isdisjoint(self._index)
                and (unique.isdisjoint(self._writing))
            ):
                fresh = list(range(len(keys)))  # the usual put: all new (set speed, not a loop)
            else:
                fresh, seen = [], set()
                for i, key in enumerate(keys):
                    if key not in self._index and key not in seen and key not in self._writing:
                        fresh.append(i)
                        seen.add(key)
            if len(fresh) > len(self._free):
                raise TierFullError(
                    f"keys: {len(fresh)} new blocks but {len(self._free)} free slots of "
                    f"{self.capacity}; delete or evict blocks first"
                )
            taken = len(self._free) - len(fresh)
            slots = np.array(self._free[taken:][::-1], dtype=np.int64)
            del self._free[taken:]
            chosen = keys if len(fresh) == len(keys) else [keys[i] for i in fresh]
            self._begin_writes(slots, chosen)
            self._writing.update(chosen)
        return Reservation(chosen, np.array(fresh, dtype=np.int64), slots)

    def commit(self, reservation: Reservation, checksums: np.ndarray) -> None:
        """Publishes reserved slots whose bytes are fully written, with their checksums."""
        with self._lock:
            self._open_base()
            self._commit_records(reservation.slots, np.asarray(checksums, dtype=np.uint64))
            self._index.update(zip(reservation.keys, reservation.slots.tolist(), strict=True))
            self._writing.difference_update(reservation.keys)
        self.stats.add(
            bytes_in=len(reservation.slots) * self.layout.payload_bytes,
            puts=len(reservation.slots),
        )

    def abort(self, reservation: Reservation) -> None:
        """Frees reserved slots without publishing them."""
        with self._lock:
            self._open_base()
            self._records["state"][reservation.slots] = FREE
            self._free.extend(reservation.slots.tolist())
            self._writing.difference_update(reservation.keys)

    def pin(self, keys: Sequence[bytes]) -> Pinned:
        """Pins the slots of the present keys (a pinned slot is never deleted or reused) and
        returns them with their recorded checksums. Every pin is matched by one :meth:`unpin`."""
        return self._pin_checked(check_keys(keys))

    def _pin_checked(self, keys: list[bytes]) -> Pinned:
        with self._lock:
            records = self._open_records()
            # one native pass: numpy's masks and np.add.at cost more after a model step (0004)
            slots, checksums, all_present = _core.pin_slots(
                self._index, keys, self._pins, records["checksum"]
            )
        return Pinned(keys, slots, slots >= 0, checksums, all_present)

    def unpin(self, pinned: Pinned) -> None:
        with self._lock:
            _core.unpin_slots(self._pins, pinned.slots)
            if self._retired:
                for slot in set(pinned.slots[pinned.present].tolist()) & self._retired:
                    if not self._pins[slot]:  # a dropped block's last reader is done with it
                        self._retired.discard(slot)
                        self._free.append(slot)

    def drop_corrupt(self, keys: Sequence[bytes]) -> None:
        """Counts and drops blocks found corrupt by a reader, pinned or not: they leave the
        index at once; a pinned one's slot is reused only after its last reader unpins it."""
        keys = check_keys(keys)
        with self._lock:
            records = self._open_records()
            for key in keys:
                slot = self._index.pop(key, None)
                if slot is None:
                    continue
                records["state"][slot] = FREE
                if self._pins[slot]:
                    self._retired.add(slot)
                else:
                    self._free.append(slot)
        self.stats.add(checksum_failures=len(keys))

    def _begin_writes(self, slots: np.ndarray, keys: list[bytes]) -> None:
        records = self._records
        records["state"][slots] = WRITING  # first: a crash from here on leaves a torn slot
        records["key_len"][slots] = np.fromiter(map(len, keys), np.uint16, len(keys))
        records["key"][slots] = keys  # numpy pads each to the field's width with zero bytes

    def _commit_records(self, slots: np.ndarray, checksums: np.ndarray) -> None:
        if len(slots) != len(checksums):
            raise InvalidArgumentError(
                f"checksums: {len(checksums)} for {len(slots)} reserved slots; give one per slot"
            )
        records = self._records
        first = self._sequence + 1
        self._sequence += len(slots)
        records["checksum"][slots] = checksums
        records["length"][slots] = self.layout.payload_bytes
        records["sequence"][slots] = np.arange(first, first + len(slots), dtype=np.uint64)
        records["state"][slots] = COMMITTED  # last: the blocks become visible

    # --- delete --------------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drops the blocks under ``keys``; pinned (being read) and absent keys are skipped.
        Returns how many were dropped."""
        keys = check_keys(keys)
        dropped = 0
        with self._lock:
            records = self._open_records()
            for key in keys:
                slot = self._index.get(key)
                if slot is None or self._pins[slot]:
                    continue
                records["state"][slot] = FREE
                del self._index[key]
                self._free.append(slot)
                dropped += 1
        self.stats.add(deletes=dropped)
        return dropped

    @property
    def closed(self) -> bool:
        return self._base is None

    def _open_records(self) -> np.ndarray:
        self._open_base()
        return self._records

    def _open_base(self) -> np.ndarray:
        base = self._base
        if base is None:
            where = self.path if self.path is not None else "anonymous"
            raise PoolClosedError(f"this HostPool ({where}) is closed; open it again")
        return base
