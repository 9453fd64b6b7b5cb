"""Typed configuration of a KV cache store: its namespace, its tiers and their capacities."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpusync._src.kv.config_dict import fields_from_dict, fields_to_dict
from tpusync._src.kv.keys import DEFAULT_SECRET, MAX_SECRET_BYTES, KeyScheme
from tpusync._src.kv.secret import check_secret
from tpusync._src.kv.tier_specs import DramTier, positive
from tpusync._src.tiers.spec import TierContext, TierSpec
from tpusync.errors import InvalidArgumentError

__all__ = ["KVStoreConfig"]

WRITEBACK_POLICIES = ("wait", "skip")


def _axis(value: object, argument: str) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{argument}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True)
class KVStoreConfig:
    """Everything a :class:`~tpusync.kv.KVCacheStore` needs besides its device pools.

    Args:
      model_id, weight_version, salt, shard_rank, shard_count: the namespace (see
        :class:`~tpusync.kv.Namespace`); blocks are shared only within one namespace.
      block_size: tokens per block; every device pool must hold this many on ``token_axis``
        (the store refuses pools that disagree: their blocks would be keyed wrongly).
      dram: the DRAM tier, always first.
      tiers: the lower tiers, top down, as specs the store opens itself (each a
        :class:`~tpusync._src.tiers.spec.TierSpec`): :class:`DiskTier`, :class:`SharedFsTier`,
        ``tpusync.cluster.StoreNodeTier`` (a store node's DRAM, written through),
        ``tpusync.cluster.RegistryTier`` (other nodes' blocks, read only), or your own. Each
        has its own ``name``. The store closes every tier it opened.
      secret: the deployment secret that keys every block hash (16 to 64 bytes:
        :func:`tpusync.kv.load_secret` reads it from a file). The default is a fixed
        development secret: fine for one trusted deployment, but give your own wherever tenants
        or hosts should not be able to compute each other's keys.
      key_scheme: how tokens become keys (default :class:`~tpusync.kv.Blake2bChainKeys`).
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
    weight_version: str = "0"
    salt: bytes = b""
    shard_rank: int = 0
    shard_count: int = 1
    secret: bytes = field(default=DEFAULT_SECRET, repr=False)
    key_scheme: KeyScheme | None = None
    block_axis: int = 0
    token_axis: int | None = None
    writeback_max_bytes: int = 256 << 20
    writeback_policy: str = "wait"
    path: str = "auto"
    tiers: tuple[TierSpec, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidArgumentError(
                f"model_id: expected a non-empty string, got {self.model_id!r}"
            )
        positive(self.block_size, "block_size")
        if not isinstance(self.dram, DramTier):
            raise InvalidArgumentError(
                f"dram: expected a DramTier(capacity_blocks=...), got {type(self.dram).__name__}"
            )
        self._check_tiers()
        _axis(self.block_axis, "block_axis")
        if self.token_axis is not None:
            _axis(self.token_axis, "token_axis")
            if self.token_axis == self.block_axis:
                raise InvalidArgumentError(
                    f"token_axis: {self.token_axis} is also the block_axis; give the axis that "
                    "holds a block's tokens (None: the one after block_axis)"
                )
        positive(self.writeback_max_bytes, "writeback_max_bytes")
        if self.writeback_policy not in WRITEBACK_POLICIES:
            raise InvalidArgumentError(
                f"writeback_policy: expected 'wait' or 'skip', got {self.writeback_policy!r}"
            )
        if self.path not in ("auto", "native", "jax"):
            raise InvalidArgumentError(
                f"path: expected 'auto', 'native' or 'jax', got {self.path!r}"
            )
        if self.key_scheme is not None and not isinstance(self.key_scheme, KeyScheme):
            raise InvalidArgumentError(
                "key_scheme: expected an object with name, namespace_tag(), block_keys() and "
                f"tail_key(), got {type(self.key_scheme).__name__}"
            )
        # a weak key would key every block hash and the data plane's handshake; the default
        # scheme's BLAKE2b takes keys of at most 64 bytes
        at_most = MAX_SECRET_BYTES if self.key_scheme is None else None
        check_secret(self.secret, "secret", at_most=at_most)

    def _check_tiers(self) -> None:
        if isinstance(self.tiers, list):
            object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.tiers, tuple):
            raise InvalidArgumentError(
                f"tiers: expected a tuple of tier specs, got {type(self.tiers).__name__}"
            )
        names = {"dram"}
        for i, spec in enumerate(self.tiers):
            if not isinstance(spec, TierSpec):
                hint = (
                    "; a tier you opened yourself: give its spec instead (e.g. "
                    "tpusync.cluster.StoreNodeTier)"
                    if hasattr(spec, "get") and hasattr(spec, "put")
                    else ""
                )
                raise InvalidArgumentError(
                    f"tiers[{i}]: expected a tier spec (DiskTier, SharedFsTier, ... with name, "
                    f"check() and open()), got {type(spec).__name__}{hint}"
                )
            if spec.name in names:
                raise InvalidArgumentError(
                    f"tiers[{i}]: the name {spec.name!r} is taken; give each tier its own "
                    "(the spec's name=)"
                )
            names.add(spec.name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVStoreConfig:
        """The config that plain data (e.g. parsed JSON) describes: see
        :mod:`tpusync._src.kv.config_dict` for its form (sections ``"dram"``, ``"disk"``,
        ``"shared_fs"``, ...; a secret by ``"secret_file"``). Unknown keys are errors."""
        return cls(**fields_from_dict(data, cls))

    def to_dict(
        self, *, secret_file: str | None = None, secret_files: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """This config as JSON-safe plain data (:meth:`from_dict` reads it back); fields at
        their default are left out. A non-default secret needs ``secret_file``, the file that
        holds it (checked), and a tier spec's own secret ``secret_files[tier name]``."""
        return fields_to_dict(self, secret_file=secret_file, secret_files=secret_files)

    def tier(self, name: str) -> TierSpec | None:
        """The lower tier spec named ``name`` (e.g. ``"disk"``), or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def tier_context(self) -> TierContext:
        """What the tier specs get when the store checks and opens them."""
        return TierContext(
            secret=self.secret,
            default_secret=self.secret == DEFAULT_SECRET,
            model_id=self.model_id,
        )

    @property
    def pool_token_axis(self) -> int:
        """The device pools' token axis: ``token_axis``, or the one after ``block_axis``."""
        return self.block_axis + 1 if self.token_axis is None else self.token_axis
