"""``TpuSyncHiCacheStorage``: SGLang's HiCache storage (the layer below its host memory) over
a tpusync KV store.

SGLang's ``dynamic`` factory makes it with ``(storage_config, kwargs)`` and then registers the
host pool; the store opens then, over the host pool's pages (:mod:`.host_pages`): the zero-copy
pair (``batch_get_v1`` / ``batch_set_v1``) copies pages between the host pool and the tiers
natively. The generic methods take and give flat page tensors (SGLang's
``get_data_page(flat=True)`` form) through a staging buffer of this backend.

Keys are SGLang's page keys (each names its whole prefix) under the store's keyed namespace
(model and host layout, ranks, tenant salt, secret). Every page is checked as it lands: a
damaged page is a miss, and the pages after it are not served.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from tpusync._src.connectors.sglang.events import PageEventPublisher
from tpusync._src.connectors.sglang.host_pages import HostPages, host_pages, page_ids
from tpusync._src.connectors.sglang.settings import BackendSettings, read_settings
from tpusync._src.kv.store import KVCacheStore
from tpusync._src.memory.torch_tensors import TorchPool
from tpusync.errors import InvalidArgumentError, TpuSyncError

__all__ = ["TpuSyncHiCacheStorage"]

log = logging.getLogger("tpusync.connectors.sglang")

MAX_KEY_BYTES = 64  # an engine hash's longest; longer keys are hashed to 32 bytes


def key_bytes(key: Any) -> bytes:
    """SGLang's page key (a hex string) as the engine hash the store keys it by."""
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"keys: expected SGLang's page keys (strings), got {key!r}")
    data = key.encode()
    if len(data) > MAX_KEY_BYTES:
        return hashlib.blake2b(data, digest_size=32).digest()
    return data


class TpuSyncHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend on a tpusync store: DRAM (named: in /dev/shm, found again
    by a restarted engine), disk, shared FS and store nodes, one keyed namespace, every page
    verified.

    Made by SGLang's storage factory (``dynamic`` backend) with its ``HiCacheStorageConfig``;
    ``extra_config`` is the plain form of :class:`~tpusync.kv.KVStoreConfig` (see
    :mod:`tpusync._src.connectors.sglang.settings`), read at once: a wrong key fails the engine's
    start."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.settings: BackendSettings = read_settings(storage_config)
        self.storage_config = storage_config
        self.store: KVCacheStore | None = None
        self.pages: HostPages | None = None
        self._pools: list[TorchPool] = []
        self._lock = threading.Lock()
        self._staged = threading.local()  # the generic interface's staging, per thread
        self.events: PageEventPublisher | None = None  # the tiers' KV events (kv_events)

    # --- setup -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the store over ``mem_pool_host``'s pages (SGLang calls it once, after making
        the backend)."""
        with self._lock:
            if self.store is not None:
                raise InvalidArgumentError(
                    "mem_pool_host: this backend's host pool is registered already"
                )
            pages = host_pages(mem_pool_host, is_mla=self.settings.is_mla)
            config = self.settings.store_config(
                page_size=pages.page_size, capacity_pages=pages.page_num, layout=pages.layout
            )
            pools = [TorchPool(region, name=f"{pages.layout}[{i}]")
                     for i, region in enumerate(pages.regions)]  # fmt: skip
            store = KVCacheStore(config, pools)
            try:
                store.warmup(wait_mapped=False)  # the moves' plans now, not in the first hit
            except BaseException:
                with contextlib.suppress(Exception):  # the warm-up's error is the one to see
                    store.close()
                raise
            if self.settings.events is not None:
                try:
                    self.events = PageEventPublisher(self.settings.events, pages.page_size)
                except BaseException:
                    with contextlib.suppress(Exception):
                        store.close()
                    raise
                store.add_block_listener(self.events.heard)
            self.store = store
            self.pages, self._pools = pages, pools
            self.mem_pool_host = mem_pool_host
        log.info(
            "tpusync sglang: store open over the %s host pool (%d pages of %d tokens, %d bytes "
            "a page)",
            pages.layout,
            pages.page_num,
            pages.page_size,
            self.store.layout.payload_bytes,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's host pool group: the KV pool is the one this backend serves; another pool
        (hybrid models: Mamba, SWA, ...) is refused."""
        if str(host_pool_name) != "kv":
            raise InvalidArgumentError(
                f"host_pool_name: tpusync's backend serves the KV pool only; {host_pool_name!r} "
                "pools of hybrid models are not supported yet"
            )
        if self.store is None:
            self.register_mem_pool_host(host_pool)

    def _open(self) -> tuple[KVCacheStore, HostPages]:
        store, pages = self.store, self.pages
        if store is None or pages is None:
            raise InvalidArgumentError(
                "mem_pool_host: no host pool registered yet; SGLang's storage factory "
                "registers it (or call register_mem_pool_host)"
            )
        return store, pages

    # --- existence -----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` the store holds, in any tier."""
        store, _ = self._open()
        if not keys:
            return 0
        hashes = [key_bytes(k) for k in keys]
        try:
            result = store.lookup_engine_blocks(hashes)
        except (TpuSyncError, OSError) as error:
            log.warning("tpusync sglang: lookup failed (a miss): %s", error)
            return 0
        store.release(result)
        return result.num_blocks

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- zero copy: pages of the host pool ---------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Loads the leading pages of ``keys`` the store holds into the host pool's pages at
        ``host_indices``; True for each page loaded (a leading run)."""
        store, hashes, ids = self._v1_pages(keys, host_indices)
        return self._get(store, hashes, ids, None) if hashes else []

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys`` (pages the store
        holds already are skipped); True for each page stored or already held."""
        store, hashes, ids = self._v1_pages(keys, host_indices)
        if not hashes:
            return []
        self._learn(store, hashes, keys, extra_info)
        return self._set(store, hashes, ids, None)

    def _learn(self, store: KVCacheStore, hashes: list[bytes], keys: list[str], extra: Any) -> None:
        """Tells the event publisher which pages the store keys of ``hashes`` are (before the
        save: its events may come before it returns)."""
        if self.events is None:
            return
        prefix = getattr(extra, "prefix_keys", None)
        parent = prefix[-1] if prefix else None
        self.events.learn(store.scheme.engine_keys(store.namespace, hashes), keys, parent)  # type: ignore[attr-defined]

    def _v1_pages(
        self, keys: list[str], host_indices: Any
    ) -> tuple[KVCacheStore, list[bytes], Any]:
        """The store, the keys as the store's engine hashes, and the host pool's page ids at
        ``host_indices`` (checked), for the v1 pair."""
        store, pages = self._open()
        if not keys:
            return store, [], None
        ids = page_ids(host_indices, pages.page_size, len(keys), pages.page_num)
        return store, [key_bytes(k) for k in keys], ids

    def _get(self, store: KVCacheStore, hashes: list[bytes], ids: Any, pools: Any) -> list[bool]:
        n = len(hashes)
        result = None
        try:
            result = store.lookup_engine_blocks(hashes)
            loaded = 0
            if result.num_blocks:
                loaded = store.load(result, ids[: result.num_blocks], pools=pools).loaded_blocks
        except (TpuSyncError, OSError) as error:
            log.warning("tpusync sglang: a load of %d pages failed (a miss): %s", n, error)
            return [False] * n
        finally:
            if result is not None and result.open:  # a miss, or a failed load: its pins
                store.release(result)
        return [True] * loaded + [False] * (n - loaded)

    def _set(self, store: KVCacheStore, hashes: list[bytes], ids: Any, pools: Any) -> list[bool]:
        n = len(hashes)
        if not self.settings.writes:  # MLA: SGLang's writer rank stores the shared pages
            return [True] * n
        try:
            saved = store.save_engine_blocks_async(hashes, ids, pools=pools).result()
        except (TpuSyncError, OSError) as error:
            log.warning("tpusync sglang: a save of %d pages failed: %s", n, error)
            return [False] * n
        done = saved.stored_blocks + saved.skipped_blocks
        return [True] * done + [False] * (n - done)

    # --- generic: flat page tensors ------------------------------------------------------------

    def _staging(
        self, pages: HostPages, n: int, *, kept: bool = True
    ) -> tuple[Any, list[TorchPool]]:
        """``n`` flat pages as the store's pools: this thread's kept buffer (grown as needed,
        so the tiers keep their plans for it), or a new one where the caller hands the pages
        out (``kept=False``). SGLang calls from several threads: one buffer each."""
        held = getattr(self._staged, "buffer", None)
        if kept and held is not None and held[0].shape[0] >= n:
            return held
        flat = torch.empty((max(n, 2 * held[0].shape[0]) if kept and held else n,
                            pages.page_elements), dtype=pages.dtype)  # fmt: skip
        pools = [TorchPool(part, name=f"staging[{i}]")
                 for i, part in enumerate(pages.split_flat(flat))]  # fmt: skip
        if kept:
            self._staged.buffer = (flat, pools)
        return flat, pools

    def _flat(self, pages: HostPages, value: Any, i: int) -> Any:
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            raise InvalidArgumentError(
                f"values[{i}]: expected a CPU torch.Tensor (a flat page), got "
                f"{type(value).__name__}"
            )
        if value.dtype != pages.dtype or value.numel() != pages.page_elements:
            raise InvalidArgumentError(
                f"values[{i}]: a flat page of this pool is {pages.page_elements} elements of "
                f"{pages.dtype}; got {value.numel()} of {value.dtype}"
            )
        return value.reshape(-1)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Stores flat pages ``values[i]`` under ``keys[i]``; True when all are stored."""
        store, pages = self._open()
        if values is None or len(values) != len(keys):
            raise InvalidArgumentError(
                f"values: expected one flat page per key ({len(keys)}), got "
                f"{None if values is None else len(values)}"
            )
        if not keys:
            return True
        hashes = [key_bytes(k) for k in keys]
        rows = [self._flat(pages, v, i) for i, v in enumerate(values)]
        flat, pools = self._staging(pages, len(keys))
        torch.stack(rows, out=flat[: len(keys)])
        self._learn(store, hashes, keys, None)
        return all(self._set(store, hashes, list(range(len(keys))), pools))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """The flat pages of ``keys`` (a leading run; None from the first page not held),
        written into ``target_locations[i]`` where given."""
        store, pages = self._open()
        if target_locations is not None and len(target_locations) != len(keys):
            raise InvalidArgumentError(
                f"target_locations: expected one per key ({len(keys)}), got {len(target_locations)}"
            )
        if not keys:
            return []
        targets = [None] * len(keys) if target_locations is None else list(target_locations)
        for i, target in enumerate(targets):
            if target is not None:
                self._flat(pages, target, i)
        hashes = [key_bytes(k) for k in keys]
        # pages handed back as they are must outlive the call: a new buffer then
        handed_out = any(t is None for t in targets)
        flat, pools = self._staging(pages, len(keys), kept=not handed_out)
        got = self._get(store, hashes, list(range(len(keys))), pools)
        out: list[Any] = []
        for i, ok in enumerate(got):
            if not ok:
                out.append(None)
                continue
            target = targets[i]
            if target is None:
                out.append(flat[i])
            else:
                target.copy_(flat[i].reshape(target.shape))
                out.append(target)
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # --- hybrid (v2): not yet ----------------------------------------------------------------

    def _no_v2(self) -> Any:
        raise InvalidArgumentError(
            "tpusync's backend does not serve hybrid (v2) pools yet; use it for MHA and MLA models"
        )

    def batch_exists_v2(self, keys: Any, pool_transfers: Any = None, extra_info: Any = None) -> Any:
        return self._no_v2()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        return self._no_v2()

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        return self._no_v2()

    # --- the rest --------------------------------------------------------------------------------

    def clear(self) -> None:
        """Drops every page this backend's namespace holds in its store's tiers."""
        store, _ = self._open()
        store.purge()

    def get_stats(self) -> None:
        """SGLang's storage metrics: none yet (:meth:`stats` has the store's)."""
        return None

    def stats(self) -> dict[str, Any]:
        """The store's counters and tiers (:meth:`~tpusync.kv.KVCacheStore.stats`)."""
        store, _ = self._open()
        return store.stats()

    def close(self) -> None:
        """Closes the store (a named DRAM tier stays in /dev/shm for the next engine)."""
        with self._lock:
            store, self.store = self.store, None
            events, self.events = self.events, None
        if store is not None:
            store.close()
        if events is not None:  # after the store: its last events are published
            events.close()
