"""The worker side of the vLLM connector: it owns the KV store over vLLM's KV tensors, answers
the scheduler's lookups (pinning what it found), and loads and saves blocks as each step's
metadata says (docs/decisions/0008-vllm-connector-processes.md)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, cast

from tpusync._src.cluster.registry import RemoteRegistry
from tpusync._src.cluster.serving import serve
from tpusync._src.connectors.vllm import switch_interval
from tpusync._src.connectors.vllm.events import BlockEventLog
from tpusync._src.connectors.vllm.lookup_service import LookupServer
from tpusync._src.connectors.vllm.metadata import LoadSpec, TpuSyncMetadata
from tpusync._src.connectors.vllm.settings import ConnectorSettings
from tpusync._src.connectors.vllm.stats import StatsCounter
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.results import LayerLoad, LookupResult
from tpusync._src.kv.store import KVCacheStore
from tpusync._src.memory.openmp_team import openmp_team
from tpusync._src.memory.torch_tensors import TorchPool, prefault_cpu_tensors
from tpusync.errors import InvalidArgumentError, TpuSyncError

__all__ = ["WorkerSide", "local_worker"]

log = logging.getLogger("tpusync.connectors.vllm")

CLOSE_TIMEOUT_S = 60.0
# How long a step without a forward waits for a background load before it answers vLLM. Such
# steps come back to back while a request waits for its KV; waiting with the GIL released lets
# the load's thread run instead of queueing for the GIL behind the engine loop. A request that
# arrives meanwhile waits at most this long.
IDLE_STEP_WAIT_S = 0.02
MAX_RELEASED = 1 << 16
# engine id -> the worker side in this process (scheduler and worker in one process)
_LOCAL: dict[str, WorkerSide] = {}
_LOCAL_LOCK = threading.Lock()


def local_worker(engine_id: str) -> WorkerSide | None:
    """The worker side of ``engine_id`` in this process, if it runs here."""
    with _LOCAL_LOCK:
        return _LOCAL.get(engine_id)


class WorkerSide:
    """Owns the store of one engine's worker (one tensor-parallel rank)."""

    def __init__(self, settings: ConnectorSettings, num_blocks: int | None = None) -> None:
        self.settings = settings
        self.num_blocks = num_blocks  # vLLM's, when it said (every KV tensor must have them)
        self.store: KVCacheStore | None = None
        self._server: LookupServer | None = None
        self._lock = threading.Lock()
        self._pins: dict[str, tuple[int, LookupResult]] = {}  # req_id -> (sequence, handle)
        # req_id -> the highest lookup sequence released (bounded: least recent dropped)
        self._released: collections.OrderedDict[str, int] = collections.OrderedDict()
        # req_id -> (its background load, the block ids, the handle it consumes)
        self._loading: dict[str, tuple[concurrent.futures.Future[Any], list[int], Any]] = {}
        self._loading_tiers: dict[str, tuple[str, ...]] = {}  # where their blocks were found
        # this step's DRAM hits loading layer by layer: (spec, block ids, handle, load)
        self._layer_loads: list[tuple[LoadSpec, list[int], LookupResult, LayerLoad]] = []
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> the store's pool index
        self.by_layer = False  # whether DRAM hits load layer by layer (set at register)
        self.prefaulted_bytes = 0  # of vLLM's CPU KV memory, mapped at register
        self.layer_loads = 0  # layer-by-layer loads ended (for stats and tests)
        self.team_loads = 0  # loads copied on the forward thread's OpenMP team
        self.unknown_layers: set[str] = set()  # layer names waited for that no pool has
        self._load_errors: set[int] = set()
        self._sync_failure = False  # a load this step's forward reads failed
        self._idle_step = False  # this step runs no forward (set by start_load)
        self._durable: set[concurrent.futures.Future[Any]] = set()
        self._registry: Any = None  # the registry ``serve`` lists this worker's DRAM in
        self._holds_switch_interval = False
        self.events = BlockEventLog(settings.store.block_size, _capacity_blocks(settings.store))
        # the last loads (the store's LoadResults): for logs, stats and benchmarks
        self.recent_loads: collections.deque[Any] = collections.deque(maxlen=1024)
        self.stats = StatsCounter()  # for vLLM's connector stats

    # --- setup -------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Opens the store over vLLM's KV tensors (one pool per layer, in the engine's order)
        and starts answering lookups."""
        if self.store is not None:
            raise InvalidArgumentError("kv_caches: this connector's KV tensors are registered")
        if not kv_caches:
            raise InvalidArgumentError("kv_caches: vLLM registered no KV tensors")
        for name, tensor in kv_caches.items():
            if self.num_blocks is not None and (
                not tensor.dim() or int(tensor.shape[0]) != self.num_blocks
            ):
                raise InvalidArgumentError(
                    f"kv_caches[{name!r}]: shape {tuple(tensor.shape)} does not index vLLM's "
                    f"{self.num_blocks} blocks on axis 0; TpuSyncConnector knows vLLM's CPU "
                    "layout [num_blocks, kv_heads, block_size, 2*head_dim]"
                )
        pools = [TorchPool(tensor, name=name) for name, tensor in kv_caches.items()]
        wanted = self.settings.load_by_layer
        on_cpu = all(tensor.device.type == "cpu" for tensor in kv_caches.values())
        started = time.monotonic()
        touched = prefault_cpu_tensors(kv_caches.values())  # vLLM allocates, never touches
        self.prefaulted_bytes = touched
        if touched:
            log.info(
                "tpusync vllm: %d bytes of vLLM's CPU KV memory mapped in %.2f s",
                touched,
                time.monotonic() - started,
            )
        by_layer = (not on_cpu) if wanted == "auto" else bool(wanted)
        self.open_store(pools, list(kv_caches), by_layer, warm_up=on_cpu)

    def use_settings(self, settings: ConnectorSettings) -> None:
        """Replaces the settings before the store opens (e.g. once the engine's number of
        blocks is known)."""
        if self.store is not None:
            raise InvalidArgumentError("settings: the store is open; settings are fixed now")
        self.settings = settings
        self.events = BlockEventLog(settings.store.block_size, _capacity_blocks(settings.store))

    def open_store(
        self, pools: list[Any], names: list[str], by_layer: bool, *, warm_up: bool = False
    ) -> None:
        """Opens the store over ``pools`` (one per layer, named as the engine names its layers)
        and starts answering lookups; ``by_layer``: DRAM hits load layer by layer;
        ``warm_up``: plans the moves between DRAM and the pools now, not in the first hit's
        step (:meth:`KVCacheStore.warmup`; decision 0004)."""
        self.by_layer = by_layer
        self._layer_index = {name: i for i, name in enumerate(names)}
        self.store = KVCacheStore(self.settings.store, pools)
        self.store.add_block_listener(self.events.heard)
        try:
            if warm_up:  # a re-attached pool's pages are mapped in the background meanwhile
                self.store.warmup(wait_mapped=False)
            self._serve_peers()
            self._server = LookupServer(self.settings.socket_path, self.answer)
        except BaseException:
            self.store.close()
            self.store = None
            if self._registry is not None:
                self._registry.close()
                self._registry = None
            raise
        if self.settings.switch_interval_s is not None:
            switch_interval.hold(self.settings.switch_interval_s)
            self._holds_switch_interval = True
        if self.settings.store.shard_count == 1:  # else the scheduler asks every rank
            with _LOCAL_LOCK:
                _LOCAL[self.settings.engine_id] = self
        log.info(
            "tpusync vllm: store open over %d KV arrays (%d blocks, %d bytes a block), "
            "lookups on %s",
            len(pools),
            self.store.num_device_blocks,
            self.store.layout.payload_bytes,
            self.settings.socket_path,
        )

    def _serve_peers(self) -> None:
        """Serves the DRAM tier to peers and lists it in the registry, when ``serve`` says
        (``store.close()`` stops both)."""
        wanted = self.settings.serve
        if wanted is None or self.store is None:
            return
        secret = self.settings.store.secret
        registry = RemoteRegistry(wanted.registry, secret=secret, tls=wanted.registry_tls)
        self._registry = registry
        server = serve(
            self.store,
            registry,
            wanted.node_id,
            secret=secret,
            host=wanted.host,
            port=wanted.port,
            tls=wanted.tls,
        )
        log.info(
            "tpusync vllm: serving DRAM at %s as %s, listed in %s",
            server.address,
            wanted.node_id,
            wanted.registry,
        )

    # --- lookups (any thread) ---------------------------------------------------------------

    def answer(self, req_id: str, sequence: int, block_hashes: list[bytes]) -> tuple[int, bool]:
        """Pins the leading blocks of ``block_hashes`` the store holds, under ``req_id``
        (replacing an earlier lookup of it); returns (blocks, whether any is below DRAM).

        Answers arrive in any order (a lookup the scheduler gave up on may finish after its
        next one): the highest sequence of a request wins, and a lookup already released (or
        overtaken) pins nothing. A failing lookup is a miss."""
        answered = self._answer(req_id, sequence, block_hashes, in_dram=False)
        return cast(tuple[int, bool], answered)  # a lookup of every tier always answers

    def answer_from_dram(
        self, req_id: str, sequence: int, block_hashes: list[bytes]
    ) -> tuple[int, bool] | None:
        """:meth:`answer` from the store's DRAM index alone
        (:meth:`~tpusync.kv.KVCacheStore.lookup_engine_blocks_in_dram`: no tier below DRAM is
        read and no lookup in progress waited for, so the scheduler asks it on its own thread);
        ``None`` when a lower tier may hold more or the store is busy (ask :meth:`answer`)."""
        return self._answer(req_id, sequence, block_hashes, in_dram=True)

    def _answer(
        self, req_id: str, sequence: int, block_hashes: list[bytes], *, in_dram: bool
    ) -> tuple[int, bool] | None:
        store = self.store
        if store is None:
            return 0, False
        lookup = store.lookup_engine_blocks_in_dram if in_dram else store.lookup_engine_blocks
        try:
            result = lookup(block_hashes)
        except (TpuSyncError, OSError) as error:
            log.warning("tpusync vllm: lookup of %s failed (a miss): %s", req_id, error)
            return 0, False
        return None if result is None else self._pin(req_id, sequence, block_hashes, result)

    def _pin(
        self, req_id: str, sequence: int, block_hashes: list[bytes], result: LookupResult
    ) -> tuple[int, bool]:
        """Keeps ``result`` as ``req_id``'s pins unless a later lookup of it (or its release)
        overtook this one; returns the answer."""
        if not result.num_blocks:
            self._drop(result)
            return 0, False
        with self._lock:
            held = self._pins.get(req_id)
            stale = self._released.get(req_id, 0) >= sequence or (
                held is not None and held[0] > sequence
            )
            if not stale:
                self._pins[req_id] = (sequence, result)
        if stale:
            self._drop(result)
            return 0, False
        if held is not None:
            self._drop(held[1])
        self.events.learn(list(result.keys), block_hashes[: result.num_blocks])
        return result.num_blocks, any(tier != "dram" for tier in result.tiers)

    def pinned_tiers(self, req_id: str) -> tuple[str, ...] | None:
        """The tiers of the blocks ``req_id``'s lookup pinned (None: it pins nothing now)."""
        with self._lock:
            held = self._pins.get(req_id)
        return None if held is None else held[1].tiers

    def release(self, req_id: str, sequence: int) -> None:
        """Drops the pins of ``req_id``'s lookups up to ``sequence``; a lookup up to it that
        answers later pins nothing."""
        with self._lock:
            self._released[req_id] = max(sequence, self._released.pop(req_id, 0))
            while len(self._released) > MAX_RELEASED:
                self._released.popitem(last=False)
            held = self._pins.get(req_id)
            if held is None or held[0] > sequence:
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
        self.finish_layer_loads()  # a step that never asked for its errors: end its loads
        self._sync_failure = False
        self._idle_step = meta.idle
        for req_id, sequence in meta.releases:
            self.release(req_id, sequence)
        store = self.store
        for spec in meta.loads:
            result = self._take(spec) if store is not None else None
            if result is None:  # lost the pins (no answer in time, a restart): recompute
                self._failed(spec, spec.block_ids)
                if spec.is_async:
                    self._loading[spec.req_id] = (_done(None), [], None)
                continue
            assert store is not None
            skip = min(spec.skip_blocks, result.num_blocks)
            ids = spec.block_ids[: result.num_blocks - skip]
            if len(ids) < len(spec.block_ids):
                self._failed(spec, spec.block_ids[len(ids) :])
            if spec.is_async:
                loading = store.load_async(result, ids, skip_blocks=skip)
                self._loading[spec.req_id] = (loading, ids, result)
                self._loading_tiers[spec.req_id] = result.tiers[skip : skip + len(ids)]
                continue
            if self.by_layer:
                layer_load = store.load_by_layer(result, ids, skip_blocks=skip)
                self._layer_loads.append((spec, ids, result, layer_load))
                continue
            try:
                with self._copy_threads() as on_team:
                    done = store.load(result, ids, skip_blocks=skip)
                self.team_loads += on_team
            except TpuSyncError as error:
                self._load_failed(spec, ids, result, error)
                continue
            self._loaded(spec, ids, done, result.tiers[skip:])

    def _copy_threads(self) -> contextlib.AbstractContextManager[bool]:
        """Where a load on the forward's thread copies: on that thread's OpenMP team (PyTorch's
        workers, spinning after the last operator) unless the settings say otherwise."""
        if self.settings.copy_on_openmp_team:
            return openmp_team()
        return contextlib.nullcontext(False)

    def _loaded(self, spec: LoadSpec, ids: list[int], done: Any, tiers: tuple[str, ...]) -> None:
        self._count_load(done, tiers)
        if done.loaded_blocks < len(ids):
            self._failed(spec, ids[done.loaded_blocks :])

    def _count_load(self, done: Any, tiers: tuple[str, ...]) -> None:
        """Counts a load (a LoadResult; ``tiers``: where its blocks were found) for vLLM's
        stats and the benchmarks."""
        self.recent_loads.append(done)
        per_tier: dict[str, int] = {}
        for tier in tiers[: done.loaded_blocks]:
            key = f"hit_tokens.{tier}"
            per_tier[key] = per_tier.get(key, 0) + self.settings.store.block_size
        self.stats.add(loads=1, loaded_bytes=done.bytes, load_seconds=done.seconds, **per_tier)

    def _load_failed(
        self, spec: LoadSpec, ids: list[int], result: LookupResult, error: BaseException
    ) -> None:
        log.warning("tpusync vllm: load of %s failed: %s", spec.req_id, error)
        self._drop(result)  # a load that raises leaves its pins
        self._failed(spec, ids)

    def wait_for_layer(self, layer_name: str) -> None:
        """Returns once this step's DRAM hits have written layer ``layer_name`` (no deadline: a
        load still writing the blocks must not meet a forward, or a later request, reading
        them); a layer the store does not know waits for the whole loads."""
        if not self._layer_loads:
            return
        index = self._layer_index.get(layer_name)
        if index is None:
            self.unknown_layers.add(layer_name)
        for _, _, _, load in self._layer_loads:
            if index is None:
                load.wait()
            else:
                load.wait_for(index)

    def finish_layer_loads(self) -> None:
        """Ends this step's layer-by-layer loads: waits for them, then counts the blocks that
        failed their checksum as load errors (vLLM discards what the step computed from
        them). Safe to call more than once a step."""
        loads, self._layer_loads = self._layer_loads, []
        self.layer_loads += len(loads)
        for spec, ids, result, load in loads:
            try:
                done = load.result()
            except TpuSyncError as error:
                self._load_failed(spec, ids, result, error)
                continue
            self._loaded(spec, ids, done, result.tiers[spec.skip_blocks :])

    def _failed(self, spec: LoadSpec, block_ids: list[int]) -> None:
        self.stats.add(load_failed_blocks=len(block_ids))
        self._load_errors.update(block_ids)
        if not spec.is_async:
            self._sync_failure = True

    def save(self, meta: TpuSyncMetadata) -> None:
        """Saves the blocks that became full this step, and returns once they are copied out
        of vLLM's tensors (vLLM may reuse the blocks after the step: no deadline, a torn copy
        would be a wrong block); the writes to DRAM's index and the lower tiers finish in the
        background.

        After a failed load that this step's forward read, the step saves nothing: other
        requests of the step may have read the failed blocks too (vLLM's own prefix cache
        shares them at once), and their KV would be wrong. vLLM recomputes those requests, and
        the scheduler side saves their blocks again."""
        self.finish_layer_loads()
        store = self.store
        if store is None or not meta.saves:
            return
        if self._sync_failure:
            log.info(
                "tpusync vllm: a load failed this step; its %d saves are skipped", len(meta.saves)
            )
            return
        started = []
        began = time.perf_counter()
        for spec in meta.saves:
            try:
                keys = store.scheme.engine_keys(store.namespace, spec.block_hashes)  # type: ignore[attr-defined]
                # before the save: its "stored" event may come before it returns
                self.events.learn(keys, spec.block_hashes, spec.parent_hash, spec.token_ids or None)
                future = store.save_engine_blocks_async(spec.block_hashes, spec.block_ids)
                started.append((future, len(spec.block_ids)))
            except TpuSyncError as error:
                log.warning("tpusync vllm: save of %s refused: %s", spec.req_id, error)
        saved = 0
        for future, blocks in started:
            try:
                future.released.result()
                saved += blocks
            except Exception as error:  # the save failed: those blocks are simply not stored
                log.warning("tpusync vllm: a save failed: %s", error)
            if not future.done():
                self._durable.add(future)
                future.add_done_callback(self._durable.discard)
        self.stats.add(
            save_seconds=time.perf_counter() - began,
            saved_blocks=saved,
            saved_bytes=saved * store.layout.payload_bytes,
        )

    def take_stats(self) -> dict[str, Any]:
        """vLLM's connector stats since the last call (see :mod:`.stats`)."""
        store = self.store
        tiers = store.stats()["tiers"] if store is not None else {}
        return self.stats.take(tiers)

    def finished_loads(self) -> set[str]:
        """Requests whose background loads are done (good or not) since the last call; failed
        blocks are in :meth:`take_load_errors` no later than this.

        In a step without a forward it first waits up to :data:`IDLE_STEP_WAIT_S` for one of
        them to finish (nothing else waits on this step)."""
        if self._idle_step:
            self._idle_step = False
            pending = [future for future, _, _ in self._loading.values() if not future.done()]
            if pending:
                concurrent.futures.wait(
                    pending, IDLE_STEP_WAIT_S, concurrent.futures.FIRST_COMPLETED
                )
        done = set()
        for req_id, (future, ids, result) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[req_id]
            self._loading_tiers.pop(req_id, None)
            done.add(req_id)
            error = future.exception()
            if error is not None:
                log.warning("tpusync vllm: background load of %s failed: %s", req_id, error)
                if result is not None:
                    self._drop(result)  # a load that raises leaves its pins
            loaded = 0
            if error is None and result is not None:
                done_load = future.result()
                self._count_load(done_load, self._loading_tiers.get(req_id, ()))
                loaded = done_load.loaded_blocks
            if loaded < len(ids):
                self._load_errors.update(ids[loaded:])
        return done

    def take_load_errors(self) -> set[int]:
        self.finish_layer_loads()  # vLLM may ask before the step's save (defer_finalize)
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
        self.finish_layer_loads()  # before the store goes: a failed one releases its pins
        store, self.store = self.store, None
        if store is None:
            return
        store.remove_block_listener(self.events.heard)
        for future, _, result in self._loading.values():
            concurrent.futures.wait([future], timeout=CLOSE_TIMEOUT_S)
            if result is not None and result.open:  # a load that raised left its pins
                store.release(result)
        self._loading.clear()
        self._loading_tiers.clear()
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for _, result in pins:
            if result.open:
                store.release(result)
        store.flush(timeout=CLOSE_TIMEOUT_S)
        store.close()  # and the server and registry node of ``serve``
        if self._holds_switch_interval:  # after the last background work of the store
            switch_interval.release()
            self._holds_switch_interval = False
        if self._registry is not None:
            self._registry.close()
            self._registry = None


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


def _capacity_blocks(config: KVStoreConfig) -> int:
    """The blocks the store's own tiers hold at most (DRAM and every lower tier that says its
    capacity; a store node's or an unbounded shared filesystem's count as none)."""
    specs = [config.dram, *config.tiers]
    capacities = [getattr(spec, "capacity_blocks", None) for spec in specs]
    return sum(c for c in capacities if isinstance(c, int))
