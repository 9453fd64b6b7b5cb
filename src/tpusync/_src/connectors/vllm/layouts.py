"""Which of vLLM's KV-cache layouts the connector serves, decided at engine start from the
engine's ``kv_cache_config``: a layout it cannot serve correctly is refused there, by name.

Served: one KV-cache group of full attention (GQA/MHA, :class:`FullAttentionSpec`), of MLA
(:class:`MLAAttentionSpec`) or of sliding-window attention (:class:`SlidingWindowSpec`). A
sliding-window layer keeps only the blocks its window reaches: vLLM gives the blocks before it
its null block, so a hit loads only the blocks from the window on and a save never reads the
null block (:mod:`.scheduler`). Refused: several groups (hybrid models: local/global
attention, attention + mamba), every other spec (chunked local attention, mamba, attention
sinks, ...), a sliding window with ``kv_load_failure_policy="recompute"`` (vLLM 0.32
recomputes a failed load from its first failed block, whose window reaches back into blocks it
already dropped: their KV is the null block's, so the recomputed tokens would be wrong), and
MLA where vLLM turned prefix caching off (its MLA attention on a CPU without AMX cannot compute
after a prefix already in the cache: a hit's tokens came out wrong from the third one)."""

from __future__ import annotations

from typing import Any

from tpusync.errors import InvalidArgumentError

__all__ = ["SERVED_SPECS", "check_attention_layout"]

# spec class names served (exact classes: a subclass changes what a block holds)
SERVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")
SLIDING = "SlidingWindowSpec"
MLA = "MLAAttentionSpec"


def _layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group's spec (a ``UniformTypeKVCacheSpecs`` holds several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def _describe(spec: Any) -> str:
    name = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    return f"{name}(sliding_window={window})" if window else name


def check_attention_layout(
    kv_cache_config: Any, failure_policy: str, prefix_caching: bool = True
) -> str | None:
    """Refuses a KV-cache layout the connector cannot serve correctly; returns the served
    spec's class name (``None`` where the engine's config names no KV-cache group).

    Raises :class:`~tpusync.errors.InvalidArgumentError` naming the layout and what to do."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return None
    if len(groups) > 1:
        kinds = ", ".join(
            "+".join(sorted({_describe(s) for s in _layer_specs(g.kv_cache_spec)})) for g in groups
        )
        raise InvalidArgumentError(
            f"kv_cache_config: {len(groups)} KV cache groups ({kinds}): a hybrid model, which "
            "TpuSyncConnector does not serve yet; serve it without the connector, or a model "
            "whose layers all share one of " + ", ".join(SERVED_SPECS)
        )
    specs = _layer_specs(groups[0].kv_cache_spec)
    names = {type(spec).__name__ for spec in specs}
    unserved = sorted(names - set(SERVED_SPECS))
    if unserved or len(names) != 1:
        raise InvalidArgumentError(
            f"kv_cache_config: KV cache layout {', '.join(sorted(names))} is not served by "
            f"TpuSyncConnector (it serves {', '.join(SERVED_SPECS)}); serve this model without "
            "the connector"
        )
    (name,) = names
    if name == SLIDING and failure_policy == "recompute":
        windows = sorted({int(spec.sliding_window) for spec in specs})
        raise InvalidArgumentError(
            f"kv_load_failure_policy: 'recompute' with sliding-window attention (window "
            f"{', '.join(map(str, windows))}): vLLM recomputes a failed load from its first "
            "failed block, whose window reaches into blocks it already dropped, so the tokens "
            "would be wrong; use kv_load_failure_policy='fail' (the default)"
        )
    if name == MLA and not prefix_caching:
        raise InvalidArgumentError(
            "kv_cache_config: MLA attention with prefix caching off: vLLM turns it off where "
            "its MLA attention cannot compute after a cached prefix (on a CPU without AMX), so "
            "a loaded prefix would give wrong tokens; serve this model without the connector, "
            "or where vLLM runs MLA with prefix caching"
        )
    return name
