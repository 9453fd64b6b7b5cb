"""Reliability of the KV cache store on the real test model's KV: concurrent save / load / release
under eviction, corrupt blocks in every tier, a writer SIGKILLed mid-save, and device pools of
another layout on a named pool. The invariant throughout: a block the store serves holds exactly
the KV of its tokens; anything else is a miss, and the engine recomputes it to the same result.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import kv_child
import numpy as np
import pytest

import tpusync
from tpusync import DevicePool
from tpusync._src.testing.engine import Request, ToyEngine
from tpusync._src.testing.model import ModelConfig, init_kv_pools, init_params
from tpusync._src.testing.polling import eventually
from tpusync.errors import PoolBusyError, SessionNotFoundError, StaleHandleError, TierFullError
from tpusync.kv import KVCacheStore

CFG = ModelConfig(**kv_child.MODEL)
BS = CFG.block_size
N_POOLS = 2 * CFG.n_layers
BLOCK_SHAPE = CFG.kv_pool_shape[1:]


@pytest.fixture(scope="module")
def params() -> Any:
    return init_params(CFG)


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = kv_child.unique_name("rel")
    try:
        yield name
    finally:
        kv_child.remove_named_pool(name)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, CFG.vocab_size, n).astype(np.int32)


def _pools() -> list[DevicePool]:
    """Device pools of the model's layout, as ToyEngine makes them."""
    return [DevicePool(a, name=f"kv{i}") for i, a in enumerate(init_kv_pools(CFG))]


def _keys(store: KVCacheStore, tokens: np.ndarray) -> list[bytes]:
    return store.scheme.block_keys(store.namespace, np.asarray(tokens, np.uint32), BS)


def _read_blocks(pools: list[DevicePool], ids: list[int]) -> np.ndarray:
    """Device blocks ``ids`` of every pool, (pools, len(ids), *block), read under the pools'
    locks (a raw write elsewhere may replace a pool's array at any time)."""
    out = np.empty((N_POOLS, len(ids), *BLOCK_SHAPE), np.float32)
    for pool, part in zip(pools, out, strict=True):
        tpusync.transfer(pool, part, src_blocks=ids).result()
    return out


def _write_blocks(pools: list[DevicePool], ids: list[int], kv: np.ndarray) -> None:
    for pool, part in zip(pools, kv, strict=True):
        tpusync.transfer(np.ascontiguousarray(part), pool, dst_blocks=ids).result()


def _wait_saves(store: KVCacheStore, n: int) -> None:
    """Waits until ``n`` saves have finished (ToyEngine.generate returns once its save released
    the device blocks; the save's write-back is queued just after), then for the write-back."""
    eventually(
        lambda: store.stats()["store"]["saves"] >= n, 60, f"{n} saves finished", interval=0.005
    )
    assert store.flush(timeout=60)


def _assert_same(warm: Request, cold: Request) -> None:
    np.testing.assert_array_equal(warm.tokens, cold.tokens)
    assert np.array_equal(warm.prefill_logits, cold.prefill_logits), (
        "prefill logits differ from the cold reference"
    )


# --- the prompts and their reference KV ----------------------------------------------------


class Refs:
    """Prompts sharing prefixes, and the model's KV of each one's full blocks. A block shared by
    several prompts (the same token prefix) gets one reference: the first prompt's."""

    def __init__(self, prompts: list[np.ndarray], kv: list[np.ndarray]) -> None:
        self.prompts = prompts
        self.kv = kv  # kv[i]: (pools, full blocks of prompt i, *block)

    def by_key(self, store: KVCacheStore) -> dict[bytes, np.ndarray]:
        out: dict[bytes, np.ndarray] = {}
        for prompt, kv in zip(self.prompts, self.kv, strict=True):
            for j, key in enumerate(_keys(store, prompt)):
                out.setdefault(key, kv[:, j])
        return out

    @property
    def unique_blocks(self) -> int:
        return len({p[: (j + 1) * BS].tobytes() for p in self.prompts for j in range(len(p) // BS)})


@pytest.fixture(scope="module")
def refs(params: Any) -> Refs:
    rng = np.random.default_rng(20260101)
    base, w, q, r, s = (_tokens(rng, n) for n in (80, 80, 80, 64, 80))
    p2 = np.concatenate([base[:32], _tokens(rng, 48)])
    prompts = [
        base[:48],
        base,
        p2,
        np.concatenate([base[:48], _tokens(rng, 32)]),
        np.concatenate([base[:16], _tokens(rng, 48)]),
        w,
        np.concatenate([w[:48], _tokens(rng, 24)]),  # 4 full blocks and a partial one
        np.concatenate([p2[:64], _tokens(rng, 16)]),
        q,
        r,
        s,
    ]
    engine = ToyEngine(CFG, None, params=params)
    seen: dict[bytes, np.ndarray] = {}
    kvs = []
    for prompt in prompts:
        request = engine.generate(prompt, 1, use_cache=False, save=False, keep_blocks=True)
        n_full = len(prompt) // BS
        ids = list(request.blocks[:n_full])
        kv = np.stack([np.asarray(pool.array)[ids] for pool in engine.kv])
        engine.free(list(request.blocks))
        for j in range(n_full):  # one reference per token prefix
            kv[:, j] = seen.setdefault(prompt[: (j + 1) * BS].tobytes(), kv[:, j].copy())
        kvs.append(kv)
    return Refs(prompts, kvs)


def _check_dram_slots(store: KVCacheStore, expected: dict[bytes, np.ndarray]) -> int:
    """Every block DRAM holds, read raw from its slot, equals its key's reference (the views
    die on return, so the store can close)."""
    views = store.dram.views()
    keys = store.dram.keys()
    for key in keys:
        assert key in expected, f"DRAM holds a key no prompt has: {key.hex()}"
        slot = store.dram.slot_of(key)
        if slot is None:  # dropped meanwhile
            continue
        for a, view in enumerate(views):
            np.testing.assert_array_equal(
                view[slot].view(np.uint32), expected[key][a].view(np.uint32), err_msg=key.hex()
            )
    return len(keys)


def _load_and_check(
    store: KVCacheStore,
    pools: list[DevicePool],
    ids: list[int],
    prompt: np.ndarray,
    expected: dict[bytes, np.ndarray],
    canary: np.ndarray,
) -> tuple[int, int, tuple[str, ...]]:
    """Looks ``prompt`` up, scribbles over the target blocks, loads, and checks every loaded
    block against its reference. Returns (hit blocks, loaded blocks, the hit's tiers)."""
    keys = _keys(store, prompt)
    hit = store.lookup(prompt)
    assert hit.keys == tuple(keys[: hit.num_blocks])
    assert hit.cached_tokens == hit.num_blocks * BS
    if not hit.num_blocks:
        store.release(hit)
        return 0, 0, ()
    n = hit.num_blocks
    _write_blocks(pools, ids[:n], canary[:, :n])  # a block the load does not write stays wrong
    result = store.load(hit, ids[:n])
    assert not hit.open
    assert result.requested_blocks == n
    assert 0 <= result.loaded_blocks <= n
    assert result.loaded_tokens == result.loaded_blocks * BS
    m = result.loaded_blocks
    if m:
        got = _read_blocks(pools, ids[:m])
        want = np.stack([expected[k] for k in keys[:m]], axis=1)
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad = [j for j in range(m) if not np.array_equal(got[:, j], want[:, j])]
            raise AssertionError(
                f"load served wrong KV in blocks {bad} of {m} (tiers {hit.tiers}, prompt of "
                f"{len(prompt)} tokens)"
            )
    return n, m, hit.tiers


# --- concurrency ---------------------------------------------------------------------------

THREADS = 4
BLOCKS_PER_THREAD = 8
RUN_SECONDS = 4.0


@pytest.mark.parametrize("tiers", ["dram", "dram+disk"])
def test_concurrent_save_load_release_serves_only_right_blocks(
    tmp_path: Path, refs: Refs, rng: np.random.Generator, tiers: str
):
    spec: dict[str, Any] = {"model_id": "toy-kv-concurrency", "dram": {"capacity_blocks": 24}}
    if tiers == "dram+disk":
        spec["disk"] = {"directory": str(tmp_path / "disk"), "capacity_blocks": 32}
    assert refs.unique_blocks > 24 + 8  # more than DRAM holds: eviction must happen
    assert max(len(p) // BS for p in refs.prompts) <= 5  # 4 threads x 5 pins fit in 24 slots
    pools = _pools()
    store = KVCacheStore(kv_child.store_config(spec), pools)
    expected = refs.by_key(store)
    prompt_keys = [_keys(store, p) for p in refs.prompts]
    errors: list[str] = []
    counts: dict[str, int] = dict.fromkeys(
        [
            "saves",
            "loads",
            "full_loads",
            "short_loads",
            "releases",
            "prefetches",
            "purges",
            "lower_hits",
        ],
        0,
    )
    counts_lock = threading.Lock()
    stop = threading.Event()
    seeds = rng.integers(0, 2**32, THREADS)

    def worker(t: int) -> None:
        own = np.random.default_rng(int(seeds[t]))
        ids = list(range(t * BLOCKS_PER_THREAD, (t + 1) * BLOCKS_PER_THREAD))
        mine = dict.fromkeys(counts, 0)
        deadline = time.monotonic() + RUN_SECONDS
        try:
            while time.monotonic() < deadline and not stop.is_set():
                i = int(own.integers(len(refs.prompts)))
                prompt, keys = refs.prompts[i], prompt_keys[i]
                op = own.random()
                if op < 0.4:
                    n = len(keys)
                    kv = np.stack([expected[k] for k in keys], axis=1)
                    _write_blocks(pools, ids[:n], kv)
                    saved = store.save(prompt, ids[:n])
                    assert saved.stored_blocks + saved.skipped_blocks <= n
                    mine["saves"] += 1
                elif op < 0.85:
                    canary = own.standard_normal((N_POOLS, 5, *BLOCK_SHAPE)).astype(np.float32)
                    n, m, where = _load_and_check(store, pools, ids, prompt, expected, canary)
                    if n:
                        mine["loads"] += 1
                        mine["full_loads" if m == n else "short_loads"] += 1
                        mine["lower_hits"] += sum(w != "dram" for w in where)
                elif op < 0.95:
                    hit = store.lookup(prompt)
                    store.release(hit)
                    with pytest.raises(StaleHandleError):
                        store.release(hit)
                    mine["releases"] += 1
                elif op < 0.995:
                    assert 0 <= store.prefetch(prompt).result(timeout=60) <= len(keys)
                    mine["prefetches"] += 1
                else:
                    store.purge()  # pinned blocks go at their last unpin
                    mine["purges"] += 1
        except BaseException:
            errors.append(f"thread {t}:\n{traceback.format_exc()}")
            stop.set()
        finally:
            with counts_lock:
                for name, value in mine.items():
                    counts[name] += value

    threads = [
        threading.Thread(target=worker, args=(t,), name=f"kv-worker-{t}") for t in range(THREADS)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=RUN_SECONDS + 60)
        alive = [thread.name for thread in threads if thread.is_alive()]
        stop.set()
        assert not alive, f"threads still running (deadlock?): {alive}"
        assert not errors, "\n".join(errors)
        assert store.flush(timeout=60)
        stats = store.stats()
        print(counts, stats)
        # Everything DRAM holds is right, byte for byte, and every prompt loads right now.
        _check_dram_slots(store, expected)
        canary = np.full((N_POOLS, 5, *BLOCK_SHAPE), np.float32(-7.0))
        for prompt in refs.prompts:
            _load_and_check(store, pools, list(range(5)), prompt, expected, canary)
        assert counts["saves"] > 0 and counts["loads"] > 0 and counts["releases"] > 0
        assert stats["store"]["evictions"] > 0, "the test never made the store evict"
        assert stats["store"]["open_handles"] == 0
        if tiers == "dram+disk":
            assert counts["lower_hits"] > 0, "no load was ever served from disk"
            assert stats["store"]["promotions"] > 0
        # Pinned blocks are never evicted: with nothing corrupt, every load is whole.
        assert counts["short_loads"] == 0, counts
        assert stats["store"]["load_misses"] == 0
        for pool in pools:
            assert pool.held_blocks() == []
    finally:
        stop.set()
        store.close()


# --- corruption ----------------------------------------------------------------------------


def _flip_byte(path: str | Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        assert os.pwrite(fd, bytes([old ^ 0xFF]), offset) == 1
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("tier", ["dram", "disk", "shared_fs"])
def test_corrupt_block_loads_good_prefix_and_recomputes_exactly(
    tmp_path: Path, params: Any, rng: np.random.Generator, tier: str
):
    """Block 2 of 5 is corrupted where it rests: the warm request loads blocks 0-1 only,
    recomputes the rest, and equals the cold reference split at block 2."""
    bad = 2
    boundary = bad * BS
    prompt = _tokens(rng, 80)
    spec: dict[str, Any] = {"model_id": "toy-kv-corrupt", "dram": {"capacity_blocks": 64}}
    if tier == "disk":
        spec["disk"] = {"directory": str(tmp_path / "disk"), "capacity_blocks": 64}
    if tier == "shared_fs":
        spec["shared_fs"] = {"directory": str(tmp_path / "shared")}
    config = kv_child.store_config(spec)
    engine = ToyEngine(CFG, config, params=params)
    try:
        # The reference doubles as the saver: its first chunk ends where the hit will end.
        cold = engine.generate(prompt, 6, use_cache=False, save=True, boundary=boundary)
        store = engine.store
        assert store is not None
        key = _keys(store, prompt)[bad]
        if tier == "dram":
            slot = store.dram.slot_of(key)
            assert slot is not None
            with store.dram.slot_memory(slot) as memory:
                memory[100] ^= 0xFF
        else:
            _wait_saves(store, 1)
            lower = store._stack.tiers[store._stack.names.index(tier)]
            if tier == "disk":
                slab, within = divmod(lower._index[key], lower.slab_slots)
                path: str | Path = lower._slab_path(slab)
                offset = 4096 + within * store.layout.slot_bytes + 100
            else:
                path, offset = lower.path_of(key), 4096 + 100
            engine.close()  # a restart: the next engine's DRAM is empty
            _flip_byte(path, offset)
            engine = ToyEngine(CFG, config, params=params)
            store = engine.store
            assert store is not None
        failures = store.stats()["tiers"][tier]["checksum_failures"]
        warm = engine.generate(prompt, 6, save=False)
        assert warm.lookup_tiers == (tier,) * 5  # a lookup does not read blocks
        assert warm.load is not None
        assert warm.load.loaded_blocks == bad and warm.load.loaded_tokens == boundary
        assert warm.cached_tokens == boundary
        _assert_same(warm, cold)
        stats = store.stats()
        assert stats["tiers"][tier]["checksum_failures"] == failures + 1
        # The corrupt block is gone; the good prefix is still served, still exactly.
        again = engine.generate(prompt, 6, save=False)
        assert again.lookup_tiers == ("dram",) * bad
        assert again.cached_tokens == boundary
        _assert_same(again, cold)
    finally:
        engine.close()


# --- a writer SIGKILLed mid-save -----------------------------------------------------------

KILLS = 2


def test_sigkill_while_saving_never_serves_a_torn_block(
    tmp_path: Path, refs: Refs, rng: np.random.Generator, shm_name: str
):
    """A child saves real KV through a small named /dev/shm pool into a small disk tier (so it
    evicts, demotes, writes back and purges all the time) and is SIGKILLed at a random moment;
    this process then re-attaches both, and every block it serves is the reference KV."""
    spec_store = {
        "model_id": "toy-kv-crash",
        "dram": {"capacity_blocks": 12, "name": shm_name},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 24},
    }
    arrays: dict[str, np.ndarray] = {}
    for i, (prompt, kv) in enumerate(zip(refs.prompts, refs.kv, strict=True)):
        arrays[f"p{i}"], arrays[f"kv{i}"] = prompt, kv
    np.savez(tmp_path / "refs.npz", **arrays)  # type: ignore[arg-type]
    served = held = 0
    for kill in range(KILLS):
        child = kv_child.start(
            {
                "model": kv_child.MODEL,
                "store": spec_store,
                "ops": [
                    [
                        "save_loop",
                        {"refs": str(tmp_path / "refs.npz"), "seed": int(rng.integers(2**31))},
                    ]
                ],
            },
            tmp_path,
        )
        try:
            try:
                child.wait(timeout=float(rng.uniform(0.3, 1.5)))
                pytest.fail(f"the saving child exited by itself ({child.returncode})")
            except subprocess.TimeoutExpired:
                pass
        finally:
            kv_child.stop(child)
        assert child.returncode == -signal.SIGKILL, f"kill {kill}: exit {child.returncode}"
        pools = _pools()
        with KVCacheStore(kv_child.store_config(spec_store), pools) as store:
            assert store.dram.attached
            expected = refs.by_key(store)
            disk = store._stack.tiers[1]
            disk_keys = disk.keys()
            for key in disk_keys:
                assert key in expected, f"the disk tier holds a key no prompt has: {key.hex()}"
            held += _check_dram_slots(store, expected) + len(disk_keys)
            canary = np.full((N_POOLS, 5, *BLOCK_SHAPE), np.float32(np.nan))
            for prompt in refs.prompts:
                _, loaded, _ = _load_and_check(
                    store, pools, list(range(5)), prompt, expected, canary
                )
                served += loaded
    print(f"{KILLS} kills: {held} blocks held, {served} served and verified")
    assert served > 0, "the survivor never had a block to serve"


# --- another layout on the same named pool -------------------------------------------------


def _other_layout(kind: str) -> list[DevicePool]:
    """Pools with the model's block bytes but another shape or dtype."""
    n = CFG.num_blocks
    if kind == "shape":
        arrays = [jnp.zeros((n, BS, 4, 8), jnp.float32) for _ in range(N_POOLS)]
    else:
        arrays = [jnp.zeros((n, BS, 2, 32), jnp.bfloat16) for _ in range(N_POOLS)]
    return [DevicePool(a, name=f"kv{i}") for i, a in enumerate(arrays)]


@pytest.mark.parametrize("kind", ["shape", "dtype"])
def test_other_layout_on_same_pool_is_cold_never_a_wrong_hit(
    tmp_path: Path, params: Any, rng: np.random.Generator, shm_name: str, kind: str
):
    spec = {
        "model_id": "toy-kv-layout",
        # another layout on the pool is refused by default; this test opts in to a cold start
        "dram": {"capacity_blocks": 32, "name": shm_name, "on_mismatch": "recreate"},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 32},
    }
    config = kv_child.store_config(spec)
    prompt = _tokens(rng, 64)
    engine = ToyEngine(CFG, config, params=params)
    try:
        cold = engine.generate(prompt, 4, use_cache=False, save=True, boundary=63)
        paused = engine.generate(_tokens(rng, 40), 3, use_cache=False, save=False, keep_blocks=True)
        engine.pause("agent", paused)
        assert engine.store is not None and engine.store.flush(timeout=60)
        # While the owner lives, a second store on the same name is refused clearly.
        with pytest.raises(PoolBusyError):
            KVCacheStore(config, _other_layout(kind))
    finally:
        engine.close()

    other = _other_layout(kind)
    with KVCacheStore(config, other) as store:
        assert store.layout.payload_bytes == 4 * BS * 2 * 16 * N_POOLS  # same bytes per block
        assert not store.dram.attached and store.dram.used == 0  # recreated: a cold start
        assert store._stack.tiers[1].used == 0
        with store.lookup(prompt) as hit:
            assert hit.cached_tokens == 0
        # The old pool's session cannot bring back KV of the old layout either.
        for session in store.sessions():
            restored = store.restore_session(session, list(range(8)))
            assert restored.loaded_tokens == 0
        # Save something in the other layout under the same tokens.
        store.save(prompt, list(range(4)))

    # Back to the model's layout: a cold start again; the other layout's blocks never load.
    engine = ToyEngine(CFG, config, params=params)
    try:
        assert engine.store is not None and not engine.store.dram.attached
        warm = engine.generate(prompt, 4, save=False)
        assert warm.cached_tokens == 0 and warm.lookup_tiers == ()
        _assert_same(warm, engine.generate(prompt, 4, use_cache=False, save=False))
        np.testing.assert_array_equal(warm.tokens, cold.tokens)
    finally:
        engine.close()


def test_another_model_on_the_same_pool_is_not_offered_its_sessions(
    params: Any, rng: np.random.Generator, shm_name: str
):
    """A named pool reused by another model (another model_id) starts cold; the old model's
    paused sessions are not that model's to resume (their tokens are another tokenizer's)."""
    dram = {"capacity_blocks": 32, "name": shm_name, "on_mismatch": "recreate"}  # opted in
    spec = {"model_id": "toy-kv-model-a", "dram": dram}
    engine = ToyEngine(CFG, kv_child.store_config(spec), params=params)
    try:
        paused = engine.generate(_tokens(rng, 40), 3, use_cache=False, save=False, keep_blocks=True)
        engine.pause("agent", paused)
    finally:
        engine.close()
    other = kv_child.store_config({**spec, "model_id": "toy-kv-model-b"})
    with KVCacheStore(other, _pools()) as store:
        assert not store.dram.attached  # the layout names the model: a cold pool
        assert store.sessions() == [], "model B is offered model A's paused session"


# --- error paths and counters --------------------------------------------------------------


def test_engine_load_failure_leaks_no_handle_and_no_blocks(
    tmp_path: Path, params: Any, rng: np.random.Generator
):
    """After a restart a cached prefix larger than DRAM is found on disk: the hit is all of it
    (it loads through DRAM chunk by chunk); a hit DRAM cannot stage because other handles pin
    it may fail to promote (TierFullError). Whatever generate does then, it must not leave the
    lookup handle open (its pins would keep those blocks from ever being evicted) nor lose
    device blocks."""
    spec = {
        "model_id": "toy-kv-errors",
        "dram": {"capacity_blocks": 4},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 32},
    }
    config = kv_child.store_config(spec)
    prompt = _tokens(rng, 96)  # 6 blocks, saved 3 at a time through 4 DRAM slots
    engine = ToyEngine(CFG, config, params=params)
    engine.generate(prompt[:48], 1, use_cache=False, save=True)
    engine.generate(prompt, 1, use_cache=False, save=True)
    engine.close()  # flushes everything to disk
    engine = ToyEngine(CFG, config, params=params)
    try:
        store = engine.store
        assert store is not None
        with store.lookup(prompt) as hit:  # 6 blocks cached, more than DRAM's 4 slots
            assert hit.tiers == ("disk",) * 6
        request = engine.generate(prompt, 2, save=False)
        assert request.cached_tokens == len(prompt) - 1  # a full hit: the last one is redone
        # A hit DRAM may fail to stage now (another handle pins 2 of its 4 slots): served cold.
        with store.lookup(prompt[:32]) as pinning:
            assert pinning.num_blocks == 2
            with contextlib.suppress(TierFullError):  # raising is acceptable; leaking is not
                engine.generate(prompt, 2, save=False)
        assert store.stats()["store"]["open_handles"] == 0, "generate left its handle open"
        engine.free(engine.allocate(CFG.num_blocks))  # every device block is free again
    finally:
        engine.close()


def test_engine_resume_of_unknown_session_leaks_no_blocks(params: Any):
    config = kv_child.store_config({"model_id": "toy-kv-errors", "dram": {"capacity_blocks": 8}})
    engine = ToyEngine(CFG, config, params=params)
    try:
        with pytest.raises(SessionNotFoundError):
            engine.resume("never-paused", 1, 4)
        engine.free(engine.allocate(CFG.num_blocks))  # every device block is free again
    finally:
        engine.close()


@pytest.mark.parametrize("lower", [False, True])
def test_dram_tier_counts_its_evictions(
    tmp_path: Path, params: Any, rng: np.random.Generator, lower: bool
):
    """DRAM of 4 blocks holds prompt A's 3; saving B's 3 evicts 2 of A's. The DRAM tier's
    ``evictions`` counter says so, with or without a disk tier below (that already holds A)."""
    spec: dict[str, Any] = {"model_id": "toy-kv-counters", "dram": {"capacity_blocks": 4}}
    if lower:
        spec["disk"] = {"directory": str(tmp_path / "disk"), "capacity_blocks": 32}
    engine = ToyEngine(CFG, kv_child.store_config(spec), params=params)
    try:
        store = engine.store
        assert store is not None
        engine.generate(_tokens(rng, 48), 1, use_cache=False, save=True)
        _wait_saves(store, 1)  # A reaches the disk tier before B's save evicts it
        engine.generate(_tokens(rng, 48), 1, use_cache=False, save=True)
        _wait_saves(store, 2)
        stats = store.stats()
        lower_evictions = stats["tiers"]["disk"]["evictions"] if lower else 0
        assert stats["store"]["evictions"] - lower_evictions == 2  # dropped from DRAM
        assert stats["tiers"]["dram"]["used"] == 4
        assert stats["tiers"]["dram"]["evictions"] == 2, stats["tiers"]["dram"]
    finally:
        engine.close()


def test_flush_waits_for_saves_in_flight(
    tmp_path: Path, params: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
):
    """flush() "waits until saved blocks are written to every lower tier". A save whose device
    blocks were released (all ToyEngine.generate waits for) but whose write-back is not queued
    yet is missed. The window is widened here by delaying the queueing by 0.3 s, as a busy
    machine's scheduler may."""
    spec = {
        "model_id": "toy-kv-flush",
        "dram": {"capacity_blocks": 16},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 16},
    }
    engine = ToyEngine(CFG, kv_child.store_config(spec), params=params)
    try:
        store = engine.store
        assert store is not None
        enqueue = store._stack.writeback.enqueue

        def late_enqueue(keys: list[bytes], admitted: int) -> None:
            time.sleep(0.3)
            enqueue(keys, admitted)

        monkeypatch.setattr(store._stack.writeback, "enqueue", late_enqueue)
        prompt = _tokens(rng, 48)
        engine.generate(prompt, 1, use_cache=False, save=True)
        assert store.flush(timeout=60)
        disk = store._stack.tiers[1]
        assert all(disk.contains(_keys(store, prompt))), "flush returned before the write-back"
    finally:
        engine.close()
