"""Node leases, the one liveness rule every registry backend applies: a node's lease ends
``ttl_s`` after its last register or heartbeat, and at its end (``expiry <= now``) it has
lapsed -- its entries stop counting at once, a heartbeat is refused, a publish is refused, and a
register clears its old entries first. Backends with a clock of their own (Redis' key TTLs) use
only :func:`lease_ms` and :func:`not_live_message`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tpusync._src.cluster.registry.base import check_ttl

__all__ = ["has_lapsed", "lapsed_nodes", "lease_end", "lease_ms", "live_nodes", "not_live_message"]


def lease_end(ttl_s: float, now: float) -> float:
    """When a lease of ``ttl_s`` (checked) taken at ``now`` ends."""
    return now + check_ttl(ttl_s)


def lease_ms(ttl_s: float) -> int:
    """``ttl_s`` (checked) in whole milliseconds, at least one (a Redis PX TTL)."""
    return max(1, round(check_ttl(ttl_s) * 1000))


def has_lapsed(expiry: float | None, now: float) -> bool:
    """Whether a lease ending at ``expiry`` (None: no lease) no longer holds at ``now``."""
    return expiry is None or expiry <= now


def lapsed_nodes(expiries: Iterable[tuple[str, float]], now: float) -> list[str]:
    """The node ids of ``(node id, expiry)`` pairs whose lease has lapsed at ``now``."""
    return [node_id for node_id, expiry in expiries if has_lapsed(expiry, now)]


def live_nodes(expiries: Mapping[str, float], now: float) -> set[str]:
    """The node ids of ``expiries`` whose lease holds at ``now``."""
    return {node_id for node_id, expiry in expiries.items() if not has_lapsed(expiry, now)}


def not_live_message(node_id: str) -> str:
    """Why a backend refuses to publish for ``node_id`` (the same words everywhere)."""
    return f"node_id: {node_id!r} is not registered or its lease lapsed; register it first"
