"""Tier specs: the typed, plain description of a lower tier that a KV store opens itself.

A store's configuration lists its lower tiers as specs (``KVStoreConfig(tiers=(DiskTier(...),
SharedFsTier(...), StoreNodeTier(...)))``). Before it opens anything the store calls every
spec's :meth:`TierSpec.check` (a refusal changes nothing); then it calls
:meth:`TierSpec.open` with the store's block layout and a :class:`TierContext`, top down, and
closes what each returned as owned when it closes. A new kind of tier (an object store, say) is
a new spec class: no store code changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tpusync._src.tiers.base import LowerTier
from tpusync._src.tiers.layout import PoolLayout

__all__ = ["OpenedTier", "TierContext", "TierSpec"]


@dataclass(frozen=True)
class TierContext:
    """What a spec may need from the store that opens it.

    Attributes:
      secret: the deployment secret of the store (``KVStoreConfig.secret``): MAC keys and data
        plane secrets of tiers that are not given their own derive from it.
      default_secret: whether ``secret`` is the public development default (a spec that
        authenticates with it must refuse it).
      model_id: the store's model id.
      layout: the store's block layout, once the store knows it (a spec's ``check`` may size
        what it will make from it: a disk tier's room).
    """

    secret: bytes = field(repr=False)
    default_secret: bool
    model_id: str
    layout: PoolLayout | None = None


@dataclass(frozen=True)
class OpenedTier:
    """A tier a spec opened: the tier, whether the store only reads it (hits are promoted into
    DRAM; it is never written, demoted to or evicted from), and whether the store closes it."""

    tier: LowerTier | Any
    read_only: bool = False
    owned: bool = True


@runtime_checkable
class TierSpec(Protocol):
    """A lower tier a store opens (see the module docstring). ``name`` names the tier in the
    store (its stats, its errors); each tier of a store has its own."""

    @property
    def name(self) -> str: ...

    def check(self, context: TierContext) -> None:
        """Refuses (a :class:`~tpusync.errors.TpuSyncError` naming the field and the fix) what
        would fail later, before the store opens any tier; changes nothing."""
        ...

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        """Opens the tier for blocks of ``layout``."""
        ...
