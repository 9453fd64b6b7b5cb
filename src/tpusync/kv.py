"""The KV cache store: prefix caching of paged KV blocks across memory tiers.

:class:`KVCacheStore` keys each full block of tokens by a hash chained over the prefix under a keyed
namespace digest (:class:`Namespace`, :class:`Blake2bChainKeys`), keeps blocks in DRAM (anonymous or
/dev/shm), local disk and shared filesystems (:class:`DramTier`, :class:`DiskTier`,
:class:`SharedFsTier`, configured through :class:`KVStoreConfig`) and loads a cached prefix
straight into an engine's :class:`~tpusync.DevicePool`. See the README, "Prefix caching"."""

from __future__ import annotations

from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.keys import Blake2bChainKeys, KeyScheme, Namespace
from tpusync._src.kv.results import (
    LayerLoad,
    LoadResult,
    LookupResult,
    SaveFuture,
    SaveResult,
    SessionRestore,
)
from tpusync._src.kv.secret import load_secret
from tpusync._src.kv.store import KVCacheStore
from tpusync._src.kv.tier_specs import DiskTier, DramTier, ExistingTier, SharedFsTier

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
