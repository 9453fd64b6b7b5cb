"""Typed configuration of a KV cache store: its namespace, its tiers and their capacities."""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tpusync.errors import InvalidArgumentError
from tpusync.kv.keys import DEFAULT_SECRET, KeyScheme

__all__ = ["DiskTier", "DramTier", "KVStoreConfig", "SharedFsTier"]

WRITEBACK_POLICIES = ("wait", "skip")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")  # as HostPool names


def _positive(value: object, argument: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"{argument}: expected a positive int, got {value!r}")
    return int(value)


def _durability(value: object, argument: str) -> None:
    if value not in ("commit", "none"):
        raise InvalidArgumentError(f"{argument}: expected 'commit' or 'none', got {value!r}")


def _directory(value: object, argument: str) -> str:
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise InvalidArgumentError(f"{argument}: expected a directory path, got {value!r}")
    return os.fspath(value)


def _flag(value: object, argument: str) -> None:
    if value is not True and value is not False:
        raise InvalidArgumentError(f"{argument}: expected True or False, got {value!r}")


def _axis(value: object, argument: str) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{argument}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True)
class DramTier:
    """The DRAM tier (always present): anonymous memory, or named in ``shm_dir`` so that a
    restarted process finds its blocks (and offloaded sessions) again.

    Args:
      capacity_blocks: slots in the pool.
      name: None for anonymous memory; a name to live in ``shm_dir``/tpusync-<name>.pool.
      shm_dir: where named pools live.
      populate: touch every page at creation (copies never pay page faults).
      on_mismatch: a named pool in ``shm_dir`` that holds another model, block layout or
        capacity, or is damaged: ``"error"`` refuses it (the store does not open, the file
        stays); ``"recreate"`` deletes it and starts a cold pool (see
        :class:`tpusync.tiers.HostPool`).
    """

    capacity_blocks: int
    name: str | None = None
    shm_dir: str = "/dev/shm"
    populate: bool = True
    on_mismatch: str = "error"

    def __post_init__(self) -> None:
        _positive(self.capacity_blocks, "dram.capacity_blocks")
        if self.name is not None and not _NAME.match(str(self.name)):
            raise InvalidArgumentError(
                f"dram.name: {self.name!r} must be letters, digits, '.', '_' or '-' "
                "(at most 101, starting with a letter or digit)"
            )
        if self.on_mismatch not in ("error", "recreate"):
            raise InvalidArgumentError(
                f"dram.on_mismatch: expected 'error' or 'recreate', got {self.on_mismatch!r}"
            )


@dataclass(frozen=True)
class DiskTier:
    """A local-SSD tier (:class:`tpusync.tiers.DiskPool`) in ``directory``.

    Args:
      directory: where the pool's files live. It must exist (the store refuses a missing one:
        an unmounted disk or a typo would otherwise fill another filesystem), unless ``create``.
      durability: ``"commit"`` (a block counts as stored once its data and record are synced)
        or ``"none"`` (faster; after power loss recent blocks may be missing, never wrong).
      create: create ``directory`` (mode 0700, with its missing parents) when it is missing.
    """

    directory: str | os.PathLike[str]
    capacity_blocks: int
    durability: str = "commit"
    direct_io: bool | str = "auto"
    create: bool = False

    def __post_init__(self) -> None:
        _directory(self.directory, "disk.directory")
        _flag(self.create, "disk.create")
        _positive(self.capacity_blocks, "disk.capacity_blocks")
        _durability(self.durability, "disk.durability")
        if not (self.direct_io is True or self.direct_io is False or self.direct_io == "auto"):
            raise InvalidArgumentError(
                f"disk.direct_io: expected True, False or 'auto', got {self.direct_io!r}"
            )


@dataclass(frozen=True)
class SharedFsTier:
    """A shared-filesystem tier (:class:`tpusync.tiers.SharedFsPool`) that other hosts read.

    Args:
      directory: the shared directory. It must exist (the store refuses a missing one: a
        filesystem that is not mounted must not silently become a local directory), unless
        ``create``.
      capacity_blocks: None for no limit of ours (the filesystem's size is the limit).
      create: create ``directory`` (mode 0700, with its missing parents) when it is missing.
      mac: authenticate every block file with a Poly1305 MAC keyed from ``KVStoreConfig.secret``
        (which must then be the deployment's own): a block forged by anyone who can write the
        directory but lacks the secret is a miss. For filesystems whose writers are not all
        this deployment (object stores through FUSE, exports others mount). See the README's
        security section for what it costs.
    """

    directory: str | os.PathLike[str]
    capacity_blocks: int | None = None
    durability: str = "commit"
    create: bool = False
    mac: bool = False

    def __post_init__(self) -> None:
        _directory(self.directory, "shared_fs.directory")
        _flag(self.create, "shared_fs.create")
        _flag(self.mac, "shared_fs.mac")
        if self.capacity_blocks is not None:
            _positive(self.capacity_blocks, "shared_fs.capacity_blocks")
        _durability(self.durability, "shared_fs.durability")


@dataclass(frozen=True)
class KVStoreConfig:
    """Everything a :class:`~tpusync.kv.KVCacheStore` needs besides its device pools.

    Args:
      model_id, weight_version, salt, shard_rank, shard_count: the namespace (see
        :class:`~tpusync.kv.Namespace`); blocks are shared only within one namespace.
      block_size: tokens per block; every device pool must hold this many on ``token_axis``
        (the store refuses pools that disagree: their blocks would be keyed wrongly).
      dram, disk, shared_fs: the tiers, top down. DRAM is always first.
      secret: the deployment secret that keys every block hash. The default is a fixed
        development secret: fine for one trusted deployment, but give your own wherever tenants
        or hosts should not be able to compute each other's keys.
      key_scheme: how tokens become keys (default :class:`~tpusync.kv.Blake2bChainKeys`).
      extra_tiers: ``(name, tier)`` pairs of lower tiers the caller opened (any
        :class:`~tpusync.tiers.LowerTier`, e.g. a :class:`tpusync.cluster.RemotePool` reading
        another host's DRAM), searched after disk and shared FS. A tier with ``read_only =
        True`` is only read (hits are promoted into DRAM), never written or evicted from. The
        store does not close them.
      block_axis: the block axis of every device pool (vLLM's ``(2, num_blocks, ...)``: 1).
      token_axis: the axis of every device pool (counted in the pool's own shape) that holds a
        block's tokens. None: the one after ``block_axis``, as in ``(num_blocks, block_size,
        kv_heads, head_dim)``; give it for other layouts, e.g. 2 for
        ``(num_blocks, kv_heads, block_size, head_dim)``.
      writeback_max_bytes: bytes saved to DRAM but not yet written to the lower tiers that may
        be queued; beyond it ``writeback_policy`` applies.
      writeback_policy: ``"wait"`` — a save waits until the queue has room (the device blocks
        stay held longer); ``"skip"`` — the blocks stay in DRAM only, and are written down when
        DRAM evicts them. Either way memory stays bounded.
      path: the transfer path (``"auto"``, ``"native"`` or ``"jax"``).
    """

    model_id: str
    block_size: int
    dram: DramTier
    disk: DiskTier | None = None
    shared_fs: SharedFsTier | None = None
    weight_version: str = "0"
    salt: bytes = b""
    shard_rank: int = 0
    shard_count: int = 1
    secret: bytes = field(default=DEFAULT_SECRET, repr=False)
    key_scheme: KeyScheme | None = None
    extra_tiers: tuple[tuple[str, Any], ...] = ()
    block_axis: int = 0
    token_axis: int | None = None
    writeback_max_bytes: int = 256 << 20
    writeback_policy: str = "wait"
    path: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidArgumentError(
                f"model_id: expected a non-empty string, got {self.model_id!r}"
            )
        _positive(self.block_size, "block_size")
        if not isinstance(self.dram, DramTier):
            raise InvalidArgumentError(
                f"dram: expected a DramTier(capacity_blocks=...), got {type(self.dram).__name__}"
            )
        if self.disk is not None and not isinstance(self.disk, DiskTier):
            raise InvalidArgumentError(
                f"disk: expected a DiskTier or None, got {type(self.disk).__name__}"
            )
        if self.shared_fs is not None and not isinstance(self.shared_fs, SharedFsTier):
            raise InvalidArgumentError(
                f"shared_fs: expected a SharedFsTier or None, got {type(self.shared_fs).__name__}"
            )
        _axis(self.block_axis, "block_axis")
        if self.token_axis is not None:
            _axis(self.token_axis, "token_axis")
            if self.token_axis == self.block_axis:
                raise InvalidArgumentError(
                    f"token_axis: {self.token_axis} is also the block_axis; give the axis that "
                    "holds a block's tokens (None: the one after block_axis)"
                )
        _positive(self.writeback_max_bytes, "writeback_max_bytes")
        if self.writeback_policy not in WRITEBACK_POLICIES:
            raise InvalidArgumentError(
                f"writeback_policy: expected 'wait' or 'skip', got {self.writeback_policy!r}"
            )
        if self.path not in ("auto", "native", "jax"):
            raise InvalidArgumentError(
                f"path: expected 'auto', 'native' or 'jax', got {self.path!r}"
            )
        from tpusync.tiers.base import LowerTier

        names = {"dram", "disk", "shared_fs"}
        for i, entry in enumerate(self.extra_tiers):
            if (
                not isinstance(entry, tuple)
                or len(entry) != 2
                or not isinstance(entry[0], str)
                or not isinstance(entry[1], LowerTier)
            ):
                raise InvalidArgumentError(
                    f"extra_tiers[{i}]: expected a (name, LowerTier) pair, got {entry!r:.100}"
                )
            if entry[0] in names:
                raise InvalidArgumentError(
                    f"extra_tiers[{i}]: the name {entry[0]!r} is taken; give each tier its own"
                )
            names.add(entry[0])
        if self.key_scheme is not None and not isinstance(self.key_scheme, KeyScheme):
            raise InvalidArgumentError(
                "key_scheme: expected an object with name, namespace_tag(), block_keys() and "
                f"tail_key(), got {type(self.key_scheme).__name__}"
            )

    @property
    def pool_token_axis(self) -> int:
        """The device pools' token axis: ``token_axis``, or the one after ``block_axis``."""
        return self.block_axis + 1 if self.token_axis is None else self.token_axis
