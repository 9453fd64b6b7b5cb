"""The KV store's tier policy: LRU order per tier, pins, demotion, promotion and write-back.

Tiers are ordered top down: DRAM (a :class:`~tpusync.tiers.HostPool`) first, then the lower
tiers (disk, shared filesystem). Blocks move only through DRAM: lower tiers read from and write
into DRAM slots.

* **LRU per tier.** Each tier keeps its keys oldest first; a hit or a store moves a key to the
  end.
* **Room.** A tier that needs ``n`` free slots evicts its oldest blocks that are neither pinned
  (a lookup handle, a prefetch or a restore holds them) nor kept by a session at the bottom.
  DRAM demotes a victim to the next tier first unless that tier already holds it; a lower tier
  drops its victims (every save is written through to all lower tiers in the background, so the
  tiers below usually hold it already). A session's block is never dropped: in DRAM it may be
  demoted, in the lowest tier that holds it it stays.
* **Promotion.** A block found only in a lower tier is read back into DRAM and stays there.
* **Write-back.** Blocks saved to DRAM are queued for the lower tiers; the queue holds at most
  ``writeback_max_bytes`` of blocks not yet written (then a save waits, or the blocks are left to
  be demoted on eviction: the ``"wait"`` and ``"skip"`` policies). Write-back copies from DRAM,
  so DRAM evicting a block still queued (or being written) writes it to every writable lower
  tier itself, not only to the next one; a block write-back finds gone from DRAM and missing
  from a tier while another tier holds it counts as ``writeback_lost``.

Locks, always taken in this order: a tier's *room lock* (lower index first; held while making
room and filling the room, so no one else takes the freed slots), then ``lock`` (metadata: LRU,
pins, kept keys; held briefly, never while waiting on I/O of another tier's room).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from tpusync.errors import BlocksMissingError, InvalidArgumentError, TierFullError, TpuSyncError
from tpusync.tiers.base import LowerTier
from tpusync.tiers.host_pool import HostPool

log = logging.getLogger("tpusync.kv")

POLICY_COUNTERS = (
    "evictions",
    "demotions",
    "promotions",
    "lower_tier_misses",
    "lower_tier_errors",
    "writeback_written",  # blocks written to lower tiers for write-back (on demotion too)
    "writeback_on_demote",  # of those, written by DRAM evicting blocks still queued
    "writeback_skipped",
    "writeback_waits",
    "writeback_failed",
    "writeback_lost",  # blocks DRAM dropped before write-back wrote them to a tier
)
_WRITEBACK_WAIT_S = 30.0  # how long making room waits for write-back to free busy slots


class TierStack:
    """DRAM plus lower tiers, with the store's policy state. Thread-safe."""

    def __init__(
        self,
        dram: HostPool,
        lower: Sequence[tuple[str, LowerTier]],
        *,
        writeback_max_bytes: int,
        writeback_policy: str,
    ) -> None:
        self.dram = dram
        self.names = ["dram", *(name for name, _ in lower)]
        self.tiers: list[HostPool | LowerTier] = [dram, *(tier for _, tier in lower)]
        self.block_bytes = dram.layout.payload_bytes
        self.lock = threading.RLock()
        self._room_locks = [threading.Lock() for _ in self.tiers]
        # Read-only tiers (e.g. another host's DRAM through a RemotePool) are searched and
        # promoted from, never written, demoted to or evicted from.
        self.read_only = [bool(getattr(t, "read_only", False)) for t in self.tiers]
        self.read_only[0] = False
        writable = [t for t in range(1, len(self.tiers)) if not self.read_only[t]]
        self._below: int | None = writable[0] if writable else None  # where DRAM demotes to
        self._writable_lower = writable
        self._lru = [
            collections.OrderedDict.fromkeys([] if ro else t.keys())
            for t, ro in zip(self.tiers, self.read_only, strict=True)
        ]
        self._pins: collections.Counter[bytes] = collections.Counter()
        self._kept: collections.Counter[bytes] = collections.Counter()
        self._doomed: set[bytes] = set()  # purged while pinned: dropped at the last unpin
        # Told of keys DRAM gained and lost (the store's registry link); called without locks.
        self.on_dram_added: Callable[[list[bytes]], None] | None = None
        self.on_dram_removed: Callable[[list[bytes]], None] | None = None
        # Told of keys a writable lower tier dropped (tier index, keys); called without locks.
        self.on_lower_removed: Callable[[int, list[bytes]], None] | None = None
        self.counters: collections.Counter[str] = collections.Counter(
            dict.fromkeys(POLICY_COUNTERS, 0)
        )
        self._counters_lock = threading.Lock()
        # write-back queue
        self._wb_policy = writeback_policy
        self._wb_max = writeback_max_bytes
        self._wb_cond = threading.Condition(threading.Lock())
        self._wb_queue: collections.deque[list[bytes]] = collections.deque()
        self._wb_bytes = 0  # queued or being written
        self._wb_busy = 0
        self._wb_active: set[bytes] = set()  # keys whose DRAM slots write-back reads now
        self._wb_queued: dict[bytes, int] = {}  # keys in _wb_queue: how many times each
        self._wb_stop = False
        self._wb_thread: threading.Thread | None = None
        if writable:
            self._wb_thread = threading.Thread(
                target=self._writeback_loop, name="tpusync-kv-writeback", daemon=True
            )
            self._wb_thread.start()

    # --- metadata --------------------------------------------------------------------------

    def bump(self, name: str, value: int = 1) -> None:
        """Adds to a policy counter (a Counter's += is not atomic across threads)."""
        with self._counters_lock:
            self.counters[name] += value

    def counters_snapshot(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self.counters)

    def touch(self, tier: int, keys: Sequence[bytes]) -> None:
        with self.lock:
            lru = self._lru[tier]
            move = lru.move_to_end
            for key in keys:
                try:
                    move(key)
                except KeyError:  # new here: enters at the hot end
                    lru[key] = None

    def forget(self, tier: int, keys: Sequence[bytes]) -> None:
        with self.lock:
            for key in keys:
                self._lru[tier].pop(key, None)

    def pin(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        pins, doomed = self._pins, []
        with self.lock:
            for key in keys:
                count = pins.get(key, 0) - 1
                if count > 0:
                    pins[key] = count
                # dict.pop: Counter's del is slow
                elif pins.pop(key, None) is not None and key in self._doomed:
                    self._doomed.discard(key)
                    doomed.append(key)
        if doomed:
            self.delete_everywhere(doomed)

    def keep(self, keys: Sequence[bytes]) -> None:
        """Marks keys as a session's: never dropped (see the module docstring)."""
        with self.lock:
            self._kept.update(keys)

    def unkeep(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            self._kept.subtract(keys)
            for key in set(keys):
                if self._kept[key] <= 0:
                    del self._kept[key]

    def dram_added(self, keys: Sequence[bytes]) -> None:
        if keys and self.on_dram_added is not None:
            self.on_dram_added(list(keys))

    def dram_removed(self, keys: Sequence[bytes]) -> None:
        if keys and self.on_dram_removed is not None:
            self.on_dram_removed(list(keys))

    def removed(self, tier: int, keys: Sequence[bytes]) -> None:
        """Tells the hooks that ``tier`` dropped ``keys``."""
        if tier == 0:
            self.dram_removed(keys)
        elif keys and self.on_lower_removed is not None:
            self.on_lower_removed(tier, list(keys))

    def pinned(self, key: bytes) -> bool:
        return self._pins.get(key, 0) > 0

    def locate(self, keys: Sequence[bytes], *, prefix: bool, local: bool = False) -> list[int]:
        """The first tier holding each key (-1: none). With ``prefix``, stops at the first key
        held nowhere (the list is then that long); with ``local``, read-only tiers (other
        nodes') are not asked. A lower tier that cannot answer (a peer that is gone) holds
        nothing. Call with ``lock`` held to pin the result."""
        where = [-1] * len(keys)
        todo = list(range(len(keys)))
        for t in range(len(self.tiers)):
            if not todo:
                break
            if local and self.read_only[t]:
                continue
            found = self._contains(t, [keys[i] for i in todo])
            rest = []
            for i, hit in zip(todo, found, strict=True):
                if hit:
                    where[i] = t
                else:
                    rest.append(i)
            todo = rest
        if prefix:
            n = next((i for i, t in enumerate(where) if t < 0), len(where))
            return where[:n]
        return where

    def _contains(self, tier: int, keys: list[bytes]) -> list[bool]:
        if tier == 0:
            return self.dram.contains(keys)
        try:
            return self.tiers[tier].contains(keys)
        except (TpuSyncError, OSError) as error:
            self.bump("lower_tier_errors", 1)
            log.warning("tpusync kv: tier %s cannot answer: %s", self.names[tier], error)
            return [False] * len(keys)

    # --- room ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def room(self, tier: int, blocks: int) -> Iterator[None]:
        """Holds ``tier``'s room lock with at least ``blocks`` free slots (evicting for them)
        until the block ends; the caller fills the room inside."""
        with self._room_locks[tier]:
            self._make_room(tier, blocks)
            yield

    def _free(self, tier: int) -> int:
        store = self.tiers[tier]
        if tier == 0:
            return self.dram.free
        if store.capacity >= sys.maxsize:
            return sys.maxsize
        free = getattr(store, "free", None)
        return int(free) if free is not None else store.capacity - store.used

    def _make_room(self, tier: int, blocks: int) -> None:
        """Evicts until ``blocks`` slots are free. Call with the tier's room lock held."""
        store = self.tiers[tier]
        if blocks > store.capacity:
            raise TierFullError(
                f"{self.names[tier]} tier: {blocks} blocks do not fit in its "
                f"{store.capacity} slots; raise its capacity_blocks"
            )
        bottom = tier > 0 or self._below is None  # nowhere to demote to: victims are dropped
        deadline = time.monotonic() + _WRITEBACK_WAIT_S
        while (need := blocks - self._free(tier)) > 0:
            with self._wb_cond:
                busy = set(self._wb_active) if tier == 0 else set()
            with self.lock:
                victims, waiting = [], False
                for key in self._lru[tier]:
                    if self._pins.get(key, 0) > 0:
                        continue
                    if self._kept.get(key, 0) > 0 and (bottom or tier > 0):
                        continue  # a session's block is only ever demoted out of DRAM
                    if key in busy:  # being written down: its slot is read right now
                        waiting = True
                        continue
                    victims.append(key)
                    if len(victims) == need:
                        break
                stale = absent(store, victims)  # dropped behind our back (e.g. found corrupt)
                for key in stale:
                    self._lru[tier].pop(key, None)
            if stale:
                continue
            if len(victims) < need:
                # Never evict for a request that cannot be met: wait for write-back to finish
                # with the slots it reads, or fail with everything still cached.
                if waiting and time.monotonic() < deadline:
                    self._wait_writeback_progress()
                    continue
                break
            if not bottom:
                self._demote(victims)
            with self.lock:
                # a lookup may have pinned a victim meanwhile: it stays
                victims = [k for k in victims if self._pins.get(k, 0) <= 0]
                if not bottom:
                    below = set(present(self.tiers[self._below], victims))
                    victims = [k for k in victims if k in below or not self._kept.get(k)]
                dropped = store.delete(victims)
                gone = absent(store, victims)
                for key in gone:
                    self._lru[tier].pop(key, None)
            self.removed(tier, gone)
            self.bump("evictions", dropped)
            store.stats.add(evictions=dropped)
            if not gone:
                if time.monotonic() >= deadline:
                    break
                self._wait_writeback_progress()
        if self._free(tier) < blocks:
            raise TierFullError(
                f"{self.names[tier]} tier: {blocks} free blocks needed, {self._free(tier)} free "
                f"of {store.capacity}; the rest are pinned by lookups or held by sessions — "
                "release handles, drop sessions or raise capacity_blocks"
            )

    def evict(self, tier: int, keys: Sequence[bytes]) -> int:
        """Moves ``keys`` out of ``tier`` now: DRAM demotes to the next tier first (if any);
        pinned blocks, and session blocks that would be dropped, stay. Returns blocks removed."""
        store = self.tiers[tier]
        if self.read_only[tier]:
            raise InvalidArgumentError(f"tier: {self.names[tier]!r} is read-only here")
        bottom = tier > 0 or self._below is None
        with self._room_locks[tier]:
            with self.lock:
                victims = [k for k in present(store, keys) if self._pins.get(k, 0) <= 0]
            if not bottom:
                self._demote(victims)
                below = set(present(self.tiers[self._below], victims))
            else:
                below = set()
            with self.lock:
                victims = [
                    k
                    for k in victims
                    if self._pins.get(k, 0) <= 0 and (k in below or not self._kept.get(k))
                ]
                dropped = store.delete(victims)
                gone = absent(store, victims)
                for key in gone:
                    self._lru[tier].pop(key, None)
        self.removed(tier, gone)
        self.bump("evictions", dropped)
        store.stats.add(evictions=dropped)
        return dropped

    def _demote(self, keys: list[bytes]) -> None:
        """Writes DRAM blocks that the next tier lacks into it (before DRAM drops them), and
        the ones write-back has not finished with into the other lower tiers too."""
        assert self._below is not None
        missing = absent(self.tiers[self._below], keys)
        if missing:
            self.bump("demotions", self._put_down(self._below, missing))
        self._write_back_now(keys)

    def _write_back_now(self, keys: list[bytes]) -> None:
        """Writes the keys still queued for write-back (or being written) into the writable
        lower tiers below the next one: write-back reads DRAM, which is about to drop them.
        Call with DRAM's room lock held (lower tiers' room locks come after it). A failing
        tier is counted and logged, never raised: the eviction goes on."""
        with self._wb_cond:
            pending = [k for k in keys if k in self._wb_queued or k in self._wb_active]
        if not pending:
            return
        for tier in self._writable_lower:
            if tier == self._below:  # _demote wrote it
                continue
            try:
                missing = absent(self.tiers[tier], pending)
                written = self._put_down(tier, missing) if missing else 0
            except (TpuSyncError, OSError) as error:
                self.bump("writeback_failed", len(pending))
                log.warning(
                    "tpusync kv: write-back of %d evicted blocks to tier %s failed: %s",
                    len(pending),
                    self.names[tier],
                    error,
                )
                continue
            self.bump("writeback_written", written)
            self.bump("writeback_on_demote", written)

    def _put_down(self, tier: int, keys: list[bytes]) -> int:
        """Copies DRAM blocks into lower ``tier`` (making room there); returns blocks written.
        Blocks DRAM lost meanwhile are skipped."""
        store = self.tiers[tier]
        keys = present(self.dram, keys)
        if not keys:
            return 0
        with self._room_locks[tier]:
            self._make_room(tier, len(keys))
            try:
                written = store.put(keys, self.dram)
            except BlocksMissingError as missing:  # evicted or found corrupt in DRAM meanwhile
                keys = [k for k, ok in zip(keys, missing.loaded, strict=True) if ok]
                written = store.put(keys, self.dram) if keys else 0
        self.touch(tier, keys)
        return written

    # --- promotion -------------------------------------------------------------------------

    def promote(self, keys: Sequence[bytes], *, local: bool = False) -> tuple[list[bool], int]:
        """Reads the keys DRAM lacks from the first lower tier holding them into DRAM; returns
        which keys DRAM holds afterwards. Blocks failing their checksum are misses (the lower
        tier counts and drops them), and how many blocks moved up. Pin the keys first, so that
        making room cannot evict them. With ``local``, other nodes' (read-only) tiers are not
        read."""
        in_dram = self.dram._contains_checked(list(keys))  # the store's own keys
        if all(in_dram):
            return in_dram, 0
        where = self.locate(keys, prefix=False, local=local)
        promoted = 0
        wanted = [i for i, t in enumerate(where) if t > 0]
        if wanted:
            with self.room(0, len(wanted)):
                for t in range(1, len(self.tiers)):
                    subset = [keys[i] for i in wanted if where[i] == t]
                    if not subset:
                        continue
                    try:
                        self.tiers[t].get(subset, self.dram)
                        loaded = subset
                    except BlocksMissingError as missing:
                        loaded = [k for k, ok in zip(subset, missing.loaded, strict=True) if ok]
                        self.bump("lower_tier_misses", len(subset) - len(loaded))
                    except (TpuSyncError, OSError) as error:  # e.g. a peer that is gone
                        log.warning("tpusync kv: tier %s failed: %s", self.names[t], error)
                        held = self.dram.contains(subset)  # whatever it committed first
                        loaded = [k for k, ok in zip(subset, held, strict=True) if ok]
                        self.bump("lower_tier_errors", 1)
                        self.bump("lower_tier_misses", len(subset) - len(loaded))
                    if not self.read_only[t]:
                        self.touch(t, loaded)
                    self.touch(0, loaded)
                    self.dram_added(loaded)
                    self.bump("promotions", len(loaded))
                    promoted += len(loaded)
        return self.dram.contains(keys), promoted

    # --- write-back ------------------------------------------------------------------------

    def writeback_admit(self, blocks: int) -> bool:
        """Takes queue room for ``blocks`` under the policy: waits for it (``"wait"``) or
        answers False (``"skip"``). False with no lower tier to write to."""
        if self._wb_thread is None or not blocks:
            return False
        nbytes = blocks * self.block_bytes
        with self._wb_cond:
            if self._wb_policy == "skip":
                if self._wb_bytes and self._wb_bytes + nbytes > self._wb_max:
                    self.bump("writeback_skipped", blocks)
                    return False
            else:
                while self._wb_bytes and self._wb_bytes + nbytes > self._wb_max:
                    self.bump("writeback_waits", 1)
                    self._wb_cond.wait()
            self._wb_bytes += nbytes
            return True

    def writeback_enqueue(self, keys: list[bytes], admitted_blocks: int) -> None:
        """Queues keys for the lower tiers (room taken by :meth:`writeback_admit`)."""
        with self._wb_cond:
            self._wb_bytes -= (admitted_blocks - len(keys)) * self.block_bytes
            if keys:
                self._wb_queue.append(keys)
                for key in keys:
                    self._wb_queued[key] = self._wb_queued.get(key, 0) + 1
            self._wb_cond.notify_all()

    def _writeback_loop(self) -> None:
        while True:
            with self._wb_cond:
                while not self._wb_queue and not self._wb_stop:
                    self._wb_cond.wait()
                if not self._wb_queue:
                    return
                keys = self._wb_queue.popleft()
                self._unqueue(keys)
                self._wb_busy += 1
                self._wb_active.update(keys)
            try:
                for tier in self._writable_lower:
                    missing = absent(self.tiers[tier], keys)
                    if missing:
                        self.bump("writeback_written", self._put_down(tier, missing))
                        self._count_lost(tier, missing)
            except TpuSyncError as error:  # a full or failing tier: the blocks stay in DRAM
                self.bump("writeback_failed", len(keys))
                log.warning("tpusync kv: write-back of %d blocks failed: %s", len(keys), error)
            except Exception:  # never let the thread die silently; the blocks stay in DRAM
                self.bump("writeback_failed", len(keys))
                log.exception("tpusync kv: write-back failed")
            finally:
                with self._wb_cond:
                    self._wb_active.difference_update(keys)
                    self._wb_busy -= 1
                    self._wb_bytes -= len(keys) * self.block_bytes
                    self._wb_cond.notify_all()

    def _unqueue(self, keys: list[bytes]) -> None:
        """Forgets one queued occurrence of each key. Call with ``_wb_cond`` held."""
        queued = self._wb_queued
        for key in keys:
            count = queued.get(key, 0) - 1
            if count > 0:
                queued[key] = count
            else:
                queued.pop(key, None)

    def _count_lost(self, tier: int, keys: list[bytes]) -> None:
        """Counts the keys write-back could not put into ``tier`` because DRAM dropped them
        first while another local tier still holds them (the write-back was lost, not the
        block; a block deleted everywhere was purged, not lost)."""
        skipped = absent(self.dram, keys)
        if not skipped:  # the usual case: nothing was skipped
            return
        skipped = [
            k for k, hit in zip(skipped, self._contains(tier, skipped), strict=True) if not hit
        ]
        held: set[bytes] = set()
        for other in self._writable_lower:
            if skipped and other != tier:
                found = self._contains(other, skipped)
                held.update(k for k, hit in zip(skipped, found, strict=True) if hit)
        if held:
            self.bump("writeback_lost", len(held))
            log.warning(
                "tpusync kv: write-back lost %d blocks for tier %s: DRAM dropped them first",
                len(held),
                self.names[tier],
            )

    def _wait_writeback_progress(self) -> None:
        with self._wb_cond:
            if self._wb_busy:
                self._wb_cond.wait(timeout=0.5)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until the write-back queue is empty; False on timeout."""
        with self._wb_cond:
            return self._wb_cond.wait_for(
                lambda: not self._wb_queue and not self._wb_busy, timeout=timeout
            )

    def writeback_pending_bytes(self) -> int:
        with self._wb_cond:
            return self._wb_bytes

    # --- deletion, shutdown ----------------------------------------------------------------

    def delete_everywhere(self, keys: Sequence[bytes]) -> int:
        """Drops unpinned keys from every tier (pinned ones are dropped at their last unpin);
        returns the blocks dropped."""
        dropped = 0
        with self.lock:
            pinned = [k for k in keys if self._pins.get(k, 0) > 0]
            self._doomed.update(pinned)
            free = [k for k in keys if self._pins.get(k, 0) <= 0]
            gone: dict[int, list[bytes]] = {}
            for t, tier in enumerate(self.tiers):
                if free and not self.read_only[t]:
                    dropped += tier.delete(free)
                    lost = absent(tier, free)
                    self.forget(t, lost)
                    gone[t] = lost
        for t, lost in gone.items():
            self.removed(t, lost)
        return dropped

    def close(self) -> None:
        with self._wb_cond:
            self._wb_stop = True
            self._wb_cond.notify_all()
        if self._wb_thread is not None:
            self._wb_thread.join()
        with self._wb_cond:
            self._wb_queued.clear()  # the thread drained the queue; nothing waits any more


def present(tier: HostPool | LowerTier, keys: Sequence[bytes]) -> list[bytes]:
    """The keys ``tier`` holds, in order."""
    return [k for k, hit in zip(keys, tier.contains(keys), strict=True) if hit]


def absent(tier: HostPool | LowerTier, keys: Sequence[bytes]) -> list[bytes]:
    """The keys ``tier`` lacks, in order."""
    return [k for k, hit in zip(keys, tier.contains(keys), strict=True) if not hit]
