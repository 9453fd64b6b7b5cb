"""The worker side across vLLM's steps: a step without a forward (vLLM only polling the
connector while a request waits for its KV) waits, with the GIL released, for a background
load to finish before it answers; a step with a forward never waits."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import pytest
import torch

from tpusync.connectors.vllm import worker as worker_module
from tpusync.connectors.vllm.metadata import TpuSyncMetadata
from tpusync.connectors.vllm.settings import read_settings
from tpusync.connectors.vllm.worker import WorkerSide

BLOCK = 32


@pytest.fixture
def worker(tmp_path: Path):
    settings = read_settings(
        {"dram": {"capacity_blocks": 16}, "socket_dir": str(tmp_path / "s")},
        model="m", block_size=BLOCK, tp_rank=0, tp_size=1, num_blocks=8, engine_id="steps",
    )  # fmt: skip
    buffer = torch.randn(2, 8, 2, BLOCK, 64).to(torch.bfloat16)
    side = WorkerSide(settings, num_blocks=8)
    side.register({f"layer{i}": buffer[i] for i in range(2)})
    yield side
    side.close()


def _loading(worker: WorkerSide, req_id: str) -> concurrent.futures.Future:
    """A background load of ``req_id`` in flight (its future finished by the test)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    worker._loading[req_id] = (future, [], None)
    return future


def test_a_step_without_a_forward_waits_for_a_load_to_finish(worker, monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 30.0)  # only the load ends it
    future = _loading(worker, "r1")
    threading.Timer(0.05, future.set_result, [None]).start()
    worker.start_load(TpuSyncMetadata(idle=True))
    started = time.monotonic()
    assert worker.finished_loads() == {"r1"}
    assert time.monotonic() - started < 10  # ended by the load, not by the bound


def test_the_wait_is_bounded_and_a_step_with_a_forward_never_waits(worker, monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 0.2)
    future = _loading(worker, "r2")
    worker.start_load(TpuSyncMetadata(idle=False))
    started = time.monotonic()
    assert worker.finished_loads() == set()
    assert time.monotonic() - started < 0.15
    worker.start_load(TpuSyncMetadata(idle=True))
    started = time.monotonic()
    assert worker.finished_loads() == set()  # nothing finished within the bound
    assert time.monotonic() - started >= 0.2
    started = time.monotonic()
    assert worker.finished_loads() == set()  # a second poll of the same step: no wait
    assert time.monotonic() - started < 0.15
    future.set_result(None)
    assert worker.finished_loads() == {"r2"}
