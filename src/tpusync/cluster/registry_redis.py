"""The Redis (or Valkey) registry backend, for fleets: :class:`RedisRegistry`.

Layout under ``prefix`` (default ``tpusync``), one Redis database, no Redis Cluster (the
scripts touch keys they compute, which Cluster forbids)::

    {prefix}:node:{node_id}   string, the node's record (JSON), with a PX TTL: its lease
    {prefix}:nodes            set of node ids ever registered and not yet removed (no TTL)
    {prefix}:own:{node_id}    set of the hex keys the node published (no TTL)
    {prefix}:blk:{keyhex}     hash node_id -> tier: who holds the block

Liveness is Redis's own TTL on the node record (the server's clock: no clock assumption across
hosts). Entries outlive a lapsed lease, but lookups count only nodes whose record exists; a
lapsed node that registers again has its old entries cleared first, and :meth:`sweep` removes
the entries of lapsed nodes. Writes that depend on liveness (register, publish, unregister,
sweep) are Lua scripts, atomic on the server; every batch is one pipeline (a 512-key lookup is
two round trips).

Needs the ``redis`` package (``pip install tpusync[cluster]``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tpusync.cluster.registry import Holder, NodeInfo, check_keys, check_tier, check_ttl
from tpusync.cluster.registry_server import (
    RegistryUnavailableError,
    check_node,
    check_node_id,
    node_from_dict,
    node_to_dict,
)
from tpusync.errors import InvalidArgumentError

__all__ = ["RedisRegistry", "RegistryUnavailableError"]

BATCH_KEYS = 1000  # keys per script call (Lua's unpack() and reply sizes stay small)

# KEYS: node record, own set, nodes set.  ARGV: node id, record, ttl ms, blk key prefix.
_REGISTER = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  for _, k in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    redis.call('HDEL', ARGV[4] .. k, ARGV[1])
  end
  redis.call('DEL', KEYS[2])
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: node record, own set, nodes set.  ARGV: node id, blk key prefix, "1" = only if lapsed.
# Returns 1 when the node was known (in the nodes set) and is now removed.
_REMOVE = """
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
for _, k in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('HDEL', ARGV[2] .. k, ARGV[1])
end
redis.call('DEL', KEYS[2], KEYS[1])
return redis.call('SREM', KEYS[3], ARGV[1])
"""

# KEYS: node record, own set.  ARGV: node id, tier, blk key prefix, hex keys...
# Returns 0 (and writes nothing) when the node's lease lapsed.
_PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
for i = 4, #ARGV do
  redis.call('HSET', ARGV[3] .. ARGV[i], ARGV[1], ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[i])
end
return 1
"""


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisRegistry:
    """A :class:`~tpusync.cluster.registry.Registry` in Redis or Valkey.

    Args:
      url: ``redis://host:port/db`` (ignored when ``client`` is given).
      prefix: namespace of every key this registry writes (several registries may share a
        database under different prefixes).
      client: a ``redis.Redis`` to use instead of connecting to ``url`` (either
        ``decode_responses`` setting works); it is not closed by :meth:`close`.
      timeout_s: socket timeouts of the client made from ``url``.

    Raises:
      RegistryUnavailableError: on any call, when Redis cannot be reached or fails.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "tpusync",
        client: Any = None,
        timeout_s: float = 10.0,
    ) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgumentError(f"prefix: expected a non-empty string, got {prefix!r}")
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise InvalidArgumentError(
                "RedisRegistry needs the redis package: pip install 'tpusync[cluster]'"
            ) from exc
        self._redis_errors = (redis.exceptions.RedisError,)
        self._own_client = client is None
        if client is None:
            client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        self._r = client
        self._prefix = prefix
        self._blk = f"{prefix}:blk:"
        self._nodes_key = f"{prefix}:nodes"
        self._url = url if self._own_client else repr(client)
        self._register = client.register_script(_REGISTER)
        self._remove = client.register_script(_REMOVE)
        self._publish = client.register_script(_PUBLISH)

    def _node_key(self, node_id: str) -> str:
        return f"{self._prefix}:node:{node_id}"

    def _own_key(self, node_id: str) -> str:
        return f"{self._prefix}:own:{node_id}"

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._redis_errors as exc:
            raise RegistryUnavailableError(
                f"the Redis registry at {self._url} failed {what}: {exc}"
            ) from exc

    @staticmethod
    def _ms(ttl_s: float) -> int:
        return max(1, round(check_ttl(ttl_s) * 1000))

    def register(self, node: NodeInfo, ttl_s: float) -> None:
        check_node(node)
        ms = self._ms(ttl_s)
        record = json.dumps(node_to_dict(node))
        with self._errors("register"):
            self._register(
                keys=[self._node_key(node.node_id), self._own_key(node.node_id), self._nodes_key],
                args=[node.node_id, record, ms, self._blk],
            )

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        check_node_id(node_id)
        ms = self._ms(ttl_s)
        with self._errors("heartbeat"):
            return bool(self._r.pexpire(self._node_key(node_id), ms))

    def unregister(self, node_id: str) -> None:
        check_node_id(node_id)
        with self._errors("unregister"):
            self._remove(
                keys=[self._node_key(node_id), self._own_key(node_id), self._nodes_key],
                args=[node_id, self._blk, "0"],
            )

    def publish(self, node_id: str, keys: Sequence[bytes], tier: str) -> None:
        keys = check_keys(keys)
        check_tier(tier)
        check_node_id(node_id)
        script_keys = [self._node_key(node_id), self._own_key(node_id)]
        with self._errors("publish"):
            pipe = self._r.pipeline(transaction=False)
            for i in range(0, max(len(keys), 1), BATCH_KEYS):
                batch = [k.hex() for k in keys[i : i + BATCH_KEYS]]
                self._publish(
                    keys=script_keys, args=[node_id, tier, self._blk, *batch], client=pipe
                )
            done = pipe.execute()
        if not all(done):
            raise InvalidArgumentError(
                f"node_id: {node_id!r} is not registered or its lease lapsed; register it first"
                + (" (its lease lapsed during the publish)" if any(done) else "")
            )

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        check_node_id(node_id)
        if not keys:
            return
        own = self._own_key(node_id)
        with self._errors("withdraw"):
            pipe = self._r.pipeline(transaction=False)
            for i in range(0, len(keys), BATCH_KEYS):
                batch = [k.hex() for k in keys[i : i + BATCH_KEYS]]
                for h in batch:
                    pipe.hdel(self._blk + h, node_id)
                pipe.srem(own, *batch)
            pipe.execute()

    def _live(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """The records (raw) of those of ``node_ids`` whose lease holds."""
        out: dict[str, Any] = {}
        for i in range(0, len(node_ids), BATCH_KEYS):
            batch = node_ids[i : i + BATCH_KEYS]
            records = self._r.mget([self._node_key(n) for n in batch])
            out.update((n, rec) for n, rec in zip(batch, records, strict=True) if rec is not None)
        return out

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        if not keys:
            return []
        with self._errors("holders"):
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(self._blk + key.hex())
            found = [{_str(n): _str(t) for n, t in held.items()} for held in pipe.execute()]
            live = self._live(sorted({n for held in found for n in held}))
        return [sorted(Holder(n, t) for n, t in held.items() if n in live) for held in found]

    def _known(self) -> list[str]:
        return sorted({_str(n) for n in self._r.sscan_iter(self._nodes_key, count=1000)})

    def nodes(self) -> list[NodeInfo]:
        """The live nodes, sorted by id."""
        with self._errors("nodes"):
            live = self._live(self._known())
        return [node_from_dict(json.loads(live[n])) for n in sorted(live)]

    def sweep(self) -> int:
        """Removes lapsed nodes and their entries; returns the nodes removed."""
        with self._errors("sweep"):
            known = self._known()
            live = self._live(known)
            dead = [n for n in known if n not in live]
            if not dead:
                return 0
            pipe = self._r.pipeline(transaction=False)
            for node_id in dead:  # each script re-checks the lease: a node that came back stays
                self._remove(
                    keys=[self._node_key(node_id), self._own_key(node_id), self._nodes_key],
                    args=[node_id, self._blk, "1"],
                    client=pipe,
                )
            return sum(int(n) for n in pipe.execute())

    def close(self) -> None:
        """Closes the connection pool made from ``url`` (a passed-in client stays open)."""
        if self._own_client:
            self._r.close()
