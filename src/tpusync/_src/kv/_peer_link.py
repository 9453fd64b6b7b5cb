"""What a store asks of the link that tells peers about its blocks (the cluster layer's registry
link, :mod:`tpusync._src.cluster.serving`): a protocol, so that kv imports no cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["PeerLink", "watch_removals"]


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


def watch_removals(stack: Any, link: PeerLink, include_disk: bool) -> None:
    """Tells ``link`` of the keys the store no longer holds: those DRAM drops, or with
    ``include_disk`` those neither DRAM nor the disk tier holds any more (a block still on
    disk is still served, so still listed)."""
    disk = stack.names.index("disk") if include_disk and "disk" in stack.names else None
    if disk is None:
        stack.on_dram_removed = link.removed
        return

    def dram_removed(keys: list[bytes]) -> None:
        held = stack.tiers[disk].contains(keys)
        link.removed([k for k, h in zip(keys, held, strict=True) if not h])

    def lower_removed(tier: int, keys: list[bytes]) -> None:
        if tier == disk:
            held = stack.dram.contains(keys)
            link.removed([k for k, h in zip(keys, held, strict=True) if not h])

    stack.on_dram_removed = dram_removed
    stack.on_lower_removed = lower_removed
