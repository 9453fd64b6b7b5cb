"""Saves and loads of more blocks than the KV store's DRAM tier holds, streamed through it.

Every block moves through DRAM (lower tiers read from and write into DRAM slots), so a prefix
longer than DRAM passes through it in chunks:

* **Save.** Each chunk is copied from the device into DRAM and written into every writable lower
  tier at once (:meth:`TierStack.write_down`), before the next chunk's room evicts it; what is left
  at the end (no more than the last chunk) is saved as any save is, with write-back in the
  background.
  When no lower tier took a chunk, the save stops there: its blocks stay in DRAM and the rest of
  the prefix is not stored (counted in ``save_unstored_blocks``; evicting them for blocks that
  would follow an uncached one would only lose cache).
* **Load.** The blocks DRAM holds go to the device first; then the others chunk by chunk, each
  promoted into DRAM and copied to the device before the next. A block on the device needs DRAM
  no more: its pin is loosened (:meth:`TierStack.loosen`), so the next chunk's room may evict it,
  while its copies in the lower tiers stay pinned. A chunk that DRAM has no room for (other
  handles' pins) is halved, down to one block; then the load raises ``TierFullError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpusync._src.kv._store_calls import BlockPaths
from tpusync._src.kv._tier_stack import present
from tpusync.errors import BlocksMissingError, TierFullError


def streams(paths: BlockPaths, blocks: int, *, save: bool) -> bool:
    """Whether ``blocks`` must stream through DRAM: more than it holds, and a tier below to
    write them into (a save; without one, the save is refused as too large) or to read them
    from (a load)."""
    stack = paths.stack
    below = stack.can_write_down if save else len(stack.tiers) > 1
    return blocks > stack.dram.capacity and below


def save_through_dram(
    paths: BlockPaths, keys: list[bytes], ids: np.ndarray, pools: list[Any]
) -> tuple[int, int | None]:
    """Saves the leading blocks of a save larger than DRAM, chunk by chunk, each written into
    the lower tiers before the next (see the module docstring). Returns the blocks stored and
    where the rest begins (no more blocks than the last chunk that found room in DRAM, for the
    caller to save as usual), or None when the save stops (no lower tier took a chunk)."""
    stack = paths.stack
    dram = stack.dram
    stack.bump("saves_streamed", 1)
    stored_blocks = start = 0
    chunk = dram.capacity
    while len(keys) - start > chunk:
        part = slice(start, start + chunk)
        try:
            with stack.room(0, len(keys[part])):
                dram.put_from_device(keys[part], pools, ids[part], path=paths.path)
        except TierFullError:
            if chunk == 1:
                raise
            chunk = max(1, chunk // 2)  # other handles' pins take part of DRAM: a smaller one
            continue
        stored = present(dram, keys[part])
        stack.touch(0, stored)
        stack.dram_added(stored)
        stored_blocks += len(stored)
        start += len(keys[part])
        held = stack.write_down(stored)
        if len(held) < len(stored):
            stack.bump("save_unstored_blocks", len(keys) - start)
            return stored_blocks, None
    return stored_blocks, start


def load_through_dram(
    paths: BlockPaths, keys: list[bytes], ids: np.ndarray, pools: list[Any]
) -> tuple[int, int]:
    """Loads pinned ``keys`` (more than DRAM holds) into blocks ``ids`` of ``pools`` (see the
    module docstring); returns (leading blocks loaded, blocks promoted from lower tiers)."""
    stack = paths.stack
    dram = stack.dram
    n = len(keys)
    loaded = np.zeros(n, dtype=bool)
    promoted = 0
    loosened: list[bytes] = []
    try:
        in_dram = np.flatnonzero(dram.contains(keys))
        _to_device(paths, pools, keys, ids, in_dram, loaded)
        loosened += [keys[i] for i in in_dram]
        stack.loosen(loosened)
        # the rest, and the blocks DRAM failed to serve (dropped: a lower tier may hold them)
        rest = np.flatnonzero(~loaded).tolist()
        start, chunk = 0, dram.capacity
        while start < len(rest):
            part = rest[start : start + chunk]
            part_keys = [keys[i] for i in part]
            try:
                held, moved = stack.promote(part_keys)
            except TierFullError:
                if chunk == 1:
                    raise
                chunk = max(1, chunk // 2)
                continue
            promoted += moved
            _to_device(
                paths, pools, keys, ids, np.array(part)[np.asarray(held, dtype=bool)], loaded
            )
            stack.loosen(part_keys)
            loosened += part_keys
            start += len(part)
            if not loaded[: part[-1] + 1].all():  # a miss: the blocks after it serve nobody
                break
    finally:
        stack.tighten(loosened)
    prefix = int(np.argmin(loaded)) if not loaded.all() else n
    return prefix, promoted


def reload_from_below(
    paths: BlockPaths,
    keys: list[bytes],
    ids: np.ndarray,
    served: list[bool],
    pools: list[Any],
) -> tuple[int, int]:
    """After DRAM failed to serve some of pinned ``keys`` (``served`` False: DRAM dropped them
    as corrupt), reads those from the lower tiers and copies them to the device. Returns
    (leading blocks loaded, blocks promoted)."""
    loaded = np.asarray(served, dtype=bool).copy()
    failed = np.flatnonzero(~loaded)
    promoted = 0
    if len(paths.stack.tiers) > 1:
        held, promoted = paths.stack.promote([keys[i] for i in failed])
        _to_device(paths, pools, keys, ids, failed[np.asarray(held, dtype=bool)], loaded)
    return (int(np.argmin(loaded)) if not loaded.all() else len(keys)), promoted


def _to_device(
    paths: BlockPaths,
    pools: list[Any],
    keys: list[bytes],
    ids: np.ndarray,
    which: np.ndarray,
    loaded: np.ndarray,
) -> None:
    """Copies the DRAM blocks of ``keys[which]`` into device blocks ``ids[which]``; marks the
    ones served in ``loaded`` (a block that fails its checksum is dropped from DRAM)."""
    if not len(which):
        return
    subset = [keys[i] for i in which]
    try:
        paths.stack.dram.get_to_device_checked(subset, pools, ids[which], paths.path)
        loaded[which] = True
    except BlocksMissingError as missing:
        loaded[which] = missing.loaded
