"""KV events of the SGLang backend's tiers, in SGLang's own format, on a ZMQ socket of the
backend's (``kv_events`` in the extra config): a router indexing SGLang's events (its
scheduler's, for GPU and host memory) sees the store's copies of a page under the same name.

A page is named as SGLang names it in its events (``hash_str_to_int64`` of its page key); the
parent is the page before it (the prefix keys SGLang passes with a store, or the key before
in the same call). Token ids are unknown to a storage backend: events carry none (a tier-only
update of a page the index knows from the engine's own events). Media: ``CPU_PINNED`` for the
store's DRAM, ``DISK`` for disk and shared-filesystem tiers, ``EXTERNAL`` for store nodes and
peers. Frames are SGLang's: topic, an 8-byte big-endian sequence number, the msgpack of its
``KVEventBatch``; a thread of the publisher sends them, so the store's threads never wait on
the socket (a full queue drops events, counted)."""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch
from sglang.srt.mem_cache.utils import hash_str_to_int64

from tpusync.errors import InvalidArgumentError

__all__ = ["EventSettings", "PageEventPublisher", "event_settings", "medium_of"]

log = logging.getLogger("tpusync.connectors.sglang")

MAX_KNOWN_PAGES = 1 << 18  # page keys remembered for their events (~200 bytes each)
MAX_QUEUED = 1 << 14  # events waiting for the socket; more are dropped (counted)
_DISK_TIERS = ("disk", "shared_fs")


@dataclass(frozen=True)
class EventSettings:
    """``kv_events``: where the backend publishes (``endpoint``: a ZMQ endpoint the PUB socket
    binds, e.g. ``tcp://127.0.0.1:5560`` or ``ipc:///run/tpusync/events``) and the topic."""

    endpoint: str
    topic: str = ""


def event_settings(value: Any, where: str) -> EventSettings | None:
    """``kv_events`` of the extra config, checked (None where absent)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{where}: expected an object, got {type(value).__name__}")
    unknown = set(value) - {"endpoint", "topic"}
    if unknown:
        raise InvalidArgumentError(
            f"{where}.{sorted(unknown)[0]}: unknown key; kv_events takes endpoint, topic"
        )
    endpoint, topic = value.get("endpoint"), value.get("topic", "")
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
        raise InvalidArgumentError(
            f"{where}.endpoint: expected a ZMQ endpoint to bind (tcp://HOST:PORT or "
            f"ipc://PATH), got {endpoint!r}"
        )
    if not isinstance(topic, str):
        raise InvalidArgumentError(f"{where}.topic: expected a string, got {topic!r}")
    return EventSettings(endpoint, topic)


def medium_of(tier: str) -> str:
    """SGLang's medium for a store tier (its ``StorageMedium`` values)."""
    if tier == "dram":
        return "CPU_PINNED"
    return "DISK" if tier in _DISK_TIERS else "EXTERNAL"


class PageEventPublisher:
    """Hears the store's block events and publishes those of the pages it learned (see the
    module docstring). Thread-safe; :meth:`close` stops the thread and the socket."""

    def __init__(self, settings: EventSettings, page_size: int, attn_dp_rank: int = 0) -> None:
        self.page_size = page_size
        self.dropped = 0  # events not published: the queue was full
        self._topic = settings.topic.encode()
        self._rank = attn_dp_rank
        self._lock = threading.Lock()
        # store key -> (SGLang's event hash, its parent's)
        self._known: collections.OrderedDict[bytes, tuple[int, int | None]] = (
            collections.OrderedDict()
        )
        self._queue: queue.Queue[Any] = queue.Queue(MAX_QUEUED)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        try:
            self._socket.bind(settings.endpoint)
        except zmq.ZMQError as error:
            self._socket.close(linger=0)
            self._context.term()
            raise InvalidArgumentError(
                f"kv_events.endpoint: cannot bind {settings.endpoint} ({error}); choose a free "
                "port or a path this user can create"
            ) from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0
        self._thread = threading.Thread(target=self._send_loop, name="tpusync-sglang-events")
        self._thread.start()

    def learn(self, keys: list[bytes], page_keys: list[str], parent: str | None) -> None:
        """Remembers that store key ``keys[i]`` is SGLang's page ``page_keys[i]`` (each page's
        parent the one before, the first's ``parent``)."""
        with self._lock:
            before = None if parent is None else hash_str_to_int64(parent)
            for key, page in zip(keys, page_keys, strict=True):
                name = hash_str_to_int64(page)
                self._known[key] = (name, before)
                self._known.move_to_end(key)
                before = name
            while len(self._known) > MAX_KNOWN_PAGES:
                self._known.popitem(last=False)

    def heard(self, kind: str, tier: str, keys: list[bytes]) -> None:
        """A store block event (:meth:`~tpusync.kv.KVCacheStore.add_block_listener`)."""
        medium = medium_of(tier)
        with self._lock:
            known = [self._known[k] for k in keys if k in self._known]
        if not known:
            return
        if kind == "removed":
            events: list[Any] = [BlockRemoved(block_hashes=[n for n, _ in known], medium=medium)]
        else:
            events = [
                BlockStored(
                    block_hashes=[name],
                    parent_block_hash=parent,
                    token_ids=[],
                    block_size=self.page_size,
                    lora_id=None,
                    medium=medium,
                )
                for name, parent in known
            ]
        for event in events:
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self.dropped += 1

    def _send_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            events = [first]
            with contextlib.suppress(queue.Empty):
                while len(events) < 1024:
                    event = self._queue.get_nowait()
                    if event is None:
                        self._send(events)
                        return
                    events.append(event)
            self._send(events)

    def _send(self, events: list[Any]) -> None:
        batch = KVEventBatch(ts=time.time(), events=events, attn_dp_rank=self._rank)
        sequence = self._sequence.to_bytes(8, "big", signed=True)
        self._sequence += 1
        try:
            self._socket.send_multipart((self._topic, sequence, self._encoder.encode(batch)))
        except zmq.ZMQError as error:  # never into the store's threads; the index misses them
            self.dropped += len(events)
            log.warning("tpusync sglang: %d KV events not published: %s", len(events), error)

    def close(self) -> None:
        """Publishes what is queued, then closes the socket."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._socket.close(linger=1000)
        self._context.term()
