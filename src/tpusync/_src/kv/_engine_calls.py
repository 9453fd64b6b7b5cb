"""What an engine's connector uses, for one :class:`~tpusync.kv.KVCacheStore` (an object it
holds): lookups and saves of blocks an engine has hashed itself (vLLM's ``Request.block_hashes``),
keyed by the engine's hashes under the store's namespace, and block events (a block stored in or
removed from any tier) for the engine's KV-event stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tpusync._src.kv._store_calls import StoreCalls
from tpusync._src.kv._tier_stack import TierStack
from tpusync._src.kv.keys import KeyScheme, Namespace, check_engine_hashes
from tpusync._src.kv.results import LookupResult, SaveFuture
from tpusync.errors import InvalidArgumentError

__all__ = ["EngineBlockCalls"]


class EngineBlockCalls:
    """The engine-hash calls of one store, over its tiers (``stack``); it asks the store for
    checks, lookups and saves through ``calls``."""

    def __init__(
        self, calls: StoreCalls, stack: TierStack, *, scheme: KeyScheme, block_size: int
    ) -> None:
        self._calls = calls
        self._stack = stack
        self._scheme = scheme
        self._block_size = block_size

    def lookup(self, block_hashes: Sequence[bytes], namespace: Namespace | None) -> LookupResult:
        self._calls.check_open()
        keys = self._keys(block_hashes, namespace)
        return self._calls.lookup_keys(keys, len(keys) * self._block_size, len(keys))

    def lookup_in_dram(
        self, block_hashes: Sequence[bytes], namespace: Namespace | None
    ) -> LookupResult | None:
        self._calls.check_open()
        keys = self._keys(block_hashes, namespace)
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
        return self._calls.opened(
            hit, [stack.names[0]] * held, len(keys) * self._block_size, len(keys)
        )

    def save_async(
        self,
        block_hashes: Sequence[bytes],
        device_block_ids: Any,
        namespace: Namespace | None,
        pools: Any,
    ) -> SaveFuture:
        calls = self._calls
        calls.check_open()
        keys = self._keys(block_hashes, namespace)
        count = None
        if pools is not None:
            pools, count = calls.other_pools(pools)
        ids = calls.check_block_ids(device_block_ids, len(keys), at_most=False, num_blocks=count)
        return calls.start_save(keys, ids, pools)

    def add_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        if not callable(listener):
            raise InvalidArgumentError(
                f"listener: expected a callable, got {type(listener).__name__}"
            )
        names = self._stack.names

        def by_name(kind: str, tier: int, keys: list[bytes]) -> None:
            listener(kind, names[tier], keys)

        by_name.listener = listener  # type: ignore[attr-defined]
        self._stack.block_listeners.append(by_name)

    def remove_listener(self, listener: Callable[[str, str, list[bytes]], None]) -> None:
        listeners = self._stack.block_listeners
        listeners[:] = [f for f in listeners if getattr(f, "listener", None) != listener]

    def _keys(self, block_hashes: Any, namespace: Namespace | None) -> list[bytes]:
        hashes = check_engine_hashes(block_hashes)
        engine_keys = getattr(self._scheme, "engine_keys", None)
        if engine_keys is None:
            raise InvalidArgumentError(
                f"block_hashes: this store's key scheme ({self._scheme.name}) cannot adopt an "
                "engine's block hashes (it has no engine_keys); use the default scheme"
            )
        return engine_keys(self._calls.namespace(namespace), hashes)
