"""What an engine's connector uses, the calls of :class:`~tpusync.kv.KVCacheStore` (a base it
builds on): lookups and saves of blocks an engine has hashed itself (vLLM's
``Request.block_hashes``), keyed by the engine's hashes under the store's namespace, and block
events (a block stored in or removed from any tier) for the engine's KV-event stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpusync._src.kv._tier_stack import TierStack
from tpusync._src.kv.keys import KeyScheme, Namespace, check_engine_hashes
from tpusync._src.kv.results import LookupResult, SaveFuture
from tpusync.errors import InvalidArgumentError

__all__ = ["EngineBlockCalls"]


class EngineBlockCalls:
    """The engine-hash side of :class:`~tpusync.kv.KVCacheStore`: it uses the store's own
    checks, lookups and saves, declared here."""

    scheme: KeyScheme
    block_size: int
    _stack: TierStack

    _check_open: Callable[[], None]
    _namespace: Callable[[Namespace | None], Namespace]
    _lookup_keys: Callable[[list[bytes], int, int], LookupResult]
    _opened: Callable[[list[bytes], list[str], int, int], LookupResult]
    _check_block_ids: Callable[..., np.ndarray]
    _start_save: Callable[..., SaveFuture]
    _other_pools: Callable[[Any], tuple[list[Any], int]]

    def lookup_engine_blocks(
        self, block_hashes: Sequence[bytes], *, namespace: Namespace | None = None
    ) -> LookupResult:
        """:meth:`lookup` for blocks the engine has hashed itself (vLLM's
        ``Request.block_hashes``, each naming its whole prefix): the leading run of them cached
        in any tier, pinned. Keys are the engine's hashes under this store's keyed namespace
        (:meth:`~tpusync.kv.Blake2bChainKeys.engine_keys`), so they are the same in every
        process whose engine hashes the same way. (Tensor-parallel shards agree through a
        registry only on token lookups: here each shard answers for itself.)"""
        self._check_open()
        keys = self._engine_keys(block_hashes, namespace)
        return self._lookup_keys(keys, len(keys) * self.block_size, len(keys))

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
        self._check_open()
        keys = self._engine_keys(block_hashes, namespace)
        stack = self._stack
        if not stack.lock.acquire(blocking=False):
            return None
        try:
            found = stack.dram.contains(keys)
            held = next((i for i, hit in enumerate(found) if not hit), len(keys))
            if held < len(keys) and len(stack.tiers) > 1:
                return None
            hit = keys[:held]
            stack.pin(hit)
        finally:
            stack.lock.release()
        return self._opened(hit, [stack.names[0]] * held, len(keys) * self.block_size, len(keys))

    def _engine_keys(self, block_hashes: Any, namespace: Namespace | None) -> list[bytes]:
        hashes = check_engine_hashes(block_hashes)
        engine_keys = getattr(self.scheme, "engine_keys", None)
        if engine_keys is None:
            raise InvalidArgumentError(
                f"block_hashes: this store's key scheme ({self.scheme.name}) cannot adopt an "
                "engine's block hashes (it has no engine_keys); use the default scheme"
            )
        return engine_keys(self._namespace(namespace), hashes)

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
        self._check_open()
        keys = self._engine_keys(block_hashes, namespace)
        count = None
        if pools is not None:
            pools, count = self._other_pools(pools)
        ids = self._check_block_ids(device_block_ids, len(keys), at_most=False, num_blocks=count)
        return self._start_save(keys, ids, pools)

    def add_block_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        """Calls ``listener(kind, tier, keys)`` whenever blocks are stored in (``"stored"``) or
        removed from (``"removed"``: evicted, dropped as corrupt, purged) a tier of this store
        (``tier`` is its name: ``"dram"``, ``"disk"``, ...); a block moving between tiers is a
        store in one and, when it leaves, a removal from the other. Called on the thread that
        changed the tier, without the store's locks: keep it short (e.g. queue the event). An
        exception in it is logged and ignored."""
        if not callable(listener):
            raise InvalidArgumentError(
                f"listener: expected a callable, got {type(listener).__name__}"
            )
        names = self._stack.names

        def by_name(kind: str, tier: int, keys: list[bytes]) -> None:
            listener(kind, names[tier], keys)

        by_name.listener = listener  # type: ignore[attr-defined]
        self._stack.block_listeners.append(by_name)

    def remove_block_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        """Stops calling ``listener`` (added with :meth:`add_block_listener`)."""
        listeners = self._stack.block_listeners
        listeners[:] = [f for f in listeners if getattr(f, "listener", None) != listener]
