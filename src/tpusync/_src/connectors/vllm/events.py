"""KV events: the store's block events (a block stored in or removed from a tier) as vLLM's
``BlockStored`` / ``BlockRemoved``, named by vLLM's own block hashes in the form vLLM's own
events use (64-bit integers where ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, its default;
the hash bytes otherwise), with a medium per tier: one index sees the engine's own copy of a
block and the store's copies under one name.

The worker side hears the store (:meth:`~tpusync.kv.KVCacheStore.add_block_listener`) and
knows, for the blocks it saved or looked up, which vLLM hash (and, for saves, which parent and
token ids) a store key stands for. Its events reach the scheduler side with the step's output
(:class:`TpuSyncKVEvents`), whose ``take_events`` hands them to vLLM's publisher."""

from __future__ import annotations

import array
import collections
import logging
import threading
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

__all__ = ["BlockEventLog", "TpuSyncKVEvents", "as_list", "medium_of"]

log = logging.getLogger("tpusync.connectors.vllm")

# store keys remembered with their vLLM hash, parent and tokens (~350 bytes each): as many as
# the store's tiers hold, at least the first and at most the second (the least recent dropped:
# a block forgotten has no more events)
MAX_KNOWN_BLOCKS = 1 << 16
MAX_KNOWN_BLOCKS_CAP = 1 << 21  # ~700 MB at most, however large the tiers


def medium_of(tier: str) -> str:
    """vLLM's ``medium`` of a tier: ``CPU`` for DRAM (vLLM's name for host memory), the tier's
    name in capitals for the others (``DISK``, ``SHARED_FS``, ``NODE``, ...)."""
    return MEDIUM_CPU if tier == "dram" else tier.upper()


class TpuSyncKVEvents(KVConnectorKVEvents):
    """The events of one step from the worker side(s), in order."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self._events = list(events or [])
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TpuSyncKVEvents:
        return self  # one worker (tensor parallelism is part 2): nothing to reconcile

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


class BlockEventLog:
    """The worker side's events: what store keys stand for, and the events since the last
    :meth:`take`. Thread-safe (the store calls :meth:`heard` from its own threads)."""

    def __init__(self, block_size: int, max_blocks: int = MAX_KNOWN_BLOCKS) -> None:
        self.block_size = block_size
        self.max_blocks = min(max(MAX_KNOWN_BLOCKS, int(max_blocks)), MAX_KNOWN_BLOCKS_CAP)
        self.forgotten = 0  # blocks dropped from what is known (their later events are lost)
        self._lock = threading.Lock()
        # store key -> (vLLM hash, parent vLLM hash, token ids, empty when not known)
        self._known: collections.OrderedDict[bytes, tuple[bytes, bytes | None, array.array]] = (
            collections.OrderedDict()
        )
        self._events: list[KVCacheEvent] = []

    def learn(
        self,
        keys: list[bytes],
        hashes: list[bytes],
        parent: bytes | None = None,
        token_ids: list[list[int]] | None = None,
    ) -> None:
        """Remembers that ``keys[i]`` is vLLM's ``hashes[i]`` (a chain: each block's parent is
        the one before it, the first's is ``parent``), with its tokens where known."""
        with self._lock:
            before = parent
            for i, (key, h) in enumerate(zip(keys, hashes, strict=True)):
                tokens = array.array("I", token_ids[i] if token_ids is not None else ())
                old = self._known.get(key)
                if old is not None and not tokens:
                    tokens = old[2]
                self._known[key] = (h, before, tokens)
                self._known.move_to_end(key)
                before = h
            while len(self._known) > self.max_blocks:
                self._known.popitem(last=False)
                self.forgotten += 1
                if self.forgotten == 1:
                    log.warning(
                        "tpusync vllm: more than %d blocks known to the KV events; the least "
                        "recent are forgotten, and their later events are not published",
                        self.max_blocks,
                    )

    def heard(self, kind: str, tier: str, keys: list[bytes]) -> None:
        """A store block event (see :meth:`~tpusync.kv.KVCacheStore.add_block_listener`)."""
        medium = medium_of(tier)
        with self._lock:
            known = [(k, self._known[k]) for k in keys if k in self._known]
            if not known:
                return
            if kind == "removed":
                named = [maybe_convert_block_hash(h) for _, (h, _, _) in known]
                self._events.append(BlockRemoved(block_hashes=named, medium=medium))
                return
            for _, (h, parent, tokens) in known:
                self._events.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(h)],
                        parent_block_hash=None
                        if parent is None
                        else maybe_convert_block_hash(parent),
                        token_ids=tokens.tolist(),
                        block_size=self.block_size,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                    )
                )

    def take(self) -> TpuSyncKVEvents | None:
        with self._lock:
            events, self._events = self._events, []
        return TpuSyncKVEvents(events) if events else None


def as_list(events: Any) -> list[KVCacheEvent]:
    """The events of a step's ``kv_cache_events`` when they are ours, else none."""
    return events.get_all_events() if isinstance(events, TpuSyncKVEvents) else []
