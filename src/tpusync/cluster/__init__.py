"""Across hosts: the registry of who holds which block (and, to come, leases, the TCP data plane
and store nodes)."""

from tpusync.cluster.registry import (
    Holder,
    MemoryRegistry,
    NodeInfo,
    Registry,
    longest_common_prefix,
    longest_prefix,
)

__all__ = [
    "Holder",
    "MemoryRegistry",
    "NodeInfo",
    "Registry",
    "longest_common_prefix",
    "longest_prefix",
]
