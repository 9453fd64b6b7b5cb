"""What the KV store's collaborators ask of it (:class:`StoreCalls`), and what its loads and
saves run over (:class:`BlockPaths`): handed to them as objects, so that no collaborator reaches
into the store's attributes and the store reaches into none of theirs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync._src.kv._tier_stack import TierStack
from tpusync._src.kv.keys import Namespace
from tpusync._src.kv.results import LookupResult, SaveFuture
from tpusync._src.tiers.layout import PoolLayout

__all__ = ["BlockPaths", "StoreCalls"]


@dataclass(frozen=True)
class StoreCalls:
    """The store's checks, keys, lookups, saves and loads, as its bound methods."""

    check_open: Callable[[], None]
    namespace: Callable[[Namespace | None], Namespace]
    keys: Callable[[Any, Namespace | None], tuple[np.ndarray, list[bytes]]]
    check_block_ids: Callable[..., np.ndarray]
    check_writable: Callable[[np.ndarray], None]
    other_pools: Callable[[Any], tuple[list[Any], int]]
    lookup_keys: Callable[[list[bytes], int, int], LookupResult]
    opened: Callable[[list[bytes], list[str], int, int], LookupResult]
    start_save: Callable[..., SaveFuture]
    load_keys: Callable[[list[bytes], np.ndarray], tuple[int, int]]


@dataclass(frozen=True)
class BlockPaths:
    """What a store's loads and saves move blocks over: its tiers, its block layout, its
    engine's device pools and the transfer path it asked for (``KVStoreConfig.path``)."""

    stack: TierStack
    layout: PoolLayout
    pools: list[Any]
    path: str
