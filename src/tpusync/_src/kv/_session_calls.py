"""Offloaded sessions, the calls of :class:`~tpusync.kv.KVCacheStore` (a base it builds on):
offload a paused session's KV, every token, out of device memory, keep it from being dropped,
restore or drop it. The manifests themselves live in :mod:`tpusync._src.kv._sessions`."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._src.kv._sessions import SessionManifests, SessionRecord
from tpusync._src.kv._tier_stack import TierStack
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.keys import KeyScheme, Namespace
from tpusync._src.kv.results import SaveFuture, SaveResult, SessionRestore
from tpusync._src.kv.tier_specs import DiskTier
from tpusync._src.tiers.dram import pool_path
from tpusync._src.tiers.layout import PoolLayout
from tpusync.errors import InvalidArgumentError, SessionNotFoundError

__all__ = ["SessionCalls"]


class SessionCalls:
    """The session side of :class:`~tpusync.kv.KVCacheStore`: it uses the store's own checks,
    saves and loads, declared here, and its session manifests."""

    config: KVStoreConfig
    layout: PoolLayout
    scheme: KeyScheme
    block_size: int
    _stack: TierStack
    _sessions: SessionManifests
    _handles_lock: threading.Lock
    _session_saves: dict[str, SaveFuture]
    _check_open: Callable[[], None]
    _namespace: Callable[[Namespace | None], Namespace]
    _keys: Callable[[Any, Namespace | None], tuple[np.ndarray, list[bytes]]]
    _check_block_ids: Callable[..., np.ndarray]
    _check_writable: Callable[[np.ndarray], None]
    _start_save: Callable[[list[bytes], np.ndarray], SaveFuture]
    _load_keys: Callable[[list[bytes], np.ndarray], tuple[int, int]]
    _submit: Callable[..., concurrent.futures.Future[Any]]

    def _session_dir(self) -> Path | None:
        config = self.config
        if config.dram.name is not None:
            path = pool_path(config.dram.name, config.dram.shm_dir)
            return path.with_name(path.name.removesuffix(".pool") + ".sessions")
        disk = next((t for t in config.tiers if isinstance(t, DiskTier)), None)
        if disk is not None:
            return Path(disk.directory) / "sessions"
        return None

    # --- sessions --------------------------------------------------------------------------

    def offload_session(
        self,
        session_id: str,
        tokens: Any,
        device_block_ids: Any,
        *,
        namespace: Namespace | None = None,
    ) -> SaveResult:
        """Offloads a paused session (see :meth:`offload_session_async`) and waits until it is
        durable in DRAM; the device blocks are free when this returns."""
        return self.offload_session_async(
            session_id, tokens, device_block_ids, namespace=namespace
        ).result()

    def offload_session_async(
        self,
        session_id: str,
        tokens: Any,
        device_block_ids: Any,
        *,
        namespace: Namespace | None = None,
    ) -> SaveFuture:
        """Moves a paused session's KV — every token, the partial last block too — out of device
        memory into the store and keeps it from being dropped until :meth:`restore_session` or
        :meth:`drop_session`. Offloading an id again replaces the old session. Returns the
        save's future (free the device blocks after ``released``)."""
        self._check_open()
        session_id = _check_session_id(session_id)
        ns = self._namespace(namespace)
        toks, keys = self._keys(tokens, namespace)
        n_full = len(keys)
        if len(toks) > n_full * self.block_size:
            parent = keys[-1] if keys else None
            tail = toks[n_full * self.block_size :]
            keys = [*keys, self.scheme.tail_key(ns, parent, session_id, tail)]
        ids = self._check_block_ids(device_block_ids, len(keys), at_most=False)
        record = SessionRecord(session_id, toks.copy(), tuple(keys))
        self._stack.keep(keys)
        try:
            old = self._sessions.put(record)  # TierFullError/TierIOError: nothing changed
        except BaseException:
            self._stack.unkeep(keys)
            raise
        if old is not None:
            self._end_session(old, drop_tail=bool(old.keys) and old.keys[-1] not in keys)
        future = self._start_save(keys, ids)
        with self._handles_lock:
            self._session_saves[session_id] = future
        return future

    def restore_session(
        self, session_id: str, device_block_ids: Any, *, timeout: float | None = None
    ) -> SessionRestore:
        """Loads an offloaded session's KV into ``device_block_ids`` (one per block of its
        tokens, the partial last block included) and ends the session; its full blocks stay
        cached as ordinary prefix blocks."""
        self._check_open()
        session_id = _check_session_id(session_id)
        record = self._sessions.get(session_id)
        if record is None:
            raise SessionNotFoundError(
                f"session_id: no offloaded session {session_id!r} (never offloaded, already "
                "restored, or dropped)"
            )
        ids = self._check_block_ids(device_block_ids, len(record.keys), at_most=False)
        self._check_writable(ids)
        with self._handles_lock:
            saving = self._session_saves.pop(session_id, None)
        if saving is not None:
            saving.result(timeout)  # the offload's own save must land first
        keys = list(record.keys)
        start = time.perf_counter()
        self._stack.pin(keys)
        try:
            loaded, _ = self._load_keys(keys, ids)
        finally:
            self._stack.unpin(keys)
        seconds = time.perf_counter() - start
        if self._sessions.pop(session_id) is not None:
            self._end_session(record, drop_tail=True)
        tokens = record.tokens
        loaded_tokens = min(loaded * self.block_size, len(tokens))
        return SessionRestore(
            session_id, tokens, loaded_tokens, loaded * self.layout.payload_bytes, seconds
        )

    def restore_session_async(
        self, session_id: str, device_block_ids: Any
    ) -> concurrent.futures.Future[SessionRestore]:
        return self._submit(self.restore_session, session_id, device_block_ids)

    def drop_session(self, session_id: str) -> None:
        """Forgets an offloaded session; its full blocks stay cached as ordinary blocks."""
        self._check_open()
        session_id = _check_session_id(session_id)
        record = self._sessions.pop(session_id)
        if record is None:
            raise SessionNotFoundError(f"session_id: no offloaded session {session_id!r}")
        with self._handles_lock:
            saving = self._session_saves.pop(session_id, None)
        if saving is not None:
            concurrent.futures.wait([saving])
        self._end_session(record, drop_tail=True)

    def sessions(self) -> list[str]:
        """Ids of the offloaded sessions (including those found after a restart)."""
        return [r.session_id for r in self._sessions.all()]

    def _end_session(self, record: SessionRecord, *, drop_tail: bool) -> None:
        self._stack.unkeep(list(record.keys))
        n_full = len(record.tokens) // self.block_size
        if drop_tail and len(record.keys) > n_full:  # the tail block serves nobody else
            self._stack.delete_everywhere([record.keys[-1]])


def _check_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str) or not 1 <= len(session_id) <= 256:
        raise InvalidArgumentError(
            f"session_id: expected a string of 1 to 256 characters, got {session_id!r}"
        )
    return session_id
