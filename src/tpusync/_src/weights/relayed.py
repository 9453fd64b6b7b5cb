"""Chunks taken from relays: who holds a version, and each chunk checked against the SHA-256
its publisher put in the manifest (a relay may know the deployment secret, so neither its
authentication nor the block checksums it sends can vouch for its bytes)."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tpusync._src.cluster.dataplane import BlockClient
from tpusync._src.cluster.registry import Registry
from tpusync._src.tiers.dram import HostPool
from tpusync._src.weights.manifest import DIGEST_BYTES, relay_key
from tpusync.errors import PeerUnavailableError, TpuSyncError

__all__ = ["Waits", "relay_addresses", "take_all", "take_verified"]

log = logging.getLogger("tpusync.weights")


class DamagedChunksError(TpuSyncError):
    """A relay sent chunks that failed their block checksum."""


_BATCH = 16  # chunks a request


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
) -> tuple[np.ndarray, np.ndarray]:
    """Pulls ``keys`` (chunks ``numbers`` of a version whose manifest holds ``digests``) from
    ``client`` into ``pool``: which landed, and which of those match their digest (those that
    do not are not left in the pool). Raises DamagedChunksError when a chunk failed its block
    checksum, PeerUnavailableError when the peer is gone."""
    pool.delete(list(keys))
    result = client.pull_result(list(keys), pool)
    if result.error is not None:
        pool.delete(list(keys))
        raise PeerUnavailableError(f"{client.label}: {result.error}")
    landed = np.array(result.loaded, dtype=bool)
    if result.corrupt:  # damaged on its way or at the relay: none of it is taken
        pool.delete(list(keys))
        raise DamagedChunksError(f"{client.label} sent {result.corrupt} damaged chunks")
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
    return landed, checked


@dataclass(frozen=True)
class Waits:
    """How a take from a relay still filling waits: ``poll_s`` between rounds without a new
    chunk, giving up after ``stall_s`` of them or at ``deadline`` (monotonic) or ``stop``."""

    poll_s: float
    stall_s: float
    deadline: float
    stop: threading.Event


def take_all(
    client: BlockClient,
    keys: Sequence[bytes],
    numbers: np.ndarray,
    digests: bytes,
    pool: HostPool,
    hashers: ThreadPoolExecutor,
    waits: Waits,
    landed: Callable[[list[bytes], np.ndarray], None] | None,
) -> np.ndarray:
    """Takes chunks ``numbers`` (under ``keys``) from a relay that may still be filling: in
    order, in batches of the pool's room, each checked (:func:`take_verified`) and handed to
    ``landed(keys, numbers)`` (None: they stay in ``pool``); a chunk the relay does not have
    yet is asked again each round (so a chain of relays passes chunks on as they arrive).
    Which were taken; the rest are left for the publisher: a relay that sends a chunk that
    fails its block checksum or digest, stalls or goes away is not asked again."""
    taken = np.zeros(len(keys), dtype=bool)
    pending = np.arange(len(keys))
    batch = max(1, min(pool.capacity, _BATCH))
    last_new = time.monotonic()
    while len(pending):
        new = False
        for start in range(0, len(pending), batch):
            if time.monotonic() > waits.deadline or waits.stop.is_set():
                return taken
            at = pending[start : start + batch]
            its_keys = [keys[k] for k in at.tolist()]
            try:
                arrived, good = take_verified(client, its_keys, numbers[at], digests, pool, hashers)
            except (PeerUnavailableError, OSError, DamagedChunksError) as error:
                log.warning("tpusync weights: relay %s failed: %s", client.label, error)
                return taken
            if (arrived & ~good).any():
                log.warning(
                    "tpusync weights: relay %s sent chunks unlike their digests", client.label
                )
                return taken
            taken[at[good]] = True
            new = new or bool(good.any())
            if good.any() and landed is not None:
                landed(
                    [k for k, g in zip(its_keys, good.tolist(), strict=True) if g],
                    numbers[at[good]],
                )
        pending = pending[~taken[pending]]
        now = time.monotonic()
        if new:
            last_new = now
        elif now - last_new > waits.stall_s:
            break
        elif len(pending):
            waits.stop.wait(waits.poll_s)
    return taken
