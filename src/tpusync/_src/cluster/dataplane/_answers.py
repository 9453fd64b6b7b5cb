"""The data plane client's checks of what a server answers: a malformed answer is the peer's
fault (a ``StreamError`` or ``PeerUnavailableError``), never a crash of the client."""

from __future__ import annotations

from typing import Any

import numpy as np

from tpusync._src.cluster.dataplane.protocol import StreamError
from tpusync.errors import PeerUnavailableError

__all__ = ["bool_list", "check_lease"]


def bool_list(answer: Any, field_name: str, n: int) -> list[bool]:
    """``answer[field_name]``: a list of ``n`` booleans (a StreamError when malformed)."""
    value = answer.get(field_name) if isinstance(answer, dict) else None
    if not isinstance(value, list) or len(value) != n or not all(type(v) is bool for v in value):
        raise StreamError(f"malformed put answer: {answer!r:.200}")
    return value


def check_lease(lease: Any, n: int) -> tuple[int, np.ndarray, np.ndarray, float]:
    """The fields of an acquire answer, checked (PeerUnavailableError when malformed)."""
    try:
        lease_id = lease["lease"]
        present = lease["present"]
        checksums = lease["checksums"]
        ttl = lease["ttl_s"]
        if (
            type(lease_id) is not int
            or not isinstance(present, list)
            or not isinstance(checksums, list)
            or len(present) != n
            or len(checksums) != n
            or not all(type(p) is bool for p in present)
            or not all(type(c) is int and 0 <= c < 2**64 for c in checksums)
            or not isinstance(ttl, int | float)
            or not ttl > 0
        ):
            raise TypeError
    except (KeyError, TypeError):
        raise PeerUnavailableError(f"malformed acquire answer: {lease!r:.200}") from None
    return (
        lease_id,
        np.array(present, dtype=bool),
        np.array(checksums, dtype=np.uint64),
        float(ttl),
    )
