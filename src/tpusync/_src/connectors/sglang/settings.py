"""What the SGLang backend is configured with: ``--hicache-storage-backend-extra-config`` read
against SGLang's ``HiCacheStorageConfig``, once, when SGLang creates the backend.

The extra config is the plain-data form of :class:`~tpusync.kv.KVStoreConfig`
(:mod:`tpusync._src.kv.config_dict`, the parser the vLLM connector uses) beside the keys of SGLang's
``dynamic`` factory (:data:`SGLANG_KEYS`, read by SGLang, ignored here) and the backend's own
``kv_events`` (:mod:`.events`). What SGLang decides —
the model, the page size, the ranks — comes from SGLang; given in the extra config too, it
must agree. Every error names the key and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tpusync._src.cluster.tier_specs  # noqa: F401  (registers the "store_node" and "peer" sections)
from tpusync._src.connectors.sglang.events import EventSettings, event_settings
from tpusync._src.kv.config import KVStoreConfig
from tpusync.errors import InvalidArgumentError, UnsafeFileError

__all__ = ["SGLANG_KEYS", "BackendSettings", "read_settings"]

WHERE = "hicache-storage-backend-extra-config"
# read by SGLang's factory and cache controller; every other key is the store's
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "tp_lcm_size", "allocator", "file_storage_path",
})  # fmt: skip
# the store's fields the backend sets from SGLang's pool: refused in the extra config
_FROM_THE_POOL = {
    "block_size": "SGLang's --page-size",
    "block_axis": "the host pool's layout",
    "token_axis": "the host pool's layout",
}
_FROM_THE_RANKS = {"shard_rank": "SGLang's ranks", "shard_count": "SGLang's parallel sizes"}


@dataclass(frozen=True)
class BackendSettings:
    """The store's plain config (without what the host pool decides) and the backend's place
    among SGLang's ranks.

    Attributes:
      store: the plain form of the store's :class:`~tpusync.kv.KVStoreConfig`, completed by
        :meth:`store_config` once the host pool is known.
      model: the model the keys belong to (SGLang's ``model_name``, or ``model_id``).
      shard_rank, shard_count: which part of a page this rank holds (tensor, pipeline and
        context parallel ranks; MLA pages are the same on every tensor-parallel rank).
      is_mla: whether the model's KV is MLA (one latent vector per token and layer).
      writes: whether this rank stores pages (MLA: only SGLang's writer rank does).
      events: where the backend publishes its tiers' KV events (``kv_events``), or None.
    """

    store: dict[str, Any]
    model: str
    shard_rank: int
    shard_count: int
    is_mla: bool
    writes: bool
    events: EventSettings | None = None

    def store_config(self, *, page_size: int, capacity_pages: int, layout: str) -> KVStoreConfig:
        """The store's config for a host pool of ``page_size``-token pages in ``layout`` (its
        DRAM tier holds ``capacity_pages`` unless the extra config says)."""
        data = dict(self.store)
        # the layout is in the model id: two layouts of the same shapes order a page's bytes
        # differently, so their pages must never answer for each other
        data["model_id"] = f"{self.model} (sglang {'mla' if self.is_mla else 'mha'} {layout})"
        data["block_size"] = page_size
        data["block_axis"], data["token_axis"] = 0, 1
        data["shard_rank"], data["shard_count"] = self.shard_rank, self.shard_count
        data.setdefault("dram", {"capacity_blocks": int(capacity_pages)})
        try:
            return KVStoreConfig.from_dict(data)
        except (InvalidArgumentError, UnsafeFileError) as error:  # e.g. an unsafe secret_file
            raise type(error)(f"{WHERE}: {error}") from None


SHARED_SECTIONS = ("store_node", "peer", "shared_fs")  # tiers several processes use at once


def _process_tag(config: Any) -> str:
    """Which of SGLang's processes this is (its ranks), for the names of the tiers only one
    process may open; empty for a single process."""
    parts = [
        f"{tag}{getattr(config, rank, 0) or 0}"
        for tag, rank, size in (
            ("tp", "tp_rank", "tp_size"),
            ("pp", "pp_rank", "pp_size"),
            ("cp", "attn_cp_rank", "attn_cp_size"),
        )
        if (getattr(config, size, 1) or 1) > 1
    ]
    if getattr(config, "dp_rank", 0):
        parts.append(f"dp{config.dp_rank}")
    return "-".join(parts)


def _own_tiers(data: dict[str, Any], tag: str) -> dict[str, Any]:
    """``data`` with each rank's own named DRAM tier and disk directory: every rank of one
    engine reads the same extra config, and a named DRAM pool or a disk directory has one
    owner, so each rank's gets its ranks appended (``name-tp1``, ``directory/tp1``)."""
    if not tag:
        return data
    dram = data.get("dram")
    if isinstance(dram, Mapping) and isinstance(dram.get("name"), str):
        data["dram"] = {**dram, "name": f"{dram['name']}-{tag}"}
    disks = data.get("disk")
    if isinstance(disks, Mapping | list):
        entries = [disks] if isinstance(disks, Mapping) else list(disks)
        own = [_own_directory(d, tag) for d in entries]
        data["disk"] = own[0] if isinstance(disks, Mapping) else own
    return data


def _own_directory(section: Any, tag: str) -> Any:
    """A disk section in its rank's subdirectory (made where the given directory exists)."""
    if not isinstance(section, Mapping) or not isinstance(section.get("directory"), str):
        return section  # the store's parser says what is wrong with it
    parent = section["directory"]
    create = section.get("create", False) or os.path.isdir(parent)
    return {**section, "directory": os.path.join(parent, tag), "create": create}


def _rank(config: Any, name: str, size_name: str) -> tuple[int, int]:
    rank, size = getattr(config, name, 0), getattr(config, size_name, 1)
    rank = 0 if rank is None else rank
    size = 1 if size is None else size
    if not isinstance(rank, int) or not isinstance(size, int) or not 0 <= rank < size:
        raise InvalidArgumentError(
            f"storage_config.{name}: {rank!r} is not a rank of {size_name}={size!r}"
        )
    return rank, size


def read_settings(storage_config: Any) -> BackendSettings:
    """The settings SGLang's ``HiCacheStorageConfig`` and its ``extra_config`` describe.

    Raises :class:`~tpusync.errors.InvalidArgumentError` naming the key for an unknown key, a
    wrong value, or a value SGLang decides."""
    extra = getattr(storage_config, "extra_config", None)
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(f"{WHERE}: expected a JSON object, got {type(extra).__name__}")
    if getattr(storage_config, "should_split_heads", False):
        raise InvalidArgumentError(
            "should_split_heads: tpusync's backend stores whole pages of one tensor-parallel "
            "rank; pages split by heads across ranks of another size are not supported yet "
            "(use the same --tp-size for every engine sharing the store)"
        )
    if (getattr(storage_config, "dcp_size", 1) or 1) > 1:
        raise InvalidArgumentError(
            "dcp_size: tpusync's backend does not serve decode context parallelism yet (its "
            "pages span several ranks' slots); run without --dcp-size"
        )
    data = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    events = event_settings(data.pop("kv_events", None), f"{WHERE}.kv_events")
    for key, source in {**_FROM_THE_POOL, **_FROM_THE_RANKS}.items():
        if key in data:
            raise InvalidArgumentError(f"{WHERE}.{key}: set by {source}; leave it out")
    model = getattr(storage_config, "model_name", None) or ""
    if "model_id" in data:
        given = data.pop("model_id")
        if model and given != model:
            raise InvalidArgumentError(
                f"{WHERE}.model_id: {given!r} contradicts SGLang's model_name ({model!r}); "
                "leave model_id out (the backend takes SGLang's) or serve that model"
            )
        model = given
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError(
            f"{WHERE}.model_id: SGLang gave no model_name; set model_id to the served model"
        )
    is_mla = bool(getattr(storage_config, "is_mla_model", False))
    tp_rank, tp_size = _rank(storage_config, "tp_rank", "tp_size")
    pp_rank, pp_size = _rank(storage_config, "pp_rank", "pp_size")
    cp_rank, cp_size = _rank(storage_config, "attn_cp_rank", "attn_cp_size")
    dcp_rank, dcp_size = _rank(storage_config, "dcp_rank", "dcp_size")
    # a page's part on this rank: pipeline stage, context-parallel rank, then the ranks that
    # split heads (MHA: tensor parallel) or tokens (MLA: decode context parallel)
    inner_rank, inner_size = (dcp_rank, dcp_size) if is_mla else (tp_rank, tp_size)
    shard_rank = (pp_rank * cp_size + cp_rank) * inner_size + inner_rank
    shard_count = pp_size * cp_size * inner_size
    # MLA pages are the same on every tensor-parallel rank: with a tier the ranks share, one
    # rank stores them (SGLang's writer); with only tiers of its own, each rank stores its copy
    shared = any(key in data for key in SHARED_SECTIONS)
    writes = not is_mla or tp_rank == dcp_rank or not shared
    store = _own_tiers(dict(data), _process_tag(storage_config))
    settings = BackendSettings(store, model, shard_rank, shard_count, is_mla, writes, events)
    # every key checked now, at engine start, with placeholders for the host pool's values
    settings.store_config(page_size=1, capacity_pages=1, layout="check")
    return settings
