"""The KV cache store: prefix caching of paged KV blocks across memory tiers.

:class:`KVCacheStore` keys each full block of tokens by a hash chained over the prefix under a keyed
namespace digest (:class:`Namespace`, :class:`Blake2bChainKeys`), keeps blocks in DRAM (anonymous or
/dev/shm), local disk and shared filesystems (:class:`DramTier`, :class:`DiskTier`,
:class:`SharedFsTier`, configured through :class:`KVStoreConfig`) and loads a cached prefix
straight into an engine's :class:`~tpusync.DevicePool`. See the README, "Prefix caching"."""

from __future__ import annotations

from tpusync._src.kv import (
    Blake2bChainKeys,
    DiskTier,
    DramTier,
    ExistingTier,
    KeyScheme,
    KVCacheStore,
    KVStoreConfig,
    LayerLoad,
    LoadResult,
    LookupResult,
    Namespace,
    SaveFuture,
    SaveResult,
    SessionRestore,
    SharedFsTier,
    load_secret,
)

__all__ = [
    "Blake2bChainKeys",
    "DiskTier",
    "DramTier",
    "ExistingTier",
    "KVCacheStore",
    "KVStoreConfig",
    "KeyScheme",
    "LayerLoad",
    "LoadResult",
    "LookupResult",
    "Namespace",
    "SaveFuture",
    "SaveResult",
    "SessionRestore",
    "SharedFsTier",
    "load_secret",
]
