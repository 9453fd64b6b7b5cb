"""The worker side across vLLM's steps: a step without a forward (vLLM only polling the
connector while a request waits for its KV) waits, with the GIL released, for a background
load to finish before it answers; a step with a forward never waits; the scheduler side says
which steps run no forward."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import pytest
from engines import small_worker
from vllm.v1.core.sched.output import SchedulerOutput

from tpusync._src.connectors.vllm import worker as worker_module
from tpusync._src.connectors.vllm.metadata import TpuSyncMetadata
from tpusync._src.connectors.vllm.scheduler import SchedulerSide
from tpusync._src.connectors.vllm.settings import read_settings
from tpusync._src.connectors.vllm.worker import WorkerSide

BLOCK = 32


@pytest.fixture
def worker(tmp_path: Path):
    with small_worker(tmp_path / "s", "steps") as side:
        yield side


def _loading(worker: WorkerSide, req_id: str) -> concurrent.futures.Future:
    """A background load of ``req_id`` in flight (its future finished by the test)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    worker._loading[req_id] = (future, [], None)
    return future


def test_a_step_without_a_forward_waits_for_a_load_to_finish(worker, monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 30.0)  # only the load ends it
    future = _loading(worker, "r1")
    worker.start_load(TpuSyncMetadata(idle=True))
    threading.Timer(0.5, future.set_result, [None]).start()
    started = time.monotonic()
    assert worker.finished_loads() == {"r1"}  # not at once: after the load finished
    assert 0.4 <= time.monotonic() - started < 10  # ended by the load, not by the bound


def test_the_wait_is_bounded_and_a_step_with_a_forward_never_waits(worker, monkeypatch) -> None:
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 3.0)
    future = _loading(worker, "r2")
    worker.start_load(TpuSyncMetadata(idle=False))
    started = time.monotonic()
    assert worker.finished_loads() == set()
    assert time.monotonic() - started < 1.5
    worker.start_load(TpuSyncMetadata(idle=True))
    started = time.monotonic()
    assert worker.finished_loads() == set()  # nothing finished within the bound
    assert time.monotonic() - started >= 3.0
    started = time.monotonic()
    assert worker.finished_loads() == set()  # a second poll of the same step: no wait
    assert time.monotonic() - started < 1.5
    future.set_result(None)
    assert worker.finished_loads() == {"r2"}


def test_the_scheduler_marks_steps_without_a_forward(tmp_path: Path) -> None:
    """``idle`` in the step's metadata is what the worker waits by: set exactly when vLLM
    schedules no token this step."""
    settings = read_settings(
        {"dram": {"capacity_blocks": 16}, "socket_dir": str(tmp_path / "s")},
        model="m", block_size=BLOCK, tp_rank=0, tp_size=1, num_blocks=8, engine_id="steps-s",
    )  # fmt: skip
    side = SchedulerSide(settings, BLOCK)
    try:
        for scheduled, idle in ((0, True), (5, False)):
            output = SchedulerOutput.make_empty()
            output.total_num_scheduled_tokens = scheduled
            assert side.build_meta(output).idle is idle
    finally:
        side.close()
