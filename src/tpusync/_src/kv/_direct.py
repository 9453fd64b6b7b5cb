"""Loads that skip DRAM: a hit that only a lower tier able to land blocks in place holds (a
store node, the cluster's peers, the disk tier) is received straight into the engine's CPU
tensors, each block checked where it lands, instead of into DRAM slots and then copied out of
them. The block is not kept in DRAM after: the engine holds it now, and a second copy would
cost as much as the load saved."""

from __future__ import annotations

from typing import Any

import numpy as np

from tpusync._src.kv._store_calls import BlockPaths
from tpusync._src.tiers.base import ScatteringTier
from tpusync._src.tiers.scatter import still_in_place, tensor_landing

__all__ = ["land_in_place"]


def land_in_place(
    paths: BlockPaths, keys: list[bytes], ids: np.ndarray, pools: list[Any]
) -> tuple[int, list[int] | None]:
    """Lands pinned ``keys`` in ``ids`` of ``pools`` straight from the one scattering tier
    that holds them all; returns (leading blocks landed, the tiers holding each key when they
    were located, else None). 0 blocks when the load cannot go this way: a key in DRAM, keys
    spread over tiers, or pools that are not CPU tensors with contiguous pieces."""
    stack = paths.stack
    scattering = [
        t for t in range(1, len(stack.tiers)) if isinstance(stack.tiers[t], ScatteringTier)
    ]
    if not scattering or len(set(keys)) != len(keys) or any(stack.dram.contains_checked(keys)):
        return 0, None
    # before any request to a tier: blocks a save holds are refused at once, not after a
    # round trip to a node that may be stalled
    scatter = tensor_landing(paths.layout, pools, ids)
    if scatter is None:
        return 0, None
    if len(stack.tiers) == 2:  # DRAM and one tier, a scattering one (checked above)
        # the only tier below DRAM: its own lease says which keys it holds, so no round trip
        # to ask first (a miss there is a miss anywhere)
        tier = 1
    else:
        where = stack.locate(keys, prefix=False)
        if where[0] not in scattering or any(t != where[0] for t in where):
            return 0, where
        tier = where[0]
    loaded = stack.get_scattered(tier, keys, scatter)
    landed = next((i for i, ok in enumerate(loaded) if not ok), len(keys))
    if not still_in_place(pools):
        landed = 0
    stack.bump("direct_loads", landed)
    return landed, None
