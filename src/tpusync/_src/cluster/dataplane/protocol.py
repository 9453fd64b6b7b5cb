"""The data plane's protocol: its name and version, request limits, the timing rule's fraction,
and the checks of request parameters every block server applies (see
:mod:`tpusync._src.cluster.dataplane`)."""

from __future__ import annotations

from typing import Any

from tpusync._src.cluster._handshake import parse_address
from tpusync._src.cluster.registry.base import check_keys
from tpusync.errors import InvalidArgumentError, PeerUnavailableError

__all__ = [
    "DEADLINE_FRACTION",
    "MAX_ERROR_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "PROTOCOL",
    "VERSION",
    "ConnectionLost",
    "StreamError",
    "keys_param",
    "lease_param",
    "parse_path",
    "ttl_param",
]

PROTOCOL = "tpusync-blocks"
VERSION = 1
MAX_KEYS_PER_REQUEST = 4096
MAX_ERROR_BYTES = 4096
DEADLINE_FRACTION = 0.8  # a pull's deadline: this share of the granted TTL (the timing rule)
TLS_HASH_STEP = 64 << 10  # bytes a TLS receive gathers before hashing them (as recv_exact)


class ConnectionLost(PeerUnavailableError):
    """The server closed or reset a connection (e.g. an idle one it timed out): worth one retry
    on a fresh connection."""


class StreamError(Exception):
    """The block stream of one connection cannot continue (the connection is dropped)."""


def keys_param(value: Any) -> list[bytes]:
    if not isinstance(value, list) or len(value) > MAX_KEYS_PER_REQUEST:
        raise InvalidArgumentError(
            f"keys: expected a list of at most {MAX_KEYS_PER_REQUEST} hex strings"
        )
    out = []
    for i, item in enumerate(value):
        try:
            out.append(bytes.fromhex(item))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"keys[{i}]: expected a hex string") from None
    return check_keys(out)


def lease_param(value: Any) -> int:
    if type(value) is not int or not 0 < value < 2**63:
        raise InvalidArgumentError(f"lease: expected a lease id, got {value!r:.50}")
    return value


def ttl_param(value: Any, default: float, top: float) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise InvalidArgumentError(f"ttl_s: expected seconds > 0, got {value!r:.50}")
    return min(float(value), top)


def parse_path(text: str) -> tuple[tuple[str, int] | None, tuple[str, int]]:
    """``"remote"`` or ``"local>remote"``: remote is ``"host:port"``; local is a host (bound
    with port 0) or ``"host:port"`` / ``"[v6]:port"``."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"addresses: expected 'host:port' strings, got {text!r}")
    if ">" not in text:
        return None, parse_address(text)
    local, _, remote = text.partition(">")
    remote_address = parse_address(remote)
    host, port = local, "0"
    if local.startswith("[") or local.count(":") == 1:
        host, _, port = local.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgumentError(
            f"addresses: {text!r}: expected 'local>host:port' with a local host or host:port"
        )
    return (host, int(port)), remote_address
