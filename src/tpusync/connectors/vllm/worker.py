"""The worker side of the vLLM connector: it owns the KV store over vLLM's KV tensors, answers
the scheduler's lookups (pinning what it found), and loads and saves blocks as each step's
metadata says (docs/decisions/0008-vllm-store-owner.md)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from typing import Any

from tpusync.connectors.vllm.events import BlockEventLog
from tpusync.connectors.vllm.lookup_service import LookupServer
from tpusync.connectors.vllm.metadata import LoadSpec, TpuSyncMetadata
from tpusync.connectors.vllm.settings import ConnectorSettings
from tpusync.errors import InvalidArgumentError, TpuSyncError
from tpusync.kv import KVCacheStore, LookupResult
from tpusync.memory import TorchPool

__all__ = ["WorkerSide", "local_worker"]

log = logging.getLogger("tpusync.connectors.vllm")

SAVE_COPY_TIMEOUT_S = 60.0
# engine id -> the worker side in this process (scheduler and worker in one process)
_LOCAL: dict[str, WorkerSide] = {}
_LOCAL_LOCK = threading.Lock()


def local_worker(engine_id: str) -> WorkerSide | None:
    """The worker side of ``engine_id`` in this process, if it runs here."""
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


class WorkerSide:
    """Owns the store of one engine's worker (one tensor-parallel rank)."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.store: KVCacheStore | None = None
        self._server: LookupServer | None = None
        self._lock = threading.Lock()
        self._pins: dict[str, tuple[int, LookupResult]] = {}  # req_id -> (sequence, handle)
        self._loading: dict[str, tuple[concurrent.futures.Future[Any], list[int]]] = {}
        self._load_errors: set[int] = set()
        self._failed_now: set[str] = set()  # requests whose load failed this step
        self._durable: set[concurrent.futures.Future[Any]] = set()
        self.events = BlockEventLog(settings.store.block_size)

    # --- setup -------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Opens the store over vLLM's KV tensors (one pool per layer, in the engine's order)
        and starts answering lookups."""
        if self.store is not None:
            raise InvalidArgumentError("kv_caches: this connector's KV tensors are registered")
        if not kv_caches:
            raise InvalidArgumentError("kv_caches: vLLM registered no KV tensors")
        pools = [TorchPool(tensor, name=name) for name, tensor in kv_caches.items()]
        self.store = KVCacheStore(self.settings.store, pools)
        self.store.add_block_listener(self.events.heard)
        try:
            self._server = LookupServer(self.settings.socket_path, self.answer, self.release)
        except BaseException:
            self.store.close()
            self.store = None
            raise
        with _LOCAL_LOCK:
            _LOCAL[self.settings.engine_id] = self
        log.info(
            "tpusync vllm: store open over %d KV tensors (%d blocks, %d bytes a block), "
            "lookups on %s",
            len(pools),
            self.store.num_device_blocks,
            self.store.layout.payload_bytes,
            self.settings.socket_path,
        )

    # --- lookups (any thread) ---------------------------------------------------------------

    def answer(self, req_id: str, sequence: int, block_hashes: list[bytes]) -> tuple[int, bool]:
        """Pins the leading blocks of ``block_hashes`` the store holds, under ``req_id``
        (replacing an earlier lookup of it); returns (blocks, whether any is below DRAM)."""
        store = self.store
        if store is None:
            return 0, False
        result = store.lookup_engine_blocks(block_hashes)
        if result.num_blocks:  # a block promoted to DRAM is then named in its event
            self.events.learn(list(result.keys), block_hashes[: result.num_blocks])
        with self._lock:
            old = self._pins.pop(req_id, None)
            if result.num_blocks:
                self._pins[req_id] = (sequence, result)
        if old is not None:
            self._drop(old[1])
        if not result.num_blocks:
            store.release(result)
            return 0, False
        return result.num_blocks, any(tier != "dram" for tier in result.tiers)

    def release(self, req_id: str, sequence: int = 0) -> None:
        """Drops the pins of ``req_id``'s lookup ``sequence`` (0: whichever it holds)."""
        with self._lock:
            held = self._pins.get(req_id)
            if held is None or (sequence and held[0] != sequence):
                return
            del self._pins[req_id]
        self._drop(held[1])

    def _drop(self, result: LookupResult) -> None:
        store = self.store
        if store is not None and result.open:
            with contextlib.suppress(TpuSyncError):  # consumed meanwhile: nothing held
                store.release(result)

    def _take(self, spec: LoadSpec) -> LookupResult | None:
        with self._lock:
            held = self._pins.get(spec.req_id)
            if held is None or held[0] != spec.sequence:
                return None
            del self._pins[spec.req_id]
            return held[1]

    # --- a step ------------------------------------------------------------------------------

    def start_load(self, meta: TpuSyncMetadata) -> None:
        """Releases what the scheduler gave up, then runs this step's loads: a DRAM hit now
        (before the forward that reads it), a hit below DRAM in the background."""
        self._failed_now.clear()
        for req_id, sequence in meta.releases:
            self.release(req_id, sequence)
        store = self.store
        for spec in meta.loads:
            result = self._take(spec) if store is not None else None
            if result is None:  # lost the pins (no answer in time, a restart): recompute
                self._failed(spec.req_id, spec.block_ids)
                if spec.is_async:
                    self._loading[spec.req_id] = (_done(None), [])
                continue
            assert store is not None
            ids = spec.block_ids[: result.num_blocks]
            missing = spec.block_ids[len(ids) :]
            if missing:
                self._failed(spec.req_id, missing)
            if spec.is_async:
                self._loading[spec.req_id] = (store.load_async(result, ids), ids)
                continue
            try:
                loaded = store.load(result, ids).loaded_blocks
            except TpuSyncError as error:
                log.warning("tpusync vllm: load of %s failed: %s", spec.req_id, error)
                self._drop(result)
                loaded = 0
            if loaded < len(ids):
                self._failed(spec.req_id, ids[loaded:])

    def _failed(self, req_id: str, block_ids: list[int]) -> None:
        self._failed_now.add(req_id)
        self._load_errors.update(block_ids)

    def save(self, meta: TpuSyncMetadata) -> None:
        """Saves the blocks that became full this step, and returns once they are copied out
        of vLLM's tensors (vLLM may reuse the blocks after the step); the writes to DRAM's
        index and the lower tiers finish in the background. A request whose load failed this
        step saves nothing: its KV was computed over blocks it did not have."""
        store = self.store
        if store is None or not meta.saves:
            return
        started = []
        for spec in meta.saves:
            if spec.req_id in self._failed_now:
                continue
            try:
                keys = store.scheme.engine_keys(store.namespace, spec.block_hashes)  # type: ignore[attr-defined]
                # before the save: its "stored" event may come before it returns
                self.events.learn(keys, spec.block_hashes, spec.parent_hash, spec.token_ids or None)
                started.append(store.save_engine_blocks_async(spec.block_hashes, spec.block_ids))
            except TpuSyncError as error:
                log.warning("tpusync vllm: save of %s refused: %s", spec.req_id, error)
        for future in started:
            try:
                future.released.result(timeout=SAVE_COPY_TIMEOUT_S)
            except Exception as error:  # the save failed: those blocks are simply not stored
                log.warning("tpusync vllm: a save failed: %s", error)
            if not future.done():
                self._durable.add(future)
                future.add_done_callback(self._durable.discard)

    def finished_loads(self) -> set[str]:
        """Requests whose background loads are done (good or not) since the last call; failed
        blocks are in :meth:`take_load_errors` no later than this."""
        done = set()
        for req_id, (future, ids) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            done.add(req_id)
            error = future.exception()
            loaded = (
                0 if error is not None or future.result() is None else future.result().loaded_blocks
            )
            if error is not None:
                log.warning("tpusync vllm: background load of %s failed: %s", req_id, error)
            if loaded < len(ids):
                self._load_errors.update(ids[loaded:])
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops lookups, waits for loads and saves, releases every pin and closes the store."""
        with _LOCAL_LOCK:
            if _LOCAL.get(self.settings.engine_id) is self:
                del _LOCAL[self.settings.engine_id]
        if self._server is not None:
            self._server.close()
            self._server = None
        store, self.store = self.store, None
        if store is None:
            return
        store.remove_block_listener(self.events.heard)
        for future, _ in self._loading.values():
            concurrent.futures.wait([future], timeout=SAVE_COPY_TIMEOUT_S)
        self._loading.clear()
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for _, result in pins:
            if result.open:
                store.release(result)
        store.flush(timeout=SAVE_COPY_TIMEOUT_S)
        store.close()


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future
