"""The specs of a KV store's own tiers: :class:`DramTier` (always first), and the lower tiers
:class:`DiskTier` and :class:`SharedFsTier` (each a :class:`~tpusync._src.tiers.spec.TierSpec`:
it checks itself and opens itself for the store's layout). Tiers over other hosts have their
specs in :mod:`tpusync.cluster` (``StoreNodeTier``, ``RegistryTier``)."""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass
from typing import Any

from tpusync._src.tiers.base import LowerTier, tier_read_only
from tpusync._src.tiers.disk import DiskPool, check_disk_capacity
from tpusync._src.tiers.files import check_directory, make_directory
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.mac import MacKey, mac_key_from_secret
from tpusync._src.tiers.shared_fs import SharedFsPool
from tpusync._src.tiers.spec import OpenedTier, TierContext
from tpusync.errors import InvalidArgumentError, UnsafeFileError

__all__ = ["DiskTier", "DramTier", "ExistingTier", "SharedFsTier", "check_tier_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")  # as HostPool names


def positive(value: object, argument: str) -> int:
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


def check_tier_name(value: object, argument: str) -> None:
    """Refuses a tier name that is not a short identifier (it labels stats and errors)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidArgumentError(
            f"{argument}: {value!r} must be letters, digits, '.', '_' or '-' (at most 101, "
            "starting with a letter or digit)"
        )


@dataclass(frozen=True)
class DramTier:
    """The DRAM tier (always present): anonymous memory, or named in ``shm_dir`` so that a
    restarted process finds its blocks (and offloaded sessions) again.

    Args:
      capacity_blocks: slots in the pool.
      name: None for anonymous memory; a name to live in ``shm_dir``/tpusync-<name>.pool.
      shm_dir: where named pools live: a directory (not a symlink) of this uid or root, that
        others may write only if it is sticky (as /dev/shm, mode 1777); checked before the
        store makes anything.
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
        positive(self.capacity_blocks, "dram.capacity_blocks")
        _directory(self.shm_dir, "dram.shm_dir")
        if self.name is not None and not _NAME.match(str(self.name)):
            raise InvalidArgumentError(
                f"dram.name: {self.name!r} must be letters, digits, '.', '_' or '-' "
                "(at most 101, starting with a letter or digit)"
            )
        if self.on_mismatch not in ("error", "recreate"):
            raise InvalidArgumentError(
                f"dram.on_mismatch: expected 'error' or 'recreate', got {self.on_mismatch!r}"
            )


class _DirectoryTier:
    """What the local file tiers share: a directory that must exist unless ``create``."""

    name: str
    directory: str | os.PathLike[str]
    create: bool

    def _check_directory(self) -> None:
        """Refuses, before anything is made: a missing directory without ``create``, and one
        that is no directory, a symlink, another uid's or writable by others."""
        path = os.fspath(self.directory)
        argument = f"{self.name}.directory"
        if not os.path.lexists(path):
            if not self.create:
                kind = type(self).__name__
                raise InvalidArgumentError(
                    f"{argument}: {path} does not exist; create it (or mount its filesystem) "
                    f"first, or pass {kind}(..., create=True) to have the store create it"
                )
            return
        if not os.path.islink(path) and not os.path.isdir(path):
            raise InvalidArgumentError(f"{argument}: {path} is not a directory; give a directory")
        check_directory(path, argument=argument)  # a symlink, another uid's, open to others

    def _room_directory(self) -> str:
        """The existing directory whose filesystem will hold the tier: its own, or the nearest
        parent that exists when the store is to create it."""
        path = os.path.abspath(os.fspath(self.directory))
        while not os.path.isdir(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        return path

    def _make_directory(self) -> None:
        """Creates the directory (0700) if it is missing and ``create`` asks for it."""
        path = os.fspath(self.directory)
        if not self.create or os.path.lexists(path):
            return
        try:
            make_directory(path)
        except UnsafeFileError:  # something unsafe appeared there meanwhile: its own message
            raise
        except OSError as exc:
            raise InvalidArgumentError(
                f"{self.name}.directory: cannot create {path}: {exc.strerror or exc}"
            ) from None


@dataclass(frozen=True)
class DiskTier(_DirectoryTier):
    """A local-SSD tier (:class:`tpusync.tiers.DiskPool`) in ``directory``.

    Args:
      directory: where the pool's files live. It must exist (the store refuses a missing one:
        an unmounted disk or a typo would otherwise fill another filesystem), unless ``create``;
        be this uid's, writable by it alone; and not be a symlink (give its target).
      capacity_blocks: slots of the store's block size; refused at start when its files would
        not fit in the directory's filesystem, or its index (about 128 B a block) in memory.
      durability: ``"commit"`` (a block counts as stored once its data and record are synced)
        or ``"none"`` (faster; after power loss recent blocks may be missing, never wrong).
      create: create ``directory`` (mode 0700, with its missing parents) when it is missing.
      name: the tier's name in the store (its stats and errors).
    """

    directory: str | os.PathLike[str]
    capacity_blocks: int
    durability: str = "commit"
    direct_io: bool | str = "auto"
    create: bool = False
    name: str = "disk"

    def __post_init__(self) -> None:
        check_tier_name(self.name, "disk.name")
        _directory(self.directory, f"{self.name}.directory")
        _flag(self.create, f"{self.name}.create")
        positive(self.capacity_blocks, f"{self.name}.capacity_blocks")
        _durability(self.durability, f"{self.name}.durability")
        if not (self.direct_io is True or self.direct_io is False or self.direct_io == "auto"):
            raise InvalidArgumentError(
                f"{self.name}.direct_io: expected True, False or 'auto', got {self.direct_io!r}"
            )

    def check(self, context: TierContext) -> None:
        self._check_directory()
        if context.layout is not None:  # sizes against this host, before anything is made
            check_disk_capacity(
                f"{self.name}.capacity_blocks",
                self.capacity_blocks,
                context.layout.slot_bytes,
                self._room_directory(),
            )

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        self._make_directory()
        pool = DiskPool(
            layout,
            self.capacity_blocks,
            self.directory,
            durability=self.durability,
            direct_io=self.direct_io,
        )
        return OpenedTier(pool)


@dataclass(frozen=True)
class SharedFsTier(_DirectoryTier):
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
      name: the tier's name in the store (its stats and errors).
    """

    directory: str | os.PathLike[str]
    capacity_blocks: int | None = None
    durability: str = "commit"
    create: bool = False
    mac: bool = False
    name: str = "shared_fs"

    def __post_init__(self) -> None:
        check_tier_name(self.name, "shared_fs.name")
        _directory(self.directory, f"{self.name}.directory")
        _flag(self.create, f"{self.name}.create")
        _flag(self.mac, f"{self.name}.mac")
        if self.capacity_blocks is not None:
            positive(self.capacity_blocks, f"{self.name}.capacity_blocks")
        _durability(self.durability, f"{self.name}.durability")

    def check(self, context: TierContext) -> None:
        self._check_directory()
        self.mac_key(context)

    def mac_key(self, context: TierContext) -> MacKey | None:
        """The MAC key when ``mac`` is on; refuses the public default secret, which would let
        anyone make tags that verify."""
        if not self.mac:
            return None
        if context.default_secret:
            raise InvalidArgumentError(
                f"{self.name}.mac: needs the deployment's own KVStoreConfig.secret; the default "
                "development secret is public, so anyone could forge blocks that verify"
            )
        return mac_key_from_secret(context.secret, argument="secret")

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        self._make_directory()
        pool = SharedFsPool(
            layout,
            self.directory,
            capacity=self.capacity_blocks,
            durability=self.durability,
            mac_key=self.mac_key(context),
        )
        return OpenedTier(pool)


@dataclass(frozen=True)
class ExistingTier:
    """A lower tier the caller opened and keeps: the store uses it as it is (its layout must be
    the store's: ``store.layout``) and does not close it. A tier with ``read_only = True`` is
    only read. Prefer a spec that opens the tier for the store (``StoreNodeTier``,
    ``RegistryTier`` of :mod:`tpusync.cluster`, or your own
    :class:`~tpusync._src.tiers.spec.TierSpec`): no layout to build."""

    name: str
    tier: Any

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not isinstance(self.tier, LowerTier):
            raise InvalidArgumentError(
                f"ExistingTier: expected a name and a LowerTier, got "
                f"{(self.name, self.tier)!r:.100}"
            )

    def check(self, context: TierContext) -> None:
        pass  # its layout is checked against the store's before anything opens

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        return OpenedTier(self.tier, read_only=tier_read_only(self.tier), owned=False)
