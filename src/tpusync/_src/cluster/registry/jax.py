"""The registry on the coordination service of a multi-controller JAX job: :class:`JaxRegistry`.

Every process of a ``jax.distributed`` job already talks to one coordination service (a
key-value store in the coordinator process); this backend keeps the registry there, so a JAX job
needs no Redis and no registry server. Layout under ``prefix`` (node ids are URL-quoted, so a
``/`` in one cannot break the tree)::

    {prefix}/node/{node_id}           JSON {"node": record, "expiry": wall-clock seconds}
    {prefix}/blk/{keyhex}/{node_id}   tier: who holds the block
    {prefix}/own/{node_id}/{keyhex}   tier: what the node published (for unregister and sweep)

The service has no TTLs: a node record holds the wall-clock time (``time.time()``) its lease
ends, rewritten by :meth:`heartbeat`, and every process compares it with its own
``time.time()``. **Clock assumption:** the hosts' clocks agree to well within a lease (NTP);
a host whose clock runs ahead sees leases lapse early, one behind sees them last longer.

The service has no transactions either: a check and the write that follows it (e.g. publish
after checking the lease) can interleave with another process's writes. That is harmless while
each node's entries are written by the node itself (the intended use); :meth:`sweep` from another
process can race with a node that re-registers at the same moment.

Each key is its own RPC to the coordinator (a round trip each); batches run on a small
thread pool. The service lives in the coordinator process and dies with the job (one process
dying aborts the others): this registry is for the lifetime of one job.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from tpusync._src.cluster.registry._leases import (
    has_lapsed,
    lapsed_nodes,
    lease_end,
    live_nodes,
    not_live_message,
)
from tpusync._src.cluster.registry.base import (
    Holder,
    NodeInfo,
    check_keys,
    check_node,
    check_node_id,
    check_tier,
    check_ttl,
    node_from_dict,
    node_to_dict,
)
from tpusync.errors import InvalidArgumentError, RegistryUnavailableError

__all__ = ["JaxRegistry"]

_SLICES_PER_WORKER = 4  # slices of a batch per thread: few tasks, threads still kept busy

T = TypeVar("T")
R = TypeVar("R")


def _expiry(record: dict[str, Any] | None) -> float | None:
    return None if record is None else record["expiry"]


def _qid(node_id: str) -> str:
    return quote(node_id, safe="")


class JaxRegistry:
    """A :class:`~tpusync._src.cluster.registry.Registry` in the coordination service of a running
    ``jax.distributed`` job (call ``jax.distributed.initialize`` first).

    Args:
      prefix: the key directory this registry uses (several may share the service).
      client: the ``DistributedRuntimeClient`` to use (default: the one of
        ``jax.distributed.initialize``).
      workers: threads that issue the RPCs of one batch concurrently.
      clock: wall-clock seconds, the same on every host (tests may pass their own).
    """

    def __init__(
        self,
        *,
        prefix: str = "tpusync",
        client: Any = None,
        workers: int = 8,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not prefix.strip("/") or "//" in prefix:
            raise InvalidArgumentError(
                f"prefix: expected a key directory such as 'tpusync', got {prefix!r}"
            )
        if client is None:
            # Looked up only here, so a jax that moves them breaks only a registry made
            # without a client: private jax internals
            from jax._src.distributed import global_state

            client = global_state.client
            if client is None:
                raise InvalidArgumentError(
                    "JaxRegistry: jax.distributed is not initialized in this process; call "
                    "jax.distributed.initialize(...) first, or pass client="
                )
        self._c = client
        self._prefix = prefix.strip("/")
        self._clock = clock or time.time
        self._workers = max(1, int(workers))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- paths and RPC helpers -------------------------------------------------------------------

    def _node_path(self, node_id: str) -> str:
        return f"{self._prefix}/node/{_qid(node_id)}"

    def _blk_path(self, keyhex: str, node_id: str | None = None) -> str:
        base = f"{self._prefix}/blk/{keyhex}"
        return base if node_id is None else f"{base}/{_qid(node_id)}"

    def _own_path(self, node_id: str, keyhex: str | None = None) -> str:
        base = f"{self._prefix}/own/{_qid(node_id)}"
        return base if keyhex is None else f"{base}/{keyhex}"

    def _rpc(self, what: str, fn: Callable[..., R], *args: Any) -> R:
        try:
            return fn(*args)
        except Exception as exc:  # JaxRuntimeError: the service failed or is gone
            raise RegistryUnavailableError(
                f"the JAX coordination service failed {what}: {exc}"
            ) from exc

    def _map(self, what: str, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        items = list(items)
        if len(items) <= 2:
            return [self._rpc(what, fn, item) for item in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="tpusync-jaxreg")
            pool = self._pool
        # a few slices per thread, each one task: a task per item would cost more than its RPC
        size = -(-len(items) // (self._workers * _SLICES_PER_WORKER))
        slices = [items[i : i + size] for i in range(0, len(items), size)]
        done = pool.map(lambda part: [self._rpc(what, fn, item) for item in part], slices)
        return [answer for part in done for answer in part]

    def _record(self, node_id: str) -> dict[str, Any] | None:
        try:
            raw = self._c.key_value_try_get(self._node_path(node_id))
        except Exception as exc:
            if str(exc).startswith("NOT_FOUND"):
                return None
            raise RegistryUnavailableError(
                f"the JAX coordination service failed a lookup: {exc}"
            ) from exc
        return json.loads(raw)

    def _records(self) -> dict[str, dict[str, Any]]:
        found = self._rpc("a lookup", self._c.key_value_dir_get, f"{self._prefix}/node")
        return {unquote(path.rsplit("/", 1)[1]): json.loads(raw) for path, raw in found}

    def _write_record(self, node: NodeInfo, ttl: float) -> None:
        record = json.dumps({"node": node_to_dict(node), "expiry": lease_end(ttl, self._clock())})
        self._rpc("a write", self._c.key_value_set, self._node_path(node.node_id), record, True)

    def _drop_entries(self, node_id: str) -> None:
        owned = self._rpc("a lookup", self._c.key_value_dir_get, self._own_path(node_id))
        hexes = [path.rsplit("/", 1)[1] for path, _ in owned]
        self._map("a delete", self._c.key_value_delete, [self._blk_path(h, node_id) for h in hexes])
        self._rpc("a delete", self._c.key_value_delete, self._own_path(node_id))

    # -- the Registry protocol -------------------------------------------------------------------

    def register(self, node: NodeInfo, ttl_s: float) -> None:
        check_node(node)
        ttl = check_ttl(ttl_s)
        old = self._record(node.node_id)
        if has_lapsed(_expiry(old), self._clock()):  # lapsed (or new): old entries void
            self._drop_entries(node.node_id)
        self._write_record(node, ttl)

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        check_node_id(node_id)
        ttl = check_ttl(ttl_s)
        old = self._record(node_id)
        if old is None or has_lapsed(old["expiry"], self._clock()):
            return False
        self._write_record(node_from_dict(old["node"]), ttl)
        return True

    def unregister(self, node_id: str) -> None:
        check_node_id(node_id)
        self._rpc("a delete", self._c.key_value_delete, self._node_path(node_id))
        self._drop_entries(node_id)

    def publish(self, node_id: str, keys: Sequence[bytes], tier: str) -> None:
        keys = check_keys(keys)
        check_tier(tier)
        check_node_id(node_id)
        record = self._record(node_id)
        if has_lapsed(_expiry(record), self._clock()):
            raise InvalidArgumentError(not_live_message(node_id))
        paths = []
        for key in dict.fromkeys(keys):
            h = key.hex()
            paths += [self._own_path(node_id, h), self._blk_path(h, node_id)]
        self._map("a write", lambda p: self._c.key_value_set(p, tier, True), paths)

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        check_node_id(node_id)
        paths = []
        for key in dict.fromkeys(keys):
            h = key.hex()
            paths += [self._blk_path(h, node_id), self._own_path(node_id, h)]
        self._map("a delete", self._c.key_value_delete, paths)

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        if not keys:
            return []
        now = self._clock()
        live = live_nodes({n: rec["expiry"] for n, rec in self._records().items()}, now)
        found = self._map(
            "a lookup", self._c.key_value_dir_get, [self._blk_path(k.hex()) for k in keys]
        )
        out = []
        for entries in found:
            held = ((unquote(path.rsplit("/", 1)[1]), tier) for path, tier in entries)
            out.append(sorted(Holder(n, t) for n, t in held if n in live))
        return out

    def nodes(self) -> list[NodeInfo]:
        """The live nodes, sorted by id."""
        now = self._clock()
        records = self._records()
        return [
            node_from_dict(records[n]["node"])
            for n in sorted(records)
            if not has_lapsed(records[n]["expiry"], now)
        ]

    def sweep(self) -> int:
        """Removes lapsed nodes and their entries; returns the nodes removed."""
        now = self._clock()
        dead = lapsed_nodes(((n, rec["expiry"]) for n, rec in self._records().items()), now)
        for node_id in dead:
            self._rpc("a delete", self._c.key_value_delete, self._node_path(node_id))
            self._drop_entries(node_id)
        return len(dead)

    def close(self) -> None:
        """Stops the worker threads (the coordination service belongs to the JAX job)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
