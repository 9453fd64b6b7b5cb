"""The KV store's tier policy: LRU order per tier, pins, demotion, promotion and write-back.

Tiers are ordered top down: DRAM (a :class:`~tpusync.tiers.HostPool`) first, then the lower
tiers (disk, shared filesystem). Blocks move only through DRAM: lower tiers read from and write
into DRAM slots.

* **An eviction order per tier**, a policy object (:mod:`tpusync._src.kv._eviction`; LRU: a hit
  or a store moves a key to the hot end).
* **Room.** A tier that needs ``n`` free slots evicts its coldest blocks that are neither pinned
  (a lookup handle, a prefetch or a restore holds them) nor kept by a session at the bottom.
  DRAM demotes a victim to the next tier first unless a writable lower tier already holds it
  (the next one that works: a full or failing tier is passed over); a lower tier drops its
  victims (every save is written through to all lower tiers in the background, so the tiers
  below usually hold it already). A victim that no lower tier could take is dropped all the
  same (``evicted_unsaved``: a loss of cache, not an error of the save that needed the room).
  A session's block is never dropped: in DRAM it may be demoted, in the lowest tier that holds
  it it stays. A lower tier's room is what it can reach now (``usable_capacity``: a disk tier on
  a filesystem smaller than its capacity is full, and evicts, at the slabs it could make).
* **Promotion.** A block found only in a lower tier is read back into DRAM and stays there. A
  block a tier fails to serve (corrupt, unreadable) is asked of the tiers below it.
* **Streaming.** A save or load of more blocks than DRAM holds passes through DRAM in chunks
  (see ``_streaming``): a saved chunk is written into the lower tiers before the next one needs
  its room; a loaded chunk's pins stop holding it in DRAM (:meth:`TierStack.loosen`) once it is
  on the device, while its copies below stay pinned.
* **Failures.** Every lower tier is written independently: a full or failing tier is counted
  (``writeback_failed``) and logged once per run of failures with its path (``_tier_faults``),
  and the tiers beside it still get the blocks.
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
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from tpusync._src.kv._eviction import EvictionPolicy, LruPolicy
from tpusync._src.kv._tier_faults import TierFaults
from tpusync._src.kv._writeback import WriteBackQueue, drop_one_each
from tpusync._src.tiers.base import LowerTier, tier_free, tier_usable_capacity
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.spec import OpenedTier
from tpusync.errors import BlocksMissingError, InvalidArgumentError, TierFullError, TpuSyncError

log = logging.getLogger("tpusync.kv")

POLICY_COUNTERS = (
    "evictions",
    "demotions",
    "promotions",
    "direct_loads",  # blocks a lower tier landed straight in the engine's memory (no DRAM)
    "lower_tier_misses",
    "lower_tier_errors",
    "lower_tier_fallbacks",  # blocks served by a lower tier after the one above failed them
    "evicted_unsaved",  # blocks DRAM evicted that no lower tier could take (a loss of cache)
    "writeback_written",  # blocks written to lower tiers for write-back (on demotion too)
    "writeback_on_demote",  # of those, written by DRAM evicting blocks still queued
    "writeback_skipped",
    "writeback_waits",
    "writeback_failed",
    "writeback_lost",  # blocks DRAM dropped before write-back wrote them to a tier
    "saves_streamed",  # saves of more blocks than DRAM holds, written down chunk by chunk
    "save_unstored_blocks",  # blocks of streamed saves not stored: no lower tier took a chunk
    "lower_tier_rested",  # blocks not asked of or written to a tier resting after a failure
)
_WRITEBACK_WAIT_S = 30.0  # how long making room waits for write-back to free busy slots


def _known_keys(tier: LowerTier) -> list[bytes]:
    """The keys a writable tier holds as the stack opens; none for a peer that cannot be
    reached now (a store node the store opened without: it makes room itself)."""
    try:
        return list(tier.keys())
    except ConnectionError:
        return []


class TierStack:
    """DRAM plus lower tiers, with the store's policy state. Thread-safe."""

    def __init__(
        self,
        dram: HostPool,
        lower: Sequence[tuple[str, OpenedTier]],
        *,
        writeback_max_bytes: int,
        writeback_policy: str,
    ) -> None:
        self.dram = dram
        self.names = ["dram", *(name for name, _ in lower)]
        self.tiers: list[HostPool | LowerTier] = [dram, *(opened.tier for _, opened in lower)]
        self.block_bytes = dram.layout.payload_bytes
        self.lock = threading.RLock()
        self._room_locks = [threading.Lock() for _ in self.tiers]
        # Read-only tiers (e.g. another host's DRAM through a RemotePool) are searched and
        # promoted from, never written, demoted to or evicted from.
        self.read_only = [False, *(opened.read_only for _, opened in lower)]
        writable = [t for t in range(1, len(self.tiers)) if not self.read_only[t]]
        self._below: int | None = writable[0] if writable else None  # where DRAM demotes to
        self._writable_lower = writable
        # each tier's eviction order (kv/_eviction.py); read-only tiers are never evicted from
        self._order: list[EvictionPolicy] = [
            LruPolicy([] if ro else _known_keys(t))
            for t, ro in zip(self.tiers, self.read_only, strict=True)
        ]
        self._pins: collections.Counter[bytes] = collections.Counter()
        # pins that no longer hold their block in DRAM (a streaming load copied it out already)
        self._loose: collections.Counter[bytes] = collections.Counter()
        self.faults = TierFaults(self.names, self.tiers)
        self._kept: collections.Counter[bytes] = collections.Counter()
        self._doomed: set[bytes] = set()  # purged while pinned: dropped at the last unpin
        # Told of keys DRAM gained and lost (the store's registry link); called without locks.
        self.on_dram_added: Callable[[list[bytes]], None] | None = None
        self.on_dram_removed: Callable[[list[bytes]], None] | None = None
        # Told of keys a writable lower tier dropped (tier index, keys); called without locks.
        self.on_lower_removed: Callable[[int, list[bytes]], None] | None = None
        # Block events ("stored" or "removed", tier index, keys): every tier, any number of
        # listeners (KVCacheStore.add_block_listener); called without locks.
        self.block_listeners: list[Callable[[str, int, list[bytes]], None]] = []
        self.counters: collections.Counter[str] = collections.Counter(
            dict.fromkeys(POLICY_COUNTERS, 0)
        )
        self._counters_lock = threading.Lock()
        self.writeback = WriteBackQueue(
            block_bytes=self.block_bytes,
            max_bytes=writeback_max_bytes,
            policy=writeback_policy,
            write=self._write_back_all if writable else None,
            bump=self.bump,
        )

    @property
    def can_write_down(self) -> bool:
        """Whether a writable lower tier exists (blocks can leave DRAM without being lost)."""
        return bool(self._writable_lower)

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
            self._order[tier].touched(keys)

    def touch_if_all_local(self, keys: Sequence[bytes]) -> bool:
        """Whether this node's tiers hold every one of ``keys`` (an index lookup, no I/O); if
        so they are touched in their tiers' LRU, as a save of them would."""
        with self.lock:
            # a save of new blocks usually ends with one: then one key is looked up, not all
            if not keys or self.locate(keys[-1:], prefix=False, local=True, probe=False)[0] < 0:
                return False
            where = self.locate(keys, prefix=False, local=True, probe=False)
        if not where or min(where) < 0:
            return False
        for t in set(where):
            self.touch(t, [k for k, w in zip(keys, where, strict=True) if w == t])
        return True

    def forget(self, tier: int, keys: Sequence[bytes]) -> None:
        with self.lock:
            self._order[tier].removed(keys)

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

    def loosen(self, keys: Sequence[bytes]) -> None:
        """Lets one pin of each key stop holding it in DRAM (the lower tiers' copies stay
        pinned): a streaming load calls this for blocks it has copied to the device, so that
        DRAM may evict them for the next chunk. Undo with :meth:`tighten` before unpinning."""
        with self.lock:
            self._loose.update(keys)

    def tighten(self, keys: Sequence[bytes]) -> None:
        """Undoes :meth:`loosen`."""
        with self.lock:
            drop_one_each(self._loose, keys)

    def _pinned_in(self, tier: int, key: bytes) -> bool:
        """Whether pins hold ``key`` in ``tier`` (loosened pins do not hold it in DRAM)."""
        pins = self._pins.get(key, 0)
        return pins > 0 and (tier > 0 or pins > self._loose.get(key, 0))

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
        self.block_event("stored", 0, keys)

    def block_event(self, kind: str, tier: int, keys: Sequence[bytes]) -> None:
        """Tells every block listener; a listener that raises is logged, never the caller's
        failure (a save or an eviction goes on)."""
        if not keys:
            return
        for listener in self.block_listeners:
            try:
                listener(kind, tier, list(keys))
            except Exception:
                log.exception("tpusync kv: a block listener failed")

    def dram_removed(self, keys: Sequence[bytes]) -> None:
        if keys and self.on_dram_removed is not None:
            self.on_dram_removed(list(keys))

    def removed(self, tier: int, keys: Sequence[bytes]) -> None:
        """Tells the hooks that ``tier`` dropped ``keys``."""
        self.block_event("removed", tier, keys)
        if tier == 0:
            self.dram_removed(keys)
        elif keys and self.on_lower_removed is not None:
            self.on_lower_removed(tier, list(keys))

    def pinned(self, key: bytes) -> bool:
        return self._pins.get(key, 0) > 0

    def locate(
        self, keys: Sequence[bytes], *, prefix: bool, local: bool = False, probe: bool = True
    ) -> list[int]:
        """The first tier holding each key (-1: none). With ``prefix``, stops at the first key
        held nowhere (the list is then that long); with ``local``, read-only tiers (other
        nodes') are not asked. A lower tier that cannot answer (a peer that is gone) holds
        nothing, and so does one resting after that (without ``probe``: until something else
        reached it again; see ``TierFaults``). Call with ``lock`` held to pin the result."""
        where = [-1] * len(keys)
        todo = list(range(len(keys)))
        for t in range(len(self.tiers)):
            if not todo:
                break
            if local and self.read_only[t]:
                continue
            found = self._contains(t, [keys[i] for i in todo], probe=probe)
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

    def _contains(self, tier: int, keys: list[bytes], *, probe: bool = True) -> list[bool]:
        if tier == 0:
            return self.dram.contains(keys)
        if self._rests(tier, probe=probe):
            self.bump("lower_tier_rested", len(keys))
            return [False] * len(keys)
        try:
            found = self.tiers[tier].contains(keys)
        except (TpuSyncError, OSError) as error:
            self.bump("lower_tier_errors", 1)
            self.faults.unreachable(tier, error)
            log.warning("tpusync kv: tier %s cannot answer: %s", self.names[tier], error)
            return [False] * len(keys)
        self.faults.reached(tier)
        return found

    def _rests(self, tier: int, *, probe: bool) -> bool:
        """Whether to leave ``tier`` alone now: it could not be reached, and its rest is not
        over or (without ``probe``: the path a save waits for) nothing has reached it since."""
        return self.faults.unreached(tier) if not probe else self.faults.resting(tier)

    # --- room ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def room(self, tier: int, blocks: int) -> Iterator[None]:
        """Holds ``tier``'s room lock with at least ``blocks`` free slots (evicting for them)
        until the block ends; the caller fills the room inside."""
        with self._room_locks[tier]:
            self._make_room(tier, blocks)
            yield

    def _free(self, tier: int) -> int:
        return self.dram.free if tier == 0 else tier_free(self.tiers[tier])

    def _capacity(self, tier: int) -> int:
        """The slots ``tier`` can reach now (a disk tier's filesystem may hold fewer than its
        capacity: see :attr:`DiskPool.usable_capacity`)."""
        store = self.tiers[tier]
        return tier_usable_capacity(store) if tier else store.capacity

    def _too_big(self, tier: int, blocks: int) -> TierFullError:
        store, capacity = self.tiers[tier], self._capacity(tier)
        where = f"{self.names[tier]} tier" if tier == 0 else f"tier {self.faults.label(tier)}"
        if capacity < store.capacity:
            return TierFullError(
                f"{where}: {blocks} blocks do not fit in the {capacity} of its "
                f"{store.capacity} slots that its filesystem has room for; free space there, "
                "or lower its capacity_blocks"
            )
        return TierFullError(
            f"{where}: {blocks} blocks do not fit in its {capacity} slots; raise its "
            "capacity_blocks"
        )

    def _make_room(self, tier: int, blocks: int) -> None:
        """Evicts until ``blocks`` slots are free. Call with the tier's room lock held."""
        store = self.tiers[tier]
        if blocks > self._capacity(tier):
            raise self._too_big(tier, blocks)
        bottom = tier > 0 or self._below is None  # nowhere to demote to: victims are dropped
        deadline = time.monotonic() + _WRITEBACK_WAIT_S
        stuck: set[bytes] = set()  # victims no lower tier took that must not be dropped
        while (need := blocks - self._free(tier)) > 0:
            busy = self.writeback.active() if tier == 0 else set()
            with self.lock:
                victims, waiting = [], False
                for key in self._order[tier].coldest():
                    if self._pinned_in(tier, key) or key in stuck:
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
                self._order[tier].removed(stale)
            if stale:
                continue
            if len(victims) < need:
                # Never evict for a request that cannot be met: wait for write-back to finish
                # with the slots it reads, or fail with everything still cached.
                if waiting and time.monotonic() < deadline:
                    self.writeback.wait_progress()
                    continue
                break
            if not bottom:
                self._demote(victims)
            unsaved = 0
            with self.lock:
                # a lookup may have pinned a victim meanwhile: it stays
                victims = [k for k in victims if not self._pinned_in(tier, k)]
                if not bottom:
                    # A session's block, or a pinned one a streaming load let go of, is dropped
                    # only where a lower tier holds it. When some cannot be, choose again
                    # without them: never evict for a request that cannot be met.
                    below = self._held_below(victims)
                    kept = [
                        k
                        for k in victims
                        if k not in below and (self._kept.get(k) or self._pins.get(k))
                    ]
                    if kept:
                        stuck.update(kept)
                        continue
                    unsaved = sum(k not in below for k in victims)
                dropped = store.delete(victims)
                gone = absent(store, victims)
                self._order[tier].removed(gone)
            self.removed(tier, gone)
            self.bump("evictions", dropped)
            if unsaved:
                self.bump("evicted_unsaved", unsaved)
            store.stats.add(evictions=dropped)
            if not gone:
                if time.monotonic() >= deadline:
                    break
                self.writeback.wait_progress()
        if self._free(tier) < blocks:
            untaken = f" ({len(stuck)} of them no lower tier could take)" if stuck else ""
            raise TierFullError(
                f"{self.names[tier]} tier: {blocks} free blocks needed, {self._free(tier)} free "
                f"of {self._capacity(tier)}; the rest are pinned by lookups or held by "
                f"sessions{untaken} — release handles, drop sessions or raise capacity_blocks"
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
            with self.lock:
                below = self._held_below(victims) if not bottom else set()
                victims = [
                    k
                    for k in victims
                    if self._pins.get(k, 0) <= 0 and (k in below or not self._kept.get(k))
                ]
                dropped = store.delete(victims)
                gone = absent(store, victims)
                self._order[tier].removed(gone)
        self.removed(tier, gone)
        self.bump("evictions", dropped)
        store.stats.add(evictions=dropped)
        return dropped

    def _held_below(self, keys: Sequence[bytes]) -> set[bytes]:
        """The keys some writable lower tier holds (one that cannot answer holds none)."""
        held: set[bytes] = set()
        todo = list(keys)
        for tier in self._writable_lower:
            if not todo:
                break
            found = self._contains(tier, todo, probe=False)
            held.update(k for k, hit in zip(todo, found, strict=True) if hit)
            todo = [k for k, hit in zip(todo, found, strict=True) if not hit]
        return held

    def _demote(self, keys: list[bytes]) -> None:
        """Writes DRAM blocks that the lower tiers lack into the first writable lower tier that
        takes them (the next one, or past it when it is full or failing), before DRAM drops
        them; and the ones write-back has not finished with into the other lower tiers too.
        A failing tier is counted and logged, never raised: the eviction goes on."""
        todo, failed = keys, set()
        for tier in self._writable_lower:
            if not todo:
                break
            if self._rests(tier, probe=False):
                failed.add(tier)
                self.bump("lower_tier_rested", len(todo))
                continue
            store = self.tiers[tier]
            try:
                missing = absent(store, todo)
                if missing:
                    written = self._put_down(tier, missing)
                    self.bump("demotions", written)
                    if written:
                        self.faults.worked(tier)
                    missing = absent(store, missing)  # kept from it: DRAM lost them meanwhile
            except (TpuSyncError, OSError) as error:
                failed.add(tier)
                self.faults.failed(tier, f"demotion of {len(todo)} blocks out of DRAM", error)
                continue
            todo = missing
        self._write_back_now(keys, skip=failed)

    def _write_back_now(self, keys: list[bytes], *, skip: set[int]) -> None:
        """Writes the keys still queued for write-back (or being written) into every writable
        lower tier but the ``skip`` ones (those that just failed): write-back reads DRAM, which
        is about to drop them. Call with DRAM's room lock held (lower tiers' room locks come
        after it). A failing tier is counted and logged, never raised: the eviction goes on."""
        pending = self.writeback.pending(keys)
        if not pending:
            return
        for tier in self._writable_lower:
            if tier not in skip:
                self._write_back_to(tier, pending, on_demote=True)

    def _write_back_to(self, tier: int, keys: list[bytes], *, on_demote: bool = False) -> None:
        """Writes the DRAM blocks of ``keys`` that lower ``tier`` lacks into it. A failure is
        counted (``writeback_failed``) and logged, never raised: the other tiers still get the
        blocks. ``on_demote``: DRAM is evicting them (counted in ``writeback_on_demote``)."""
        if self._rests(tier, probe=not on_demote):
            self.bump("lower_tier_rested", len(keys))
            return
        missing = keys
        try:
            missing = absent(self.tiers[tier], keys)
            if not missing:
                return
            written = self._put_down(tier, missing)
        except (TpuSyncError, OSError) as error:
            self.bump("writeback_failed", len(missing))
            what = f"write-back of {len(missing)} blocks{' DRAM is evicting' if on_demote else ''}"
            self.faults.failed(tier, what, error)
            return
        if written:
            self.faults.worked(tier)
        self.bump("writeback_written", written)
        if on_demote:
            self.bump("writeback_on_demote", written)
        else:
            self._count_lost(tier, missing)

    def write_down(self, keys: list[bytes]) -> set[bytes]:
        """Writes DRAM blocks into every writable lower tier now, each tier on its own (see
        :meth:`_write_back_to`); returns the keys some writable lower tier holds afterwards. A
        save larger than DRAM does this for each chunk before the next needs its room."""
        for tier in self._writable_lower:
            self._write_back_to(tier, keys)
        return self._held_below(keys)

    def _put_down(self, tier: int, keys: list[bytes]) -> int:
        """Copies DRAM blocks into lower ``tier`` (making room there); returns blocks written.
        Blocks DRAM lost meanwhile are skipped, and so are those the tier got meanwhile: two
        writers of a key (write-back and a demotion of a block still queued for it) both find
        it absent, and the second must neither write it again nor announce it twice."""
        keys = present(self.dram, keys)
        if not keys:
            return 0
        with self._room_locks[tier]:
            keys = absent(self.tiers[tier], keys)  # puts into a tier hold its room lock
            if not keys:
                return 0
            self._make_room(tier, len(keys))
            try:
                keys, written = self._put(tier, keys)
            except TierFullError:
                # It found less room than it said (e.g. its filesystem filled up meanwhile) and
                # says so now: make that room, once.
                self._make_room(tier, len(keys))
                keys, written = self._put(tier, keys)
        self.touch(tier, keys)
        self.block_event("stored", tier, keys)
        return written

    def _put(self, tier: int, keys: list[bytes]) -> tuple[list[bytes], int]:
        """``put`` of DRAM blocks into ``tier``, without the ones DRAM lost meanwhile; returns
        the keys put and how many were written."""
        store = self.tiers[tier]
        try:
            return keys, store.put(keys, self.dram)
        except BlocksMissingError as missing:  # evicted or found corrupt in DRAM meanwhile
            keys = [k for k, ok in zip(keys, missing.loaded, strict=True) if ok]
            return keys, store.put(keys, self.dram) if keys else 0

    # --- promotion -------------------------------------------------------------------------

    def promote(
        self, keys: Sequence[bytes], *, local: bool = False, where: list[int] | None = None
    ) -> tuple[list[bool], int]:
        """Reads the keys DRAM lacks from the first lower tier holding them into DRAM; returns
        which keys DRAM holds afterwards, and how many blocks moved up. A block a tier fails to
        serve (it fails its checksum, cannot be read: the tier counts and drops it) is asked of
        the tiers below that one, and is a miss only when none serves it. Pin the keys first, so
        that making room cannot evict them. With ``local``, other nodes' (read-only) tiers are
        not read. ``where``: :meth:`locate`'s answer for ``keys``, when the caller has it."""
        in_dram = self.dram.contains_checked(list(keys))  # the store's own keys
        if all(in_dram):
            return in_dram, 0
        if where is None:
            where = self.locate(keys, prefix=False, local=local)
        wanted = [(k, t) for k, t in zip(keys, where, strict=True) if t > 0]
        promoted = 0
        if wanted:
            with self.room(0, len(wanted)):
                promoted = self._read_up(wanted, local=local)
        return self.dram.contains(keys), promoted

    def _read_up(self, wanted: list[tuple[bytes, int]], *, local: bool) -> int:
        """Reads each key into DRAM from its tier (key, first tier holding it), falling through
        to the tiers below for the blocks a tier fails to serve; returns blocks read. Call with
        DRAM's room for all of them held."""
        promoted = 0
        failed: list[bytes] = []  # not served by the tier asked: ask the ones below it
        for t in range(1, len(self.tiers)):
            if local and self.read_only[t]:
                continue
            subset = [k for k, first in wanted if first == t]
            retried = 0
            if failed:
                held = self._contains(t, failed)
                again = [k for k, hit in zip(failed, held, strict=True) if hit]
                failed = [k for k, hit in zip(failed, held, strict=True) if not hit]
                subset += again
                retried = len(again)
            if not subset:
                continue
            loaded = self._get_up(t, subset)
            done = set(loaded)
            failed += [k for k in subset if k not in done]
            if retried:
                self.bump("lower_tier_fallbacks", sum(k in done for k in subset[-retried:]))
            if not self.read_only[t]:
                self.touch(t, loaded)
            self.touch(0, loaded)
            self.dram_added(loaded)
            self.bump("promotions", len(loaded))
            promoted += len(loaded)
        return promoted

    def _get_up(self, tier: int, keys: list[bytes]) -> list[bytes]:
        """Reads ``keys`` from lower ``tier`` into DRAM; returns the ones DRAM got (the others
        are counted as misses of the tier)."""
        if self.faults.resting(tier):
            self.bump("lower_tier_rested", len(keys))
            self.bump("lower_tier_misses", len(keys))
            return []
        try:
            self.tiers[tier].get(keys, self.dram)
            self.faults.reached(tier)
            return keys
        except BlocksMissingError as missing:
            self.faults.reached(tier)
            loaded = [k for k, ok in zip(keys, missing.loaded, strict=True) if ok]
        except (TpuSyncError, OSError) as error:  # e.g. a peer that is gone
            self.faults.unreachable(tier, error)
            log.warning("tpusync kv: tier %s failed: %s", self.faults.label(tier), error)
            held = self.dram.contains(keys)  # whatever it committed first
            loaded = [k for k, ok in zip(keys, held, strict=True) if ok]
            self.bump("lower_tier_errors", 1)
        self.bump("lower_tier_misses", len(keys) - len(loaded))
        return loaded

    def get_scattered(self, tier: int, keys: list[bytes], scatter: Scatter) -> list[bool]:
        """Has lower ``tier`` land ``keys`` straight where ``scatter`` says (its
        ``get_scattered``); returns which arrived verified. A tier that fails is counted as in
        :meth:`_get_up`, and all its blocks are misses."""
        loaded = [False] * len(keys)
        if self.faults.resting(tier):
            self.bump("lower_tier_rested", len(keys))
        else:
            try:
                loaded = self.tiers[tier].get_scattered(keys, scatter)
                self.faults.reached(tier)
            except InvalidArgumentError:  # the caller's mistake, not the tier's
                raise
            except (TpuSyncError, OSError) as error:  # e.g. a peer that is gone
                self.faults.unreachable(tier, error)
                log.warning("tpusync kv: tier %s failed: %s", self.faults.label(tier), error)
                self.bump("lower_tier_errors", 1)
        hits = sum(loaded)
        self.bump("lower_tier_misses", len(keys) - hits)
        if hits and not self.read_only[tier]:
            self.touch(tier, [k for k, ok in zip(keys, loaded, strict=True) if ok])
        return loaded

    # --- write-back ------------------------------------------------------------------------

    def _write_back_all(self, keys: list[bytes]) -> None:
        """What the write-back thread does with each batch: every writable lower tier, each
        on its own (a failing one is skipped)."""
        for tier in self._writable_lower:
            self._write_back_to(tier, keys)

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
            if self.faults.failing(tier):  # its failures are reported already
                return
            log.warning(
                "tpusync kv: write-back lost %d blocks for tier %s: DRAM dropped them first",
                len(held),
                self.names[tier],
            )

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
        self.writeback.close()


def present(tier: HostPool | LowerTier, keys: Sequence[bytes]) -> list[bytes]:
    """The keys ``tier`` holds, in order."""
    return [k for k, hit in zip(keys, tier.contains(keys), strict=True) if hit]


def absent(tier: HostPool | LowerTier, keys: Sequence[bytes]) -> list[bytes]:
    """The keys ``tier`` lacks, in order."""
    return [k for k, hit in zip(keys, tier.contains(keys), strict=True) if not hit]
