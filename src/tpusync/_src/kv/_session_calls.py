"""Offloaded sessions of one :class:`~tpusync.kv.KVCacheStore` (an object it holds): offload a
paused session's KV, every token, out of device memory, keep it from being dropped, restore or
drop it. The manifests themselves live in :mod:`tpusync._src.kv.sessions`."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._src.kv._store_calls import StoreCalls
from tpusync._src.kv._tier_stack import TierStack
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.keys import KeyScheme, Namespace
from tpusync._src.kv.results import SaveFuture, SessionRestore
from tpusync._src.kv.sessions import SessionManifests, SessionRecord
from tpusync._src.kv.tier_specs import DiskTier
from tpusync._src.tiers.dram import sessions_path
from tpusync.errors import InvalidArgumentError, SessionNotFoundError

__all__ = ["SessionCalls", "session_dir"]


def session_dir(config: KVStoreConfig) -> Path | None:
    """Where a store keeps its sessions' manifests: beside its named DRAM pool, else in its
    first disk tier; None when it has neither (its sessions end with the process)."""
    if config.dram.name is not None:
        return sessions_path(config.dram.name, config.dram.shm_dir)
    disk = next((t for t in config.tiers if isinstance(t, DiskTier)), None)
    if disk is not None:
        return Path(disk.directory) / "sessions"
    return None


class SessionCalls:
    """The sessions of one store: their manifests, the keys they keep from being dropped and
    their saves in flight. It asks the store for checks, keys, saves and loads through
    ``calls``; a session found in ``manifests`` (after a restart) is kept from the start."""

    def __init__(
        self,
        calls: StoreCalls,
        stack: TierStack,
        manifests: SessionManifests,
        *,
        scheme: KeyScheme,
        block_size: int,
        block_bytes: int,
    ) -> None:
        self._calls = calls
        self._stack = stack
        self._manifests = manifests
        self._scheme = scheme
        self._block_size = block_size
        self._block_bytes = block_bytes
        self._lock = threading.Lock()
        self._saves: dict[str, SaveFuture] = {}  # each session's offload until it lands
        for record in manifests.all():
            stack.keep(record.keys)

    def offload_async(
        self, session_id: str, tokens: Any, device_block_ids: Any, namespace: Namespace | None
    ) -> SaveFuture:
        calls = self._calls
        calls.check_open()
        session_id = _check_session_id(session_id)
        ns = calls.namespace(namespace)
        toks, keys = calls.keys(tokens, namespace)
        n_full = len(keys)
        if len(toks) > n_full * self._block_size:
            parent = keys[-1] if keys else None
            tail = toks[n_full * self._block_size :]
            keys = [*keys, self._scheme.tail_key(ns, parent, session_id, tail)]
        ids = calls.check_block_ids(device_block_ids, len(keys), at_most=False)
        record = SessionRecord(session_id, toks.copy(), tuple(keys))
        self._stack.keep(keys)
        try:
            old = self._manifests.put(record)  # TierFullError/TierIOError: nothing changed
        except BaseException:
            self._stack.unkeep(keys)
            raise
        if old is not None:
            self._end(old, drop_tail=bool(old.keys) and old.keys[-1] not in keys)
        future = calls.start_save(keys, ids)
        with self._lock:
            self._saves[session_id] = future
        return future

    def restore(
        self, session_id: str, device_block_ids: Any, timeout: float | None
    ) -> SessionRestore:
        calls = self._calls
        calls.check_open()
        session_id = _check_session_id(session_id)
        record = self._manifests.get(session_id)
        if record is None:
            raise SessionNotFoundError(
                f"session_id: no offloaded session {session_id!r} (never offloaded, already "
                "restored, or dropped)"
            )
        ids = calls.check_block_ids(device_block_ids, len(record.keys), at_most=False)
        calls.check_writable(ids)
        with self._lock:
            saving = self._saves.pop(session_id, None)
        if saving is not None:
            saving.result(timeout)  # the offload's own save must land first
        keys = list(record.keys)
        start = time.perf_counter()
        self._stack.pin(keys)
        try:
            loaded, _ = calls.load_keys(keys, ids)
        finally:
            self._stack.unpin(keys)
        seconds = time.perf_counter() - start
        if self._manifests.pop(session_id) is not None:
            self._end(record, drop_tail=True)
        tokens = record.tokens
        loaded_tokens = min(loaded * self._block_size, len(tokens))
        return SessionRestore(
            session_id, tokens, loaded_tokens, loaded * self._block_bytes, seconds
        )

    def drop(self, session_id: str) -> None:
        self._calls.check_open()
        session_id = _check_session_id(session_id)
        record = self._manifests.pop(session_id)
        if record is None:
            raise SessionNotFoundError(f"session_id: no offloaded session {session_id!r}")
        with self._lock:
            saving = self._saves.pop(session_id, None)
        if saving is not None:
            concurrent.futures.wait([saving])
        self._end(record, drop_tail=True)

    def tokens(self, session_id: str) -> np.ndarray:
        record = self._manifests.get(_check_session_id(session_id))
        if record is None:
            raise SessionNotFoundError(f"session_id: no offloaded session {session_id!r}")
        return record.tokens.copy()

    def ids(self) -> list[str]:
        return [r.session_id for r in self._manifests.all()]

    def forget_namespace(self, tag: bytes) -> None:
        """Forgets every session whose keys start with ``tag`` (a namespace purged), leaving
        its blocks to the purge."""
        for record in self._manifests.all():
            if record.keys and record.keys[0].startswith(tag):
                self._manifests.pop(record.session_id)
                self._stack.unkeep(list(record.keys))

    def _end(self, record: SessionRecord, *, drop_tail: bool) -> None:
        self._stack.unkeep(list(record.keys))
        n_full = len(record.tokens) // self._block_size
        if drop_tail and len(record.keys) > n_full:  # the tail block serves nobody else
            self._stack.delete_everywhere([record.keys[-1]])


def _check_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str) or not 1 <= len(session_id) <= 256:
        raise InvalidArgumentError(
            f"session_id: expected a string of 1 to 256 characters, got {session_id!r}"
        )
    return session_id
