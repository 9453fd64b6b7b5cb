"""Checks a KVCacheStore makes before it opens anything: that its configuration agrees with the
device pools it is given, that every tier the caller opened holds blocks of the store's own
layout, that every tier spec passes its own check (directories that exist or may be created, a
MAC key that is not public, sizes the disk can hold), and that the DRAM tier fits in memory (and
a named one in an ``shm_dir`` nobody else can tamper with).

Each of these mistakes was accepted once and gave wrong output or filled the wrong filesystem
later: a ``block_size`` other than the pools' keys blocks wrongly (a later load gives wrong
logits); a tier of another layout never serves a hit (or is fed blocks it cannot hold); a
missing disk directory (an unmounted disk, a typo) silently became a directory on ``/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.tier_specs import ExistingTier
from tpusync._src.memory.device_pool import DevicePool
from tpusync._src.memory.torch_tensors import TorchPool
from tpusync._src.tiers.dram import pool_bytes, pool_path
from tpusync._src.tiers.files import check_shm_dir
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.room import check_room, held_bytes
from tpusync._src.tiers.spec import TierContext
from tpusync.errors import (
    BlockIndexError,
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)

__all__ = [
    "check_block_ids",
    "check_dram_room",
    "check_existing_tier_layouts",
    "check_other_pools",
    "check_skip_blocks",
    "check_tiers",
    "check_token_axis",
]

_VLLM_CPU_HINT = "e.g. token_axis=2 for vLLM's CPU layout [num_blocks, kv_heads, block_size, ...]"


def check_device_pools(device_pools: Any, axis: int) -> int:
    """Refuses anything but a non-empty list of DevicePools or TorchPools with one number of
    blocks on ``axis``; returns that number."""
    if isinstance(device_pools, DevicePool | TorchPool) or not isinstance(device_pools, Sequence):
        raise InvalidArgumentError(
            "device_pools: expected a list of DevicePools (one per KV array), got "
            f"{type(device_pools).__name__}"
        )
    if not device_pools:
        raise InvalidArgumentError("device_pools: the list is empty; give the KV arrays")
    for i, pool in enumerate(device_pools):
        if not isinstance(pool, DevicePool | TorchPool):
            raise InvalidArgumentError(
                f"device_pools[{i}]: expected a DevicePool, got {type(pool).__name__}; "
                "wrap the engine's KV arrays in tpusync.DevicePool (a torch engine's CPU "
                "KV tensors in tpusync.TorchPool)"
            )
        counts = {pool.shape[axis] if axis < len(pool.shape) else -1 for pool in device_pools}
    if len(counts) != 1 or -1 in counts:
        raise InvalidArgumentError(
            f"device_pools: every pool needs the same number of blocks on block_axis={axis}; "
            f"got {sorted(counts)}"
        )
    return counts.pop()


def check_token_axis(config: KVStoreConfig, pools: Sequence[DevicePool]) -> None:
    """Raises :class:`ShapeMismatchError` unless every pool holds ``config.block_size`` tokens
    on its token axis (``config.pool_token_axis``)."""
    axis = config.pool_token_axis
    named = f"token_axis={axis}" + (
        " (the default: block_axis + 1)" if config.token_axis is None else ""
    )
    for i, pool in enumerate(pools):
        shape = tuple(pool.shape)
        if axis >= len(shape):
            raise ShapeMismatchError(
                f"token_axis: {named} is out of range for device_pools[{i}] of shape {shape}; "
                f"set token_axis to the pools' axis that holds a block's {config.block_size} "
                "tokens"
            )
        if shape[axis] != config.block_size:
            raise ShapeMismatchError(
                f"block_size: {config.block_size} tokens per block, but device_pools[{i}] of "
                f"shape {shape} holds {shape[axis]} on {named}; set block_size={shape[axis]} "
                "if that is the engine's block size, or set token_axis to the pools' axis of a "
                f"block's tokens ({_VLLM_CPU_HINT})"
            )


def _layout_difference(tier: PoolLayout, own: PoolLayout) -> tuple[type[Exception], str] | None:
    """How ``tier`` differs from ``own`` (the error class and a phrase), or None if the same."""
    if tier.fingerprint == own.fingerprint:
        return None
    if tier.model_id != own.model_id:
        return InvalidArgumentError, f"model_id {tier.model_id!r}, this store's {own.model_id!r}"
    if len(tier.arrays) != len(own.arrays):
        return ShapeMismatchError, (
            f"{len(tier.arrays)} arrays per block, this store's pools {len(own.arrays)}"
        )
    for i, (theirs, ours) in enumerate(zip(tier.arrays, own.arrays, strict=True)):
        for name, error in (
            ("dtype", DtypeMismatchError),
            ("shard_block_shape", ShapeMismatchError),
            ("block_axis", ShapeMismatchError),
            ("n_shards", ShapeMismatchError),
            ("name", InvalidArgumentError),
        ):
            if getattr(theirs, name) != getattr(ours, name):
                return error, (
                    f"arrays[{i}].{name} {getattr(theirs, name)!r}, this store's pools "
                    f"{getattr(ours, name)!r}"
                )
    return InvalidArgumentError, (
        f"layout fingerprint {tier.fingerprint.hex()}, this store's {own.fingerprint.hex()}"
    )


def check_existing_tier_layouts(tiers: Sequence[Any], own: PoolLayout) -> None:
    """Raises (an :class:`InvalidArgumentError`) unless every tier the caller opened (an
    :class:`~tpusync.kv.ExistingTier`) holds blocks of the store's own layout ``own`` (same
    model id, arrays, dtypes and shapes)."""
    for i, spec in enumerate(tiers):
        if not isinstance(spec, ExistingTier):
            continue
        name, tier = spec.name, spec.tier
        layout = getattr(tier, "layout", None)
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"tiers[{i}] ({name!r}): its layout is a {type(layout).__name__}, not a "
                "tpusync.tiers.PoolLayout; build the tier with the store's layout"
            )
        difference = _layout_difference(layout, own)
        if difference is not None:
            error, what = difference
            raise error(
                f"tiers[{i}] ({name!r}): the tier was built for another block layout "
                f"({what}); build it with the layout of this store's pools: "
                "PoolLayout.from_pools(model_id, pools, block_axis=...) with the config's "
                "model_id and block_axis, or store.layout"
            )


def check_dram_room(config: KVStoreConfig, layout: PoolLayout) -> None:
    """Refuses a DRAM tier this host cannot hold, before anything is made: more than the memory
    available (prefaulting it would wake the OOM killer), and for a named pool an ``shm_dir``
    that another user could tamper with (:func:`~tpusync._src.tiers.files.check_shm_dir`) or that
    lacks the room. A named pool already there counts as room (a restart re-attaches it)."""
    dram = config.dram
    capacity = dram.capacity_blocks
    fix = f"lower dram.capacity_blocks ({capacity} blocks of {layout.slot_bytes} B)"
    if dram.name is None:
        check_room("dram.capacity_blocks", capacity * layout.slot_bytes, fix=fix)
        return
    check_shm_dir(dram.shm_dir, "dram.shm_dir")
    need = pool_bytes(layout, capacity)
    held = held_bytes([pool_path(dram.name, dram.shm_dir)])
    check_room("dram.capacity_blocks", need, held=held, fix=fix)
    check_room(
        "dram.capacity_blocks",
        need,
        directory=dram.shm_dir,
        held=held,
        fix=f"{fix}, or enlarge dram.shm_dir (e.g. docker run --shm-size)",
    )


def check_tiers(config: KVStoreConfig, context: TierContext) -> None:
    """Has every lower tier spec check itself (a missing directory not to be created, a MAC
    with the public default secret, a size its disk cannot hold, ...) before any tier is
    opened."""
    for spec in config.tiers:
        spec.check(context)


def check_block_ids(block_ids: Any, needed: int, *, at_most: bool, limit: int) -> np.ndarray:
    """Device block ids as int64: in ``0..limit-1``, unique, and ``needed`` of them (or, with
    ``at_most``, 1..needed; without, at least ``needed`` — extra ids are ignored)."""
    argument = "device_block_ids"
    if isinstance(block_ids, str | bytes) or block_ids is None:
        raise InvalidArgumentError(f"{argument}: expected a list of block ids, got {block_ids!r}")
    try:
        ids = np.asarray(block_ids)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{argument}: not a list of block ids ({error})") from None
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):  # floats, bools, objects
        raise InvalidArgumentError(
            f"{argument}: expected a 1-D list of integer block ids, got shape {ids.shape} "
            f"dtype {ids.dtype}"
        )
    ids = ids.astype(np.int64)
    if at_most:
        if len(ids) > needed:
            raise InvalidArgumentError(
                f"{argument}: {len(ids)} block ids for a hit of {needed} blocks; give at "
                "most one per cached block"
            )
    elif len(ids) < needed:
        raise InvalidArgumentError(
            f"{argument}: {len(ids)} block ids for {needed} blocks; give one per block"
        )
    else:
        ids = ids[:needed]
    status = _core.block_ids_status(ids, limit)
    if status == 1:
        raise BlockIndexError(
            f"{argument}: ids must be in 0..{limit - 1}, got {int(ids.min())}..{int(ids.max())}"
        )
    if status == 2:
        raise BlockIndexError(f"{argument}: a block id appears more than once")
    return ids


def check_other_pools(
    pools: Any, config: KVStoreConfig, layout: PoolLayout
) -> tuple[list[Any], int]:
    """``pools`` checked to hold blocks of ``layout`` (a store's; any number of blocks): the
    pools and their number of blocks."""
    axis = config.block_axis
    try:
        count = check_device_pools(pools, axis)
        theirs = PoolLayout.from_pools(config.model_id, list(pools), block_axis=axis)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"pools: {error}") from None
    if theirs.fingerprint != layout.fingerprint:
        raise InvalidArgumentError(
            "pools: their blocks are not this store's (each pool needs the dtype and the "
            "block shape of the store's pool at its index, in the same order); got "
            f"{[(a.dtype, a.shard_block_shape) for a in theirs.arrays]}, the store has "
            f"{[(a.dtype, a.shard_block_shape) for a in layout.arrays]}"
        )
    return list(pools), count


def check_skip_blocks(skip_blocks: Any, hit_blocks: int) -> None:
    """Refuses a ``skip_blocks`` that is not 0 to the hit's number of blocks."""
    if type(skip_blocks) is not int or not 0 <= skip_blocks <= hit_blocks:
        raise InvalidArgumentError(
            f"skip_blocks: expected 0 to the hit's {hit_blocks} blocks, got {skip_blocks!r}"
        )
