"""How the KV store's loads run: land a lower tier's hit straight in the engine's tensors
(:mod:`tpusync._src.kv._direct`), else promote from the lower tiers, copy out of DRAM (checksums in
the copy pass), read from below what DRAM failed to serve. (A layer-by-layer load's background
run is :func:`~tpusync._src.kv.results.run_layer_load`.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tpusync._src.kv._direct import land_in_place
from tpusync._src.kv._store_calls import BlockPaths
from tpusync._src.kv._streaming import load_through_dram, reload_from_below, streams
from tpusync.errors import BlocksMissingError

__all__ = ["load_keys"]


def load_keys(
    paths: BlockPaths,
    keys: list[bytes],
    ids: np.ndarray,
    after_pool: Callable[[int], None] | None = None,
    pools: list[Any] | None = None,
    direct: bool = True,
) -> tuple[int, int]:
    """Promotes and loads pinned ``keys`` into ``ids`` of ``pools`` (default: the store's);
    returns (leading blocks loaded, blocks promoted from lower tiers). ``direct``: a hit only
    a scattering lower tier holds may land straight in the pools (:mod:`tpusync._src.kv._direct`).

    ``after_pool(i)``: called once device pool ``i`` holds the blocks copied out of DRAM,
    before their checksums are compared. A reader may then have used them, so a block that
    fails its checksum is not read again from a lower tier into the same device block: it is
    reported as not loaded (the caller recomputes it)."""
    if not keys:
        return 0, 0
    pools = paths.pools if pools is None else pools
    where = None
    if after_pool is None and direct:  # a layer-by-layer load reads DRAM hits only
        landed, where = land_in_place(paths, keys, ids, pools)
        if landed == len(keys):
            return landed, 0
        if landed:  # the rest through DRAM: the tiers below may hold what this one failed
            more, promoted = load_keys(paths, keys[landed:], ids[landed:], None, pools, False)
            return landed + more, promoted
    if streams(paths, len(keys), save=False):
        done = load_through_dram(paths, keys, ids, pools)
        _all_written(pools, after_pool)
        return done
    stack = paths.stack
    in_dram, promoted = stack.promote(keys, where=where)
    prefix = next((i for i, ok in enumerate(in_dram) if not ok), len(keys))
    if not prefix:
        return 0, promoted
    try:
        # keys, pools and ids were checked by this store (load): not again per tier
        stack.dram.get_to_device_checked(keys[:prefix], pools, ids[:prefix], paths.path, after_pool)
        loaded = prefix
    except BlocksMissingError as missing:
        if after_pool is not None:
            loaded = next((i for i, ok in enumerate(missing.loaded) if not ok), prefix)
        else:  # DRAM dropped the blocks that failed their checksum: a lower tier may hold them
            loaded, again = reload_from_below(
                paths, keys[:prefix], ids[:prefix], missing.loaded, pools
            )
            promoted += again
    stack.touch(0, keys[:loaded])
    return loaded, promoted


def _all_written(pools: list[Any], after_pool: Callable[[int], None] | None) -> None:
    for i in range(len(pools) if after_pool is not None else 0):
        after_pool(i)  # type: ignore[misc]
