"""Tensor parallelism with TpuSyncConnector: each rank keeps its own shard of every block in a
store of its own, under keys that name its rank, and answers lookups on a socket of its own;
the scheduler asks every rank, and a block counts only as far as every rank holds it. Tested
with real worker sides and a real vLLM request, and with a real ``tensor_parallel_size=2``
engine on this CPU (vLLM's multi-process executor, one core per rank)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engines import (
    BLOCK,
    build_model,
    engine,
    generate,
    matched_when_answered,
    transfer_config,
    vllm_request,
)

from tpusync._src.connectors.vllm.lookup_service import LookupServer
from tpusync._src.connectors.vllm.scheduler import SchedulerSide
from tpusync._src.connectors.vllm.settings import read_settings
from tpusync._src.connectors.vllm.worker import WorkerSide
from tpusync.errors import InvalidArgumentError

PROMPT = np.random.default_rng(20261205).integers(1, 1000, 200).tolist()  # 6 full blocks
FULL = (len(PROMPT) - 1) // BLOCK * BLOCK


def _settings(tmp_path: Path, rank: int, extra: dict[str, Any] | None = None) -> Any:
    extra = {"socket_dir": str(tmp_path), **(extra or {})}
    return read_settings(
        extra, model="m", block_size=BLOCK, tp_rank=rank, tp_size=2, num_blocks=16,
        engine_id="tp-engine",
    )  # fmt: skip


def test_each_rank_has_its_own_socket_keys_and_node(tmp_path: Path) -> None:
    serve = {"serve": {"registry": "127.0.0.1:1"}}
    ranks = [_settings(tmp_path, rank, serve) for rank in (0, 1)]
    assert ranks[0].socket_paths == ranks[1].socket_paths
    assert [s.socket_path for s in ranks] == list(ranks[0].socket_paths)
    assert len(set(ranks[0].socket_paths)) == 2
    assert [(s.store.shard_rank, s.store.shard_count) for s in ranks] == [(0, 2), (1, 2)]
    assert [s.serve.node_id for s in ranks] == ["vllm-tp-engine-tp0", "vllm-tp-engine-tp1"]
    with pytest.raises(InvalidArgumentError, match=r"serve\.port: 7411 would be taken by every"):
        _settings(tmp_path, 0, {"serve": {"registry": "127.0.0.1:1", "port": 7411}})
    with pytest.raises(InvalidArgumentError, match=r"dram\.name: a named DRAM pool is one process"):
        _settings(tmp_path, 1, {"dram": {"capacity_blocks": 8, "name": "kv"}})
    with pytest.raises(InvalidArgumentError, match=r"disk: .* use shared_fs"):
        _settings(tmp_path, 0, {"disk": {"directory": str(tmp_path / "d"), "capacity_blocks": 8}})


def test_a_hit_counts_only_as_far_as_every_rank_holds_the_block(tmp_path: Path) -> None:
    request = vllm_request(PROMPT)
    hashes = list(request.block_hashes)
    assert len(hashes) == 6
    workers = []
    try:
        for rank, held in ((0, 5), (1, 3)):  # rank 1 holds fewer blocks than rank 0
            worker = WorkerSide(_settings(tmp_path, rank), num_blocks=16)
            kv = torch.randn(2, 16, 2, BLOCK, 64).to(torch.bfloat16)  # this rank's heads
            worker.register({f"layer{i}": kv[i] for i in range(2)})
            assert worker.store is not None
            worker.store.save_engine_blocks_async(hashes[:held], list(range(held))).result()
            workers.append(worker)
        scheduler = SchedulerSide(workers[0].settings, BLOCK)
        try:
            assert matched_when_answered(scheduler, request) == 3 * BLOCK
            workers[1].close()  # a rank that does not answer: a miss, never a partial hit
            scheduler.finished(request)
            assert matched_when_answered(scheduler, vllm_request(PROMPT)) == 0
        finally:
            scheduler.close()
    finally:
        for worker in workers:
            worker.close()


def test_the_scheduler_asks_every_rank_at_once(tmp_path: Path) -> None:
    """Each rank's lookup socket answers after 0.3 s: asked one after another the two would
    never answer together, and the lookup would take their sum."""
    lock = threading.Lock()
    inside, most = [0], [0]

    def slow(blocks: int) -> Any:
        def answer(req_id: str, sequence: int, hashes: list[bytes]) -> tuple[int, bool]:
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.3)
            with lock:
                inside[0] -= 1
            return blocks, False

        return answer

    settings = _settings(tmp_path, 0)
    servers = [
        LookupServer(path, slow(blocks))
        for path, blocks in zip(settings.socket_paths, (5, 3), strict=True)
    ]
    scheduler = SchedulerSide(settings, BLOCK)
    try:
        # the smallest answer
        assert matched_when_answered(scheduler, vllm_request(PROMPT)) == 3 * BLOCK
        assert most[0] == 2  # both ranks answered at once
    finally:
        scheduler.close()
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "tp", seed=0)


def test_a_tensor_parallel_engine_loads_each_ranks_shard_and_its_output_equals(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node)
    shared = tmp_path / "shared"
    shared.mkdir()
    kv = transfer_config({"socket_dir": str(tmp_path), "shared_fs": {"directory": str(shared)}})
    # float32: vLLM's own TP=2 and TP=1 agree only there (bf16 all-reduces round otherwise)
    with engine(model, None, dtype="float32") as llm:
        ((alone, _),) = generate(llm, [PROMPT])  # TP=1, no connector
    options = dict(tensor_parallel_size=2, distributed_executor_backend="mp", dtype="float32")
    with engine(model, kv, **options) as llm:
        ((cold, cached),) = generate(llm, [PROMPT])
        assert cached == 0
        llm.reset_prefix_cache()  # out of vLLM's own cache: only the store holds the blocks
        ((warm, cached),) = generate(llm, [PROMPT])
    assert cached == FULL  # every full block, each rank's shard from its own store
    assert warm == cold == alone
    assert len(list(shared.rglob("*.blk"))) >= 2 * FULL // BLOCK  # both ranks' keys
