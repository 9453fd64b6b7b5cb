"""What a store asks of the link that tells peers about its blocks (the cluster layer's registry
link, :mod:`tpusync.cluster.serving`): a protocol, so that kv imports no cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["PeerLink"]


class PeerLink(Protocol):
    """Told of the keys a store's DRAM (and disk) gains and loses; answers whether the other
    shards of a tensor-parallel model hold a prefix too."""

    def added(self, keys: Sequence[bytes]) -> None:
        """The store holds ``keys`` now (queued: never blocks a save)."""
        ...

    def removed(self, keys: Sequence[bytes]) -> None:
        """The store no longer holds ``keys`` (queued)."""
        ...

    def flush_changes(self) -> None:
        """Sends every queued change now."""
        ...

    def common_prefix(self, keys_per_shard: Sequence[Sequence[bytes]]) -> int:
        """How many leading blocks every shard's keys are held for, across the peers."""
        ...

    def close(self) -> None:
        """Stops the link and withdraws the store from its peers."""
        ...
