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
sweep) are Lua scripts, atomic on the server; every batch is one pipeline. Lookups
(:meth:`~RedisRegistry.holders`, :meth:`~RedisRegistry.prefix_holders`) are one Lua script call
per 1000 keys (a 512-key lookup is one round trip): it reads each key's hash, checks each holder's
lease once, stops at the first key nobody holds where asked to, and answers compactly. Scripts
are loaded once and again when Redis has forgotten them (NOSCRIPT, after a restart).

Needs the ``redis`` package (``pip install tpusync[cluster]``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tpusync._src.cluster.registry._leases import lease_ms, not_live_message
from tpusync._src.cluster.registry.base import (
    Holder,
    NodeInfo,
    batched,
    check_answer,
    check_exclude,
    check_keys,
    check_node,
    check_node_id,
    check_tier,
    node_from_dict,
    node_to_dict,
)
from tpusync.errors import InvalidArgumentError, RegistryUnavailableError

__all__ = ["RedisRegistry"]

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


# ARGV: blk key prefix, node key prefix, "1" = stop at the first key without a live holder, the
# node id to leave out ("" = none: node ids are never empty), the hex keys joined by ",".
# Returns {n, table, rows, runs}: n keys answered (all of them, or the prefix); table = node, tier,
# node, tier, ... (each live pair once); rows = each distinct holder list once, as the indices
# (0-based) of its pairs in table joined by " " ("" for none); runs = row, count, row, count, ...:
# the keys' rows in order, consecutive keys with the same row as one run.
# (string.find plain, not gmatch: a pattern walk of the argument costs as much as the lookups)
_LOOKUP = """
local blk, nodep, stop, exclude, s = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5]
local live, slot, tbl, rows, runs, row_at = {}, {}, {}, {}, {}, {}
local npairs, nrows, nruns, n = 0, 0, 0, 0
local prev = nil
local pos, len = 1, #s
while pos <= len do
  local e = string.find(s, ',', pos, true) or len + 1
  local flat = redis.call('HGETALL', blk .. string.sub(s, pos, e - 1))
  pos = e + 1
  local row = ''
  for j = 1, #flat, 2 do
    local node = flat[j]
    local ok = live[node]
    if ok == nil then
      ok = node ~= exclude and redis.call('EXISTS', nodep .. node) == 1
      live[node] = ok
    end
    if ok then
      local tier = flat[j + 1]
      local tiers = slot[node]
      if tiers == nil then
        tiers = {}
        slot[node] = tiers
      end
      local i = tiers[tier]
      if i == nil then
        i = tostring(npairs)
        npairs = npairs + 1
        tiers[tier] = i
        tbl[2 * npairs - 1] = node
        tbl[2 * npairs] = tier
      end
      if row == '' then
        row = i
      else
        row = row .. ' ' .. i
      end
    end
  end
  if stop and row == '' then
    break
  end
  n = n + 1
  if row == prev then
    runs[nruns] = runs[nruns] + 1
  else
    prev = row
    local r = row_at[row]
    if r == nil then
      r = nrows
      nrows = nrows + 1
      row_at[row] = r
      rows[nrows] = row
    end
    runs[nruns + 1] = r
    runs[nruns + 2] = 1
    nruns = nruns + 2
  end
end
return {n, tbl, rows, runs}
"""
_LOOKUP_SHA = hashlib.sha1(_LOOKUP.encode()).hexdigest()


def _node_id(holder: Holder) -> str:
    return holder.node_id


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisRegistry:
    """A :class:`~tpusync._src.cluster.registry.Registry` in Redis or Valkey.

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
            import redis  # optional heavy dependency (tpusync[cluster]): imported when used
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
        self._no_script = redis.exceptions.NoScriptError

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

    def register(self, node: NodeInfo, ttl_s: float) -> None:
        check_node(node)
        ms = lease_ms(ttl_s)
        record = json.dumps(node_to_dict(node))
        with self._errors("register"):
            self._register(
                keys=[self._node_key(node.node_id), self._own_key(node.node_id), self._nodes_key],
                args=[node.node_id, record, ms, self._blk],
            )

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        check_node_id(node_id)
        ms = lease_ms(ttl_s)
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
            for batch in batched([k.hex() for k in keys], BATCH_KEYS, at_least_one=True):
                self._publish(
                    keys=script_keys, args=[node_id, tier, self._blk, *batch], client=pipe
                )
            done = pipe.execute()
        if not all(done):
            raise InvalidArgumentError(
                not_live_message(node_id)
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
            for batch in batched([k.hex() for k in keys], BATCH_KEYS):
                for h in batch:
                    pipe.hdel(self._blk + h, node_id)
                pipe.srem(own, *batch)
            pipe.execute()

    def _live(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """The records (raw) of those of ``node_ids`` whose lease holds."""
        out: dict[str, Any] = {}
        for batch in batched(node_ids, BATCH_KEYS):
            records = self._r.mget([self._node_key(n) for n in batch])
            out.update((n, rec) for n, rec in zip(batch, records, strict=True) if rec is not None)
        return out

    def _lookup_args(self, keys: Sequence[bytes], stop: bool, exclude: str | None) -> list[str]:
        joined = ",".join([k.hex() for k in keys])
        return [self._blk, self._node_key(""), "1" if stop else "0", exclude or "", joined]

    def _lookups(self, calls: list[list[str]]) -> list[Any]:
        """Runs the lookup script once per argument list, in one round trip; loads the script
        (once, and again after Redis forgot it) where Redis answers NOSCRIPT."""
        for attempt in range(2):
            try:
                if len(calls) == 1:
                    return [self._r.evalsha(_LOOKUP_SHA, 0, *calls[0])]
                pipe = self._r.pipeline(transaction=False)
                for args in calls:
                    pipe.evalsha(_LOOKUP_SHA, 0, *args)
                return pipe.execute()
            except self._no_script:
                if attempt:
                    raise
                self._r.script_load(_LOOKUP)  # lookups only read: running them again is safe
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _decode(reply: Any, most: int) -> list[list[Holder]]:
        """The lookup script's answer as holder lists, each sorted by node id."""
        try:
            n, flat, rows, runs = reply
            n = int(n)
            if not 0 <= n <= most:
                raise ValueError(n)
            table = [Holder(_str(flat[j]), _str(flat[j + 1])) for j in range(0, len(flat), 2)]
            held = []
            for row in rows:
                holders = [table[int(i)] for i in _str(row).split()]
                holders.sort(key=_node_id)
                held.append(holders)
            out: list[list[Holder]] = []
            for j in range(0, len(runs), 2):
                row = held[runs[j]]
                out.extend([row.copy() for _ in range(runs[j + 1])])
            if len(out) != n:
                raise ValueError(len(out))
        except (TypeError, ValueError, IndexError):
            raise RegistryUnavailableError(f"malformed lookup answer: {reply!r:.200}") from None
        return out

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        if not keys:
            return []
        batches = list(batched(keys, BATCH_KEYS))
        with self._errors("holders"):
            replies = self._lookups([self._lookup_args(b, False, None) for b in batches])
        out: list[list[Holder]] = []
        for batch, reply in zip(batches, replies, strict=True):
            out.extend(check_answer(self._decode(reply, len(batch)), len(batch), reply, "lookup"))
        return out

    def prefix_holders(
        self, keys: Sequence[bytes], *, exclude: str | None = None
    ) -> list[list[Holder]]:
        """See :meth:`~tpusync._src.cluster.registry.PrefixRegistry.prefix_holders`: one script
        call per 1000 keys, which stops at the first key no live node other than ``exclude``
        holds (one round trip for a 512-key prefix)."""
        keys = check_keys(keys)
        check_exclude(exclude)
        out: list[list[Holder]] = []
        with self._errors("prefix_holders"):
            for batch in batched(keys, BATCH_KEYS):
                (reply,) = self._lookups([self._lookup_args(batch, True, exclude)])
                found = self._decode(reply, len(batch))
                out.extend(found)
                if len(found) < len(batch):
                    break
        return out

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
