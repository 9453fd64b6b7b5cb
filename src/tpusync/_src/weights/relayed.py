"""Chunks taken from relays: who holds a version, and each chunk checked against the SHA-256
its publisher put in the manifest (a relay may know the deployment secret, so neither its
authentication nor the block checksums it sends can vouch for its bytes)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tpusync._src.cluster.dataplane import BlockClient
from tpusync._src.cluster.registry import Registry
from tpusync._src.tiers.dram import HostPool
from tpusync._src.weights.manifest import DIGEST_BYTES, relay_key
from tpusync.errors import TpuSyncError

__all__ = ["relay_addresses", "take_verified"]


def relay_addresses(registry: Registry, name: str, version: int) -> list[str]:
    """The addresses of the relays that hold every chunk of ``version`` (none when the
    registry cannot be read: the publisher serves then)."""
    try:
        holders = registry.holders([relay_key(name, version)])[0]
        nodes = {n.node_id: n for n in registry.nodes()}
    except TpuSyncError:
        return []
    found = [nodes[h.node_id] for h in holders if h.node_id in nodes]
    return sorted({n.addresses[0] for n in found if n.addresses})


def take_verified(
    client: BlockClient,
    keys: Sequence[bytes],
    numbers: np.ndarray,
    digests: bytes,
    pool: HostPool,
    hashers: ThreadPoolExecutor,
) -> np.ndarray:
    """Pulls ``keys`` (chunks ``numbers`` of a version whose manifest holds ``digests``) from
    ``client`` into ``pool``; which landed with their digest. Those that did not are not left
    in the pool. Raises what the client raises (the peer gone)."""
    pool.delete(list(keys))
    landed = np.array(client.pull(list(keys), pool), dtype=bool)
    chunk_bytes = pool.layout.payload_bytes

    def matches(k: int) -> bool:
        slot = pool.slot_of(keys[k])
        if slot is None:
            return False
        with pool.slot_memory(slot) as memory:
            digest = hashlib.sha256(memory[:chunk_bytes]).digest()
        at = int(numbers[k]) * DIGEST_BYTES
        return digest == digests[at : at + DIGEST_BYTES]

    checked = np.zeros(len(keys), dtype=bool)
    indices = np.flatnonzero(landed).tolist()
    checked[indices] = list(hashers.map(matches, indices))
    bad = [keys[k] for k in np.flatnonzero(landed & ~checked).tolist()]
    if bad:
        pool.delete(bad)
    return checked
