"""End-to-end exactness of the KV cache store on the real test model (ToyEngine): a warm request
served from any tier gives the same greedy tokens as the cold reference with the same chunk
boundary, and prefill logits equal bit for bit — in one process, after a restart (/dev/shm, disk),
from another process's shared filesystem, and across an agent session's pause and resume.

Cross-process tests run both sides in children (tests/helpers/kv_child.py), so the cold reference
and the warm run come from identically configured processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kv_child
import numpy as np
import pytest

from tpusync._src.testing.engine import Request, ToyEngine
from tpusync._src.testing.model import ModelConfig, init_params

CFG = ModelConfig(**kv_child.MODEL)
BS = CFG.block_size


@pytest.fixture(scope="module")
def params() -> Any:
    return init_params(CFG)


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = kv_child.unique_name("model")
    try:
        yield name
    finally:
        kv_child.remove_named_pool(name)


def _engine(params: Any, **store: Any) -> ToyEngine:
    spec = {"model_id": "toy-kv-model", "dram": {"capacity_blocks": 64}, **store}
    return ToyEngine(CFG, kv_child.store_config(spec), params=params)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, CFG.vocab_size, n).astype(np.int32)


def _assert_same(warm: Request, cold: Request) -> None:
    np.testing.assert_array_equal(warm.tokens, cold.tokens)
    assert np.array_equal(warm.prefill_logits, cold.prefill_logits), (
        "prefill logits differ from the cold reference "
        f"(max abs diff {np.abs(warm.prefill_logits - cold.prefill_logits).max()})"
    )


def _assert_same_json(warm: dict[str, Any], cold: dict[str, Any]) -> None:
    assert warm["tokens"] == cold["tokens"]
    assert warm["logits"] == cold["logits"], "prefill logits differ from the cold reference"


# --- one process, DRAM -------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "boundary"), [(64, 63), (70, 64)])
def test_dram_full_hit_is_exact(params: Any, rng: np.random.Generator, length: int, boundary: int):
    """Every full block cached: the warm run loads them all and recomputes from the last full
    block's end (or the last token, when the prompt ends on a block boundary)."""
    engine = _engine(params)
    try:
        prompt = _tokens(rng, length)
        n_blocks = length // BS
        cold = engine.generate(prompt, 8, use_cache=False, save=True, boundary=boundary)
        warm = engine.generate(prompt, 8)
        assert warm.lookup_tiers == ("dram",) * n_blocks
        assert warm.load is not None and warm.load.loaded_tokens == n_blocks * BS
        assert warm.cached_tokens == boundary
        _assert_same(warm, cold)
        stats = engine.store.stats()  # type: ignore[union-attr]
        assert stats["store"]["loaded_blocks"] == n_blocks
        assert stats["store"]["load_misses"] == 0
        # The cache is used again and again, each time exactly.
        again = engine.generate(prompt, 8, save=False)
        _assert_same(again, cold)
    finally:
        engine.close()


def test_dram_partial_hit_is_exact(params: Any, rng: np.random.Generator):
    """Prompt B shares A's first k blocks: the warm run loads k blocks, prefills the rest."""
    engine = _engine(params)
    try:
        k = 3
        a = _tokens(rng, 80)
        b = np.concatenate([a[: k * BS], _tokens(rng, 37)])
        assert b[k * BS] != a[k * BS] or not np.array_equal(b[k * BS : 80], a[k * BS : 80])
        # A is saved with its first chunk ending at k blocks, so A's KV of those blocks is the
        # KV B's cold reference computes (the model is exact for equal chunk boundaries).
        engine.generate(a, 4, use_cache=False, save=True, boundary=k * BS)
        warm = engine.generate(b, 8, save=False)
        assert warm.lookup_tiers == ("dram",) * k
        assert warm.load is not None and warm.load.loaded_tokens == k * BS
        assert warm.cached_tokens == k * BS
        cold = engine.generate(b, 8, use_cache=False, save=False, boundary=k * BS)
        _assert_same(warm, cold)
    finally:
        engine.close()


# --- after a restart: /dev/shm, disk, shared filesystem ----------------------------------------


def _restart_pair(
    tmp_path: Path,
    prompt: np.ndarray,
    store_1: dict[str, Any],
    store_2: dict[str, Any],
    *,
    exit_1: str = "close",
    n_new: int = 8,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Child 1 runs the cold reference and saves; child 2 (a new process) runs warm. Returns
    (cold, warm, child 2's stats)."""
    boundary = len(prompt) - 1  # a full hit recomputes the last token
    assert len(prompt) % BS == 0
    cold_op = {
        "prompt": prompt.tolist(),
        "n_new": n_new,
        "use_cache": False,
        "save": True,
        "boundary": boundary,
    }
    common = {"model_id": "toy-kv-model"}
    first = kv_child.run(
        {
            "model": kv_child.MODEL,
            "store": {**common, **store_1},
            "ops": [["generate", cold_op], ["stats", {}]],
            "exit": exit_1,
        },
        tmp_path,
    )
    second = kv_child.run(
        {
            "model": kv_child.MODEL,
            "store": {**common, **store_2},
            "ops": [["generate", {"prompt": prompt.tolist(), "n_new": n_new}], ["stats", {}]],
        },
        tmp_path,
    )
    cold, warm = first[0], second[0]
    assert first[1]["tiers"]["dram"]["puts"] == len(prompt) // BS
    assert warm["cached_tokens"] == boundary
    assert warm["loaded_tokens"] == len(prompt)
    return cold, warm, second[1]


@pytest.mark.parametrize("exit_1", ["close", "abrupt"])
def test_shm_hit_after_restart_is_exact(
    tmp_path: Path, rng: np.random.Generator, shm_name: str, exit_1: str
):
    """A named /dev/shm pool outlives its process (closed, or gone without closing anything):
    the next process re-attaches and is served from DRAM."""
    prompt = _tokens(rng, 64)
    dram = {"dram": {"capacity_blocks": 64, "name": shm_name}}
    cold, warm, stats = _restart_pair(tmp_path, prompt, dram, dram, exit_1=exit_1)
    assert warm["lookup_tiers"] == ["dram"] * 4
    _assert_same_json(warm, cold)
    assert stats["tiers"]["dram"]["hits"] == 4
    assert stats["tiers"]["dram"]["checksum_failures"] == 0


def test_disk_hit_after_restart_is_exact(tmp_path: Path, rng: np.random.Generator):
    """Child 1 saves through anonymous DRAM to a disk tier (close flushes the write-back); child 2
    starts with empty DRAM and is served from disk."""
    prompt = _tokens(rng, 64)
    store = {
        "dram": {"capacity_blocks": 64},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64},
    }
    cold, warm, stats = _restart_pair(tmp_path, prompt, store, store)
    assert warm["lookup_tiers"] == ["disk"] * 4
    _assert_same_json(warm, cold)
    assert stats["store"]["promotions"] == 4
    assert stats["tiers"]["disk"]["checksum_failures"] == 0


def test_shared_fs_hit_from_another_process_is_exact(tmp_path: Path, rng: np.random.Generator):
    """Child 1 publishes to a shared directory; child 2, another process with its own empty DRAM
    (another host, as far as the store knows), is served from it."""
    prompt = _tokens(rng, 64)
    store = {
        "dram": {"capacity_blocks": 64},
        "shared_fs": {"directory": str(tmp_path / "shared")},
    }
    cold, warm, stats = _restart_pair(tmp_path, prompt, store, store)
    assert warm["lookup_tiers"] == ["shared_fs"] * 4
    _assert_same_json(warm, cold)
    assert stats["store"]["promotions"] == 4
    assert stats["tiers"]["shared_fs"]["checksum_failures"] == 0


def test_prefetch_from_disk_then_warm_is_exact(
    tmp_path: Path, params: Any, rng: np.random.Generator
):
    """After a restart (empty DRAM), prefetch moves the cached prefix up from disk; the warm
    request is then served from DRAM, exactly."""
    tiers = {"disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64}}
    prompt = _tokens(rng, 64)
    engine = _engine(params, **tiers)
    cold = engine.generate(prompt, 8, use_cache=False, save=True, boundary=63)
    engine.close()
    engine = _engine(params, **tiers)
    try:
        store = engine.store
        assert store is not None
        assert store.prefetch(prompt).result(timeout=60) == 4
        warm = engine.generate(prompt, 8)
        assert warm.lookup_tiers == ("dram",) * 4
        _assert_same(warm, cold)
        stats = store.stats()["store"]
        assert stats["prefetched_blocks"] == 4 and stats["promotions"] == 4
    finally:
        engine.close()


# --- agent sessions ----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [40, 48])
def test_pause_resume_equals_uninterrupted(params: Any, rng: np.random.Generator, prompt_len: int):
    """generate(n1) + pause + resume(n2) into other device blocks == generate(n1 + n2)."""
    engine = _engine(params)
    try:
        prompt = _tokens(rng, prompt_len)
        n1, n2 = 9, 12
        full = engine.generate(prompt, n1 + n2, use_cache=False, save=False)
        first = engine.generate(prompt, n1, use_cache=False, save=False, keep_blocks=True)
        np.testing.assert_array_equal(first.tokens, full.tokens[:n1])
        engine.pause("agent-1", first)
        store = engine.store
        assert store is not None and store.sessions() == ["agent-1"]
        # Take exactly the freed blocks, so the resume lands in different ones.
        filler = engine.allocate(len(first.blocks))
        assert sorted(filler) == sorted(first.blocks)
        resumed = engine.resume("agent-1", int(first.tokens[-1]), n2)
        engine.free(filler)
        np.testing.assert_array_equal(np.concatenate([first.tokens, resumed.tokens]), full.tokens)
        assert resumed.cached_tokens == len(first.kv_tokens)  # everything restored
        assert store.sessions() == []
        # The session's full blocks stay cached as ordinary prefix blocks.
        n_full = len(first.kv_tokens) // BS
        with store.lookup(first.kv_tokens) as hit:
            assert hit.cached_tokens == n_full * BS
    finally:
        engine.close()


def test_paused_session_demoted_to_disk_resumes_exactly(
    tmp_path: Path, params: Any, rng: np.random.Generator
):
    """A paused session's blocks (its partial last block too) are pushed out of a small DRAM
    into the disk tier by other requests; the resume promotes them back, exactly."""
    tiers = {
        "dram": {"capacity_blocks": 6},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64},
    }
    engine = _engine(params, **tiers)
    try:
        store = engine.store
        assert store is not None
        prompt = _tokens(rng, 44)
        n1, n2 = 9, 12
        full = engine.generate(prompt, n1 + n2, use_cache=False, save=False)
        first = engine.generate(prompt, n1, use_cache=False, save=False, keep_blocks=True)
        engine.pause("agent-1", first)  # 52 KV tokens: 3 full blocks and a partial one
        for _ in range(3):  # 9 other blocks through 6 DRAM slots
            engine.generate(_tokens(rng, 48), 1, use_cache=False, save=True)
        assert store.flush(timeout=60)
        with store.lookup(first.kv_tokens) as hit:
            assert hit.num_blocks == 3 and "disk" in hit.tiers  # demoted, not dropped
        resumed = engine.resume("agent-1", int(first.tokens[-1]), n2)
        np.testing.assert_array_equal(np.concatenate([first.tokens, resumed.tokens]), full.tokens)
        assert resumed.cached_tokens == len(first.kv_tokens)
        assert store.stats()["store"]["promotions"] >= 1
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("where", "exit_1"), [("shm", "close"), ("shm", "abrupt"), ("disk", "close")]
)
def test_session_survives_restart(
    tmp_path: Path, rng: np.random.Generator, shm_name: str, where: str, exit_1: str
):
    """Child 1 pauses a session and exits; child 2 resumes it: from a named /dev/shm pool
    (closed, or left without closing anything), or through a disk tier under anonymous DRAM (the
    manifests then live in the disk directory)."""
    prompt = _tokens(rng, 40)
    n1, n2 = 9, 12
    store: dict[str, Any] = {"model_id": "toy-kv-model"}
    if where == "shm":
        store["dram"] = {"capacity_blocks": 64, "name": shm_name}
    else:
        store["dram"] = {"capacity_blocks": 64}
        store["disk"] = {"directory": str(tmp_path / "disk"), "capacity_blocks": 64}
    base = {"prompt": prompt.tolist(), "use_cache": False, "save": False}
    first = kv_child.run(
        {
            "model": kv_child.MODEL,
            "store": store,
            "ops": [
                ["generate", {**base, "n_new": n1 + n2}],
                ["generate", {**base, "n_new": n1, "keep_blocks": True, "as": "agent"}],
                ["pause", {"session": "agent-1", "request": "agent"}],
                ["sessions", {}],
            ],
            "exit": exit_1,
        },
        tmp_path,
    )
    full, paused, _, sessions = first
    assert paused["tokens"] == full["tokens"][:n1]
    assert sessions == ["agent-1"]
    second = kv_child.run(
        {
            "model": kv_child.MODEL,
            "store": store,
            "ops": [
                ["sessions", {}],
                ["resume", {"session": "agent-1", "next_token": paused["tokens"][-1], "n_new": n2}],
                ["sessions", {}],
                ["stats", {}],
            ],
        },
        tmp_path,
    )
    before, resumed, after, stats = second
    assert before == ["agent-1"]
    assert resumed["tokens"] == full["tokens"][n1:]
    assert resumed["cached_tokens"] == len(prompt) + n1 - 1  # every KV token restored
    assert after == []
    if where == "disk":
        assert stats["store"]["promotions"] == -(-(len(prompt) + n1 - 1) // BS)
