"""KVCacheStore: prefix caching of paged KV blocks across DRAM, /dev/shm, disk and shared FS.

Pins and ownership (the contract, written once):

* :meth:`KVCacheStore.lookup` grants pins: the returned :class:`LookupResult` holds one pin on
  each block of the longest cached prefix, in whichever tier it rests. A pinned block is never
  evicted from any tier, nor dropped by :meth:`KVCacheStore.purge` (a purge drops it at its last
  unpin).
* Exactly one of :meth:`KVCacheStore.load` and :meth:`KVCacheStore.release` consumes the handle
  and drops its pins; using it again raises :class:`~tpusync.errors.StaleHandleError`. A load
  that raises (bad block ids, held blocks, a failed copy) leaves the handle and its pins as they
  were: release it, or retry. A load that finds blocks missing or corrupt is not a failure: it
  loads the good prefix, reports how many tokens it loaded, and the caller recomputes the rest.
  A handle used as a context manager is released on exit unless it was loaded. One garbage
  collected unconsumed, or still open at :meth:`KVCacheStore.close`, is released with a warning.
* :meth:`KVCacheStore.save` holds the device blocks it reads: until its ``released`` future
  completes, transfers into those blocks raise :class:`~tpusync.errors.BlocksHeldError`, and the
  engine must not let its own model steps write them. After ``released`` the blocks are the
  engine's again; the save's result (``durable``) follows when the blocks are committed to DRAM.
* Offloaded sessions keep their blocks from being dropped until restored or dropped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from tpusync._src.kv._engine_calls import EngineBlockCalls
from tpusync._src.kv._handles import OpenHandles, warn_still_open
from tpusync._src.kv._loads import load_keys
from tpusync._src.kv._peer_link import PeerLink, watch_removals
from tpusync._src.kv._session_calls import SessionCalls, session_dir
from tpusync._src.kv._store_calls import BlockPaths, StoreCalls
from tpusync._src.kv._store_checks import (
    check_block_ids,
    check_device_pools,
    check_dram_room,
    check_existing_tier_layouts,
    check_other_pools,
    check_skip_blocks,
    check_tiers,
    check_token_axis,
)
from tpusync._src.kv._streaming import save_through_dram, streams
from tpusync._src.kv._tier_stack import TierStack, present
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.keys import Blake2bChainKeys, KeyScheme, Namespace, check_tokens
from tpusync._src.kv.results import (
    LayerLoad,
    LoadResult,
    LookupResult,
    SaveFuture,
    SaveResult,
    SessionRestore,
    handle_state,
    made_by,
    run_layer_load,
    set_handle_state,
)
from tpusync._src.kv.sessions import SessionManifests
from tpusync._src.memory.device_pool import DevicePool
from tpusync._src.memory.fork_guard import check_same_process
from tpusync._src.memory.torch_tensors import TorchPool
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.dram.pool import unlink_own_file
from tpusync._src.tiers.files import check_directory
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.spec import OpenedTier
from tpusync.errors import (
    InvalidArgumentError,
    NamespaceMismatchError,
    StaleHandleError,
    TpuSyncError,
)

__all__ = ["KVCacheStore"]

log = logging.getLogger("tpusync.kv")
T = TypeVar("T")


class KVCacheStore:
    """Prefix cache of KV blocks over a device pool and the tiers below it.

    Args:
      config: the namespace, tiers and policies (:class:`~tpusync.kv.KVStoreConfig`).
      device_pools: the engine's KV arrays as :class:`~tpusync.DevicePool` (per-layer or
        stacked; K and V together or apart; a torch engine's CPU KV tensors as
        :class:`~tpusync.TorchPool`), every one indexed by block on
        ``config.block_axis`` and holding ``config.block_size`` tokens on
        ``config.token_axis``. A block of the store spans the same block index of every pool.

    Raises :class:`~tpusync.errors.InvalidArgumentError` (or a subclass) before opening
    anything when the configuration contradicts the pools (another block size), an extra tier
    was built for another block layout, or a tier directory is missing without ``create=True``;
    :class:`~tpusync.errors.TierFullError` when an anonymous DRAM tier exceeds the memory
    available.

    Every call has a blocking form and an ``_async`` form returning a future; see the module
    docstring for pins and ownership.
    """

    def __init__(
        self, config: KVStoreConfig, device_pools: Sequence[DevicePool | TorchPool]
    ) -> None:
        if not isinstance(config, KVStoreConfig):
            raise InvalidArgumentError(
                f"config: expected a KVStoreConfig, got {type(config).__name__}"
            )
        self.num_device_blocks = check_device_pools(device_pools, config.block_axis)
        self.config = config
        self.pools = list(device_pools)
        axis = config.block_axis
        check_token_axis(config, self.pools)
        self.layout = PoolLayout.from_pools(config.model_id, self.pools, block_axis=axis)
        check_existing_tier_layouts(config.tiers, self.layout)
        context = dataclasses.replace(config.tier_context, layout=self.layout)
        check_tiers(config, context)  # e.g. a missing directory, a MAC with the default secret
        check_dram_room(config, self.layout)
        self.namespace = Namespace(
            config.model_id,
            self.layout.fingerprint,
            config.weight_version,
            config.shard_rank,
            config.shard_count,
            config.salt,
        )
        self.scheme: KeyScheme = config.key_scheme or Blake2bChainKeys(config.secret)
        self.block_size = config.block_size
        self._closed = False
        self._opened_by = os.getpid()
        self._handles = OpenHandles()  # watched: one dropped unconsumed releases its pins
        self._registry_link: PeerLink | None = None  # see attach_peer_link
        self._server: Any = None  # the BlockServer of tpusync._src.cluster.serving.serve()
        self._saving: set[SaveFuture] = set()  # saves not yet durable (flush waits for them)
        self._handles_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys(
            ["lookups", "lookup_blocks", "hit_blocks", "loads", "loaded_blocks",
             "load_misses", "saves", "saved_blocks", "save_skipped_blocks", "prefetched_blocks"],
            0,
        )  # fmt: skip
        sessions = session_dir(config)
        if sessions is not None and os.path.lexists(sessions):
            check_directory(sessions)  # before any tier is opened: a refusal changes nothing
        opened: list[Any] = []
        try:
            dram = HostPool(
                self.layout,
                config.dram.capacity_blocks,
                name=config.dram.name,
                shm_dir=config.dram.shm_dir,
                populate=config.dram.populate,
                on_mismatch=config.dram.on_mismatch,
            )
            opened.append(dram)
            lower: list[tuple[str, OpenedTier]] = []
            for spec in config.tiers:  # each spec opens its own tier: no branch per kind here
                tier = spec.open(self.layout, context)
                if tier.owned:
                    opened.append(tier.tier)
                lower.append((spec.name, tier))
            self._not_owned = {id(tier.tier) for _, tier in lower if not tier.owned}
            manifests = SessionManifests(  # UnsafeFileError/TierIOError: tiers closed
                sessions,
                owner=(config.model_id, self.layout.fingerprint.hex()),
                block_size=self.block_size,
            )
            self._stack = TierStack(
                dram,
                lower,
                writeback_max_bytes=config.writeback_max_bytes,
                writeback_policy=config.writeback_policy,
            )
        except BaseException:
            if opened and opened[0].path is not None and not opened[0].attached:
                unlink_own_file(opened[0])  # a refused store leaves no new pool behind
            for tier in reversed(opened):
                tier.close()
            raise
        self.dram = dram
        self._paths = BlockPaths(self._stack, self.layout, self.pools, config.path)
        calls = StoreCalls(
            check_open=self._check_open,
            namespace=self._namespace,
            keys=self._keys,
            check_block_ids=self._check_block_ids,
            check_writable=self._check_writable,
            other_pools=self._other_pools,
            lookup_keys=self._lookup_keys,
            opened=self._opened,
            start_save=self._start_save,
            load_keys=self._load_keys,
        )
        self._sessions = SessionCalls(
            calls,
            self._stack,
            manifests,
            scheme=self.scheme,
            block_size=self.block_size,
            block_bytes=self.layout.payload_bytes,
        )
        self._engine_blocks = EngineBlockCalls(
            calls, self._stack, scheme=self.scheme, block_size=self.block_size
        )
        self._calls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="tpusync-kv")
        # layer-by-layer loads start at once: never queued behind saves
        self._layer_calls = concurrent.futures.ThreadPoolExecutor(1, "tpusync-kv-layers")

    # --- validation ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this KVCacheStore is closed; create a new one")
        check_same_process(self._opened_by, "this KVCacheStore")
        self._release_dropped()

    def _release_dropped(self) -> None:
        """Drops the pins of handles collected unconsumed (they warned: see kv._handles)."""
        if self._handles.dropped:  # every call that could see those pins runs this first
            with self._handles_lock:
                keys = self._handles.take_dropped()
            self._stack.unpin(keys)

    def set_weight_version(self, weight_version: str) -> None:
        """Keys name ``weight_version`` from now on (the weights changed): no block saved under
        another version is found again (stale KV is never served across weights)."""
        self.namespace = dataclasses.replace(self.namespace, weight_version=weight_version)

    def _namespace(self, namespace: Namespace | None) -> Namespace:
        if namespace is None:
            return self.namespace
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(
                f"namespace: expected a tpusync.kv.Namespace, got {type(namespace).__name__}"
            )
        own = self.namespace
        for name in ("model_id", "layout_fingerprint", "shard_rank", "shard_count"):
            if getattr(namespace, name) != getattr(own, name):
                raise NamespaceMismatchError(
                    f"namespace: its {name} ({getattr(namespace, name)!r}) differs from this "
                    f"store's ({getattr(own, name)!r}); only weight_version and salt may vary "
                    "per call (use store.namespace with dataclasses.replace)"
                )
        return namespace

    def _keys(self, tokens: Any, namespace: Namespace | None) -> tuple[np.ndarray, list[bytes]]:
        toks = check_tokens(tokens)
        return toks, self.scheme.block_keys(self._namespace(namespace), toks, self.block_size)

    def _check_block_ids(
        self, block_ids: Any, needed: int, *, at_most: bool, num_blocks: int | None = None
    ) -> np.ndarray:
        limit = self.num_device_blocks if num_blocks is None else num_blocks
        return check_block_ids(block_ids, needed, at_most=at_most, limit=limit)

    def _check_writable(self, ids: np.ndarray, pools: list[Any] | None = None) -> None:
        for pool in self.pools if pools is None else pools:
            pool.check_writable(ids, self.config.block_axis, "device_block_ids")

    def _other_pools(self, pools: Any) -> tuple[list[Any], int]:
        return check_other_pools(pools, self.config, self.layout)

    def _check_handle(self, result: Any) -> LookupResult:
        if not isinstance(result, LookupResult):
            raise InvalidArgumentError(
                f"result: expected the LookupResult of lookup(), got {type(result).__name__}"
            )
        if not made_by(result, self):
            raise StaleHandleError("result: this handle belongs to another KVCacheStore")
        if handle_state(result) != "open":
            raise StaleHandleError(
                f"result: this handle was already {handle_state(result)}; look the tokens up again"
            )
        return result

    def _count(self, **counts: int) -> None:
        with self._counters_lock:
            for name, value in counts.items():
                self._counters[name] += value

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        self._check_open()
        return self._calls.submit(fn, *args)

    # --- lookup, load, release -------------------------------------------------------------

    def lookup(self, tokens: Any, *, namespace: Namespace | None = None) -> LookupResult:
        """The longest prefix of ``tokens`` cached in any tier, with its blocks pinned."""
        self._check_open()
        toks, keys = self._keys(tokens, namespace)
        agreed = self._shards_agree(toks, namespace, len(keys))
        return self._lookup_keys(keys[:agreed], len(toks), len(keys))

    def _lookup_keys(self, keys: list[bytes], total_tokens: int, asked: int) -> LookupResult:
        stack = self._stack
        with stack.lock:
            # a hit longer than DRAM loads through it chunk by chunk (see _streaming)
            where = stack.locate(keys, prefix=True)
            hit = keys[: len(where)]
            stack.pin(hit)
        return self._opened(hit, [stack.names[t] for t in where], total_tokens, asked)

    def _opened(
        self, hit: list[bytes], tiers: list[str], total_tokens: int, asked: int
    ) -> LookupResult:
        """The handle of a lookup whose ``hit`` is pinned (``tiers[i]``: where block i is)."""
        result = LookupResult(
            cached_tokens=len(hit) * self.block_size,
            total_tokens=total_tokens,
            keys=tuple(hit),
            tiers=tuple(tiers),
            _store=self,
        )
        with self._handles_lock:
            self._handles.add(result)
        self._count(lookups=1, lookup_blocks=asked, hit_blocks=len(hit))
        return result

    def _shards_agree(self, tokens: np.ndarray, namespace: Namespace | None, n: int) -> int:
        """With tensor parallelism (``shard_count > 1``) and a peer link (a registry, see
        :mod:`tpusync._src.cluster.serving`),
        how many leading blocks every other shard holds too (per the registry): a block counts
        only where all shards have it, since each shard stores only its own part. Without a
        registry, the local tiers alone decide."""
        ns = self._namespace(namespace)
        link = self._registry_link
        if ns.shard_count <= 1 or link is None:
            return n
        others = [
            self.scheme.block_keys(
                dataclasses.replace(ns, shard_rank=rank), tokens, self.block_size
            )
            for rank in range(ns.shard_count)
            if rank != ns.shard_rank
        ]
        try:
            return link.common_prefix(others)
        except (TpuSyncError, OSError) as error:  # no answer: no agreement, a miss
            log.warning("tpusync kv: registry lookup for the other shards failed: %s", error)
            return 0

    def lookup_async(
        self, tokens: Any, *, namespace: Namespace | None = None
    ) -> concurrent.futures.Future[LookupResult]:
        toks = check_tokens(tokens)
        self._namespace(namespace)
        return self._submit(lambda: self.lookup(toks, namespace=namespace))

    def release(self, result: LookupResult) -> None:
        """Drops a handle's pins without loading (consumes it)."""
        self._check_handle(result)
        self._release_dropped()
        self._finish(result, "released")

    def _claim(self, result: LookupResult) -> None:
        """Marks a handle as being loaded, atomically: a second load or a release of it now
        raises StaleHandleError instead of racing this one."""
        with self._handles_lock:
            state = handle_state(result)
            if state != "open":
                raise StaleHandleError(
                    f"result: this handle was already {state}; look the tokens up again"
                )
            set_handle_state(result, "loading")

    def _finish(self, result: LookupResult, state: str, *, claimed: bool = False) -> None:
        with self._handles_lock:
            if handle_state(result) != ("loading" if claimed else "open"):
                raise StaleHandleError(f"result: this handle was already {handle_state(result)}")
            set_handle_state(result, state)
            self._handles.remove(result)
        self._stack.unpin(list(result.keys))

    def load(
        self,
        result: LookupResult,
        device_block_ids: Any,
        *,
        pools: Any = None,
        skip_blocks: int = 0,
    ) -> LoadResult:
        """Loads the hit's blocks into ``device_block_ids`` (one per cached block, in order;
        fewer loads only the first ones) and consumes the handle.

        ``skip_blocks``: the hit's first blocks that are not loaded (their positions need no
        KV: a sliding-window layer's blocks that fell out of its window); ``device_block_ids``
        then holds one id per block from there on, and the result counts only those.

        ``pools``: other pools of this store's block layout to load into (e.g. an engine's
        staging buffer; any number of blocks); default: the store's own.

        Blocks found only in lower tiers are promoted into DRAM first (a hit longer than DRAM
        holds passes through it in chunks), except a hit that one tier able to land blocks in
        place alone holds (a store node, the cluster's peers, the disk tier), loaded into CPU
        torch tensors: it lands straight in them and is not kept in DRAM
        (``direct_loads`` in :meth:`stats`); a block that one tier fails to serve (its checksum
        fails) is read from the next tier that has it. Returns how many tokens were loaded: all
        cached ones, unless blocks were lost or failed their checksum in every tier holding them
        (a miss, counted; the blocks after the first miss are not loaded)."""
        return self._load(result, device_block_ids, None, pools, skip_blocks)

    def _load(
        self,
        result: LookupResult,
        device_block_ids: Any,
        after_pool: Callable[[int], None] | None,
        pools: Any = None,
        skip_blocks: int = 0,
    ) -> LoadResult:
        self._check_open()
        self._check_handle(result)
        check_skip_blocks(skip_blocks, result.num_blocks)
        count = None
        if pools is not None:
            pools, count = self._other_pools(pools)
        ids = self._check_block_ids(
            device_block_ids, result.num_blocks - skip_blocks, at_most=True, num_blocks=count
        )
        self._check_writable(ids, pools)
        self._claim(result)
        start = time.perf_counter()
        keys = list(result.keys[skip_blocks : skip_blocks + len(ids)])
        try:
            loaded, promoted = self._load_keys(keys, ids, after_pool, pools)
        except BaseException:
            with self._handles_lock:
                set_handle_state(result, "open")  # a failed load leaves the handle and its pins
            raise
        seconds = time.perf_counter() - start
        self._finish(result, "loaded", claimed=True)
        self._count(loads=1, loaded_blocks=loaded, load_misses=len(keys) - loaded)
        return LoadResult(
            loaded_tokens=loaded * self.block_size,
            loaded_blocks=loaded,
            requested_blocks=len(keys),
            bytes=loaded * self.layout.payload_bytes,
            seconds=seconds,
            promoted_blocks=promoted,
        )

    def load_async(
        self, result: LookupResult, device_block_ids: Any, *, skip_blocks: int = 0
    ) -> concurrent.futures.Future[LoadResult]:
        self._check_handle(result)
        return self._submit(
            functools.partial(self.load, skip_blocks=skip_blocks), result, device_block_ids
        )

    def _load_keys(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        after_pool: Callable[[int], None] | None = None,
        pools: list[Any] | None = None,
    ) -> tuple[int, int]:
        return load_keys(self._paths, keys, ids, after_pool, pools)

    def load_by_layer(
        self, result: LookupResult, device_block_ids: Any, *, skip_blocks: int = 0
    ) -> LayerLoad:
        """:meth:`load` in the background, filling the device pools one after another (in the
        order this store was given them: an engine's layers) so that a reader of pool ``i``
        may start before the later ones are written (:meth:`LayerLoad.wait_for`). Blocks are
        readable before their checksums are compared; :meth:`LayerLoad.result` says which are
        valid, and a failed block is not read again from a lower tier (recompute it).
        ``skip_blocks`` as in :meth:`load`."""
        self._check_open()
        self._check_handle(result)
        load = LayerLoad(len(self.pools))
        self._layer_calls.submit(
            run_layer_load,
            load,
            lambda after: self._load(result, device_block_ids, after, None, skip_blocks),
        )
        return load

    # --- save ------------------------------------------------------------------------------

    def save(
        self, tokens: Any, device_block_ids: Any, *, namespace: Namespace | None = None
    ) -> SaveResult:
        """Saves the KV of every full block of ``tokens`` (``device_block_ids[i]`` holds block
        ``i``; ids past the full blocks are ignored) and waits until it is durable in DRAM.

        A save of more blocks than DRAM holds streams through it: chunk by chunk, each written
        into the lower tiers before the next (it is then durable there, and DRAM keeps the last
        chunk). Without a writable lower tier such a save raises ``TierFullError``; when no
        lower tier takes a chunk, the save stops after it (``stored_blocks`` says how many)."""
        return self.save_async(tokens, device_block_ids, namespace=namespace).result()

    def save_async(
        self, tokens: Any, device_block_ids: Any, *, namespace: Namespace | None = None
    ) -> SaveFuture:
        """Starts a save; see :class:`SaveFuture` for its two completions."""
        self._check_open()
        _, keys = self._keys(tokens, namespace)
        ids = self._check_block_ids(device_block_ids, len(keys), at_most=False)
        return self._start_save(keys, ids)

    def _start_save(
        self, keys: list[bytes], ids: np.ndarray, pools: list[Any] | None = None
    ) -> SaveFuture:
        pools = self.pools if pools is None else pools
        future = SaveFuture()
        if self._stack.touch_if_all_local(keys):
            # e.g. an engine saving the prompt its own prefix cache served: no hold, no copy and
            # no hop to a worker thread on the caller's critical path
            future.released.set_result(None)
            self._count(saves=1, saved_blocks=0, save_skipped_blocks=len(keys))
            future.set_result(SaveResult(0, len(keys), 0, 0.0))
            return future
        for pool in pools:
            pool.hold_blocks(ids, self.config.block_axis)
        with self._handles_lock:
            self._saving.add(future)
        future.add_done_callback(self._save_done)
        try:
            self._calls.submit(self._run_save, keys, ids, future, pools)
        except BaseException as error:
            self._release_blocks(ids, future, pools)
            future.set_exception(error)
            raise
        return future

    def _save_done(self, future: SaveFuture) -> None:
        with self._handles_lock:
            self._saving.discard(future)

    def _release_blocks(self, ids: np.ndarray, future: SaveFuture, pools: list[Any]) -> None:
        for pool in pools:
            pool.release_blocks(ids, self.config.block_axis)
        if not future.released.done():
            future.released.set_result(None)

    def _run_save(
        self, keys: list[bytes], ids: np.ndarray, future: SaveFuture, pools: list[Any]
    ) -> None:
        start = time.perf_counter()
        stack = self._stack
        admitted = streamed = 0
        try:
            with stack.lock:
                # another node's copy does not count: it may go away at any time
                where = stack.locate(keys, prefix=False, local=True, probe=False)
            fresh = [i for i, t in enumerate(where) if t < 0]
            for t in set(where) - {-1}:
                stack.touch(t, [k for k, w in zip(keys, where, strict=True) if w == t])
            new_keys, new_ids = [keys[i] for i in fresh], ids[fresh]
            if streams(self._paths, len(new_keys), save=True):  # more than DRAM: chunk by chunk
                streamed, rest = save_through_dram(self._paths, new_keys, new_ids, pools)
                rest = len(new_keys) if rest is None else rest
                new_keys, new_ids = new_keys[rest:], new_ids[rest:]
            if stack.writeback.admit(len(new_keys)):
                admitted = len(new_keys)
            stored = []
            if new_keys:
                with stack.room(0, len(new_keys)):
                    self.dram.put_from_device(new_keys, pools, new_ids, path=self.config.path)
                stored = present(self.dram, new_keys)
                stack.touch(0, stored)
                stack.dram_added(stored)
        except BaseException as error:
            self._release_blocks(ids, future, pools)
            if admitted:
                stack.writeback.enqueue([], admitted)
            future.set_exception(error)
            return
        self._release_blocks(ids, future, pools)
        if admitted:
            stack.writeback.enqueue(stored, admitted)
        n_stored = streamed + len(stored)
        self._count(saves=1, saved_blocks=n_stored, save_skipped_blocks=len(keys) - len(fresh))
        future.set_result(
            SaveResult(
                stored_blocks=n_stored,
                skipped_blocks=len(keys) - len(fresh),
                bytes=n_stored * self.layout.payload_bytes,
                seconds=time.perf_counter() - start,
            )
        )

    # --- prefetch --------------------------------------------------------------------------

    def prefetch(
        self, tokens: Any, *, namespace: Namespace | None = None
    ) -> concurrent.futures.Future[int]:
        """Starts moving the cached prefix of ``tokens`` up into DRAM (from disk or shared FS)
        ahead of a lookup and load; the future answers how many of its blocks DRAM then holds."""
        self._check_open()
        _, keys = self._keys(tokens, namespace)
        return self._submit(self._run_prefetch, keys)

    def _run_prefetch(self, keys: list[bytes]) -> int:
        stack = self._stack
        with stack.lock:  # DRAM holds at most its capacity of them
            hit = keys[: min(len(stack.locate(keys, prefix=True)), self.dram.capacity)]
            stack.pin(hit)
        try:
            in_dram, _ = stack.promote(hit)
        finally:
            stack.unpin(hit)
        n = next((i for i, ok in enumerate(in_dram) if not ok), len(hit))
        self._count(prefetched_blocks=n)
        return n

    # --- peers: what tpusync._src.cluster.serving attaches
    # -----------------------------------------

    # --- offloaded sessions (kv/_session_calls.py) ---------------------------------------

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
        return self._sessions.offload_async(session_id, tokens, device_block_ids, namespace)

    def restore_session(
        self, session_id: str, device_block_ids: Any, *, timeout: float | None = None
    ) -> SessionRestore:
        """Loads an offloaded session's KV into ``device_block_ids`` (one per block of its
        tokens, the partial last block included) and ends the session; its full blocks stay
        cached as ordinary prefix blocks."""
        return self._sessions.restore(session_id, device_block_ids, timeout)

    def restore_session_async(
        self, session_id: str, device_block_ids: Any
    ) -> concurrent.futures.Future[SessionRestore]:
        """:meth:`restore_session` on the store's threads."""
        return self._submit(self.restore_session, session_id, device_block_ids)

    def drop_session(self, session_id: str) -> None:
        """Forgets an offloaded session; its full blocks stay cached as ordinary blocks."""
        self._sessions.drop(session_id)

    def sessions(self) -> list[str]:
        """Ids of the offloaded sessions (including those found after a restart)."""
        return self._sessions.ids()

    def session_tokens(self, session_id: str) -> np.ndarray:
        """The tokens of an offloaded session (a copy): what sizes the device blocks
        :meth:`restore_session` needs. Raises :class:`~tpusync.errors.SessionNotFoundError`
        when there is none."""
        self._check_open()
        return self._sessions.tokens(session_id)

    # --- blocks an engine hashed itself, block events (kv/_engine_calls.py) ---------------

    def lookup_engine_blocks(
        self, block_hashes: Sequence[bytes], *, namespace: Namespace | None = None
    ) -> LookupResult:
        """:meth:`lookup` for blocks the engine has hashed itself (vLLM's
        ``Request.block_hashes``, each naming its whole prefix): the leading run of them cached
        in any tier, pinned. Keys are the engine's hashes under this store's keyed namespace
        (:meth:`~tpusync.kv.Blake2bChainKeys.engine_keys`), so they are the same in every
        process whose engine hashes the same way. (Tensor-parallel shards agree through a
        registry only on token lookups: here each shard answers for itself.)"""
        return self._engine_blocks.lookup(block_hashes, namespace)

    def lookup_engine_blocks_in_dram(
        self, block_hashes: Sequence[bytes], *, namespace: Namespace | None = None
    ) -> LookupResult | None:
        """:meth:`lookup_engine_blocks` answered from the DRAM tier's index alone: the hit,
        pinned, when DRAM holds every one of the blocks, or (a store without tiers below DRAM)
        DRAM's leading run of them, the whole answer there. ``None`` when a lower tier may hold
        more, or when the store's lock is held (a lower tier may be answering a lookup over the
        network): then ask :meth:`lookup_engine_blocks`. It reads no tier below DRAM and only
        tries the store's lock, so it never waits for another lookup: a caller that must not
        block on I/O (an engine's scheduler) may call it on its own thread."""
        return self._engine_blocks.lookup_in_dram(block_hashes, namespace)

    def save_engine_blocks_async(
        self,
        block_hashes: Sequence[bytes],
        device_block_ids: Any,
        *,
        namespace: Namespace | None = None,
        pools: Any = None,
    ) -> SaveFuture:
        """:meth:`save_async` for blocks the engine has hashed itself (see
        :meth:`lookup_engine_blocks`): ``device_block_ids[i]`` holds the block of
        ``block_hashes[i]``; blocks already stored are skipped. ``pools``: other pools of
        this store's block layout to save from (e.g. a staging buffer); default: the
        store's own."""
        return self._engine_blocks.save_async(block_hashes, device_block_ids, namespace, pools)

    def add_block_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        """Calls ``listener(kind, tier, keys)`` whenever blocks are stored in (``"stored"``) or
        removed from (``"removed"``: evicted, dropped as corrupt, purged) a tier of this store
        (``tier`` is its name: ``"dram"``, ``"disk"``, ...); a block moving between tiers is a
        store in one and, when it leaves, a removal from the other. Called on the thread that
        changed the tier, without the store's locks: keep it short (e.g. queue the event). An
        exception in it is logged and ignored."""
        self._engine_blocks.add_listener(listener)

    def remove_block_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        """Stops calling ``listener`` (added with :meth:`add_block_listener`)."""
        self._engine_blocks.remove_listener(listener)

    def check_peer_link_free(self) -> None:
        """Raises InvalidArgumentError when the store is closed or already has a peer link
        (:meth:`attach_peer_link`): what a caller checks before it starts a server."""
        self._check_open()
        if self._registry_link is not None:
            raise InvalidArgumentError("registry: this store already publishes to a registry")

    def attach_peer_link(
        self, link: PeerLink, *, server: Any = None, include_disk: bool = False
    ) -> None:
        """Tells ``link`` of every block DRAM adds and drops (with ``include_disk``, a block
        leaves the link only when neither DRAM nor the disk tier holds it), asks it whether
        the other shards hold a block (tensor parallelism), and closes ``server`` (anything
        with ``close()``: the peers' server) and then ``link`` at :meth:`close`. One link per
        store. :mod:`tpusync._src.cluster.serving` is the caller."""
        self.check_peer_link_free()
        self._registry_link, self._server = link, server
        stack = self._stack
        stack.on_dram_added = link.added
        watch_removals(stack, link, include_disk)

    def peer_keys(self, *, include_disk: bool = False) -> list[bytes]:
        """Every key DRAM holds (with ``include_disk``: or the disk tier): what a peer link
        publishes at its start and after a lapse."""
        keys = dict.fromkeys(self.dram.keys())
        if include_disk and "disk" in self._stack.names:
            keys.update(dict.fromkeys(self._stack.tiers[self._stack.names.index("disk")].keys()))
        return list(keys)

    def promote_for_peers(self, keys: list[bytes]) -> None:
        """Moves the keys a peer is about to lease up into DRAM from local lower tiers (never
        from other nodes': a peer asking this node must not make it ask the cluster)."""
        if self._closed:
            return
        stack = self._stack
        with stack.lock:
            where = stack.locate(keys, prefix=False, local=True)
            wanted = [k for k, t in zip(keys, where, strict=True) if t > 0]
            stack.pin(wanted)
        try:
            if wanted:
                stack.promote(wanted, local=True)
        finally:
            stack.unpin(wanted)

    # --- eviction, purge, stats, close -----------------------------------------------------

    def evict(self, tokens: Any, *, tier: str = "dram", namespace: Namespace | None = None) -> int:
        """Moves the cached blocks of ``tokens`` out of ``tier`` now (``"dram"`` demotes them
        to the next tier first, if there is one; a lower tier drops them). Pinned blocks, and
        session blocks that would be lost, stay. Returns the blocks removed from ``tier``. The
        policy evicts on its own; this is for callers that know better (and for benchmarks)."""
        self._check_open()
        names = self._stack.names
        if tier not in names:
            raise InvalidArgumentError(f"tier: expected one of {names}, got {tier!r}")
        _, keys = self._keys(tokens, namespace)
        self.flush()  # saves and queued write-back of these blocks land first
        return self._stack.evict(names.index(tier), keys)

    def purge(self, namespace: Namespace | None = None) -> int:
        """Drops every block of ``namespace`` (default: the store's) from every tier, and its
        sessions; pinned blocks go at their last unpin. Returns the blocks dropped now."""
        self._check_open()
        tag = self.scheme.namespace_tag(self._namespace(namespace))
        self.flush()
        self._sessions.forget_namespace(tag)
        keys: set[bytes] = set()
        for tier, read_only in zip(self._stack.tiers, self._stack.read_only, strict=True):
            if not read_only:
                keys.update(k for k in tier.keys() if k.startswith(tag))  # noqa: SIM118
        return self._stack.delete_everywhere(sorted(keys))

    def warmup(self, *, wait_mapped: bool = True) -> None:
        """Does once, now, what the first load and save would otherwise pay for (planning the
        moves between the DRAM tier and the device pools, starting the copy engine, compiling
        the pools' donated identity step, mapping a re-attached pool's pages). Call it after
        creating the store, e.g. with the engine's own warm-up; it moves no block.
        ``wait_mapped=False``: a re-attached pool's pages are left to its background mapper
        rather than waited for (the engine connectors' start-up)."""
        self._check_open()
        self.dram.prepare(self.pools, wait_mapped=wait_mapped)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every save started so far is durable in DRAM and written to every lower
        tier (and, when publishing to a registry, published there); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._handles_lock:
            saving = list(self._saving)
        _, pending = concurrent.futures.wait(saving, timeout)
        if pending:
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done = self._stack.writeback.flush(left)
        if done and self._registry_link is not None:
            try:  # the registry learns of what those saves added
                self._registry_link.flush_changes()
            except (TpuSyncError, OSError) as error:
                log.warning("tpusync kv: registry update failed: %s", error)
        return done

    def stats(self) -> dict[str, Any]:
        """Counters of the store and of each tier (plus blocks used and capacity)."""
        self._release_dropped()
        stack = self._stack
        with self._counters_lock:
            store: dict[str, Any] = dict(self._counters)
        store.update(stack.counters_snapshot())
        store["writeback_pending_bytes"] = stack.writeback.pending_bytes()
        store["sessions"] = len(self._sessions.ids())
        with self._handles_lock:
            store["open_handles"] = len(self._handles)
        tiers = {}
        for name, tier in zip(stack.names, stack.tiers, strict=True):
            entry: dict[str, Any] = dict(tier.stats.as_dict())
            try:
                entry["capacity"], entry["used"] = tier.capacity, tier.used
            except TpuSyncError:  # a remote tier that does not answer now
                entry["capacity"] = entry["used"] = -1
            tiers[name] = entry
        return {"store": store, "tiers": tiers}

    def close(self) -> None:
        """Finishes queued work (saves, write-back), then closes the tiers. A named DRAM pool
        and the disk tier keep their blocks (and sessions) for the next process. Open handles
        become invalid (those holding pins warn: a :class:`ResourceWarning`)."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()  # no peer reads while the tiers close
        self._layer_calls.shutdown(wait=True)
        self._calls.shutdown(wait=True)
        self._stack.writeback.flush()
        self._release_open_handles()
        self._stack.close()
        if self._registry_link is not None:
            self._stack.on_dram_added = self._stack.on_dram_removed = None
            self._stack.on_lower_removed = None
            self._registry_link.close()
        for tier in reversed(self._stack.tiers):
            if id(tier) not in self._not_owned:  # the caller's to close
                tier.close()

    def _release_open_handles(self) -> None:
        """Invalidates the handles still open and drops their pins (the store is closing)."""
        with self._handles_lock:
            keys, holding = self._handles.close()
        self._stack.unpin(keys)
        warn_still_open(holding)

    def __enter__(self) -> KVCacheStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tiers = ", ".join(self._stack.names)
        if self._closed:
            return f"KVCacheStore(model_id={self.config.model_id!r}, tiers=[{tiers}], closed)"
        return (
            f"KVCacheStore(model_id={self.config.model_id!r}, block_size={self.block_size}, "
            f"tiers=[{tiers}], dram {self.dram.used}/{self.dram.capacity} blocks)"
        )
