"""Disaggregated prefill -> decode across addresses: the producer (vLLM's multi-process engine)
runs in a network namespace of its own, joined to this one by a veth pair; it serves its DRAM
on its own address and lists its blocks in a registry (a store node's) on this namespace's
address; the consumer here finds them there and pulls them from the producer. Off loopback
every connection is TLS (one certificate for both addresses) as well as authenticated."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from engines import (
    BLOCK,
    build_model,
    choose_prompt,
    engine,
    generate_with,
    settle,
    transfer_config,
    worker_of,
)
from fronts import finish_front, kv_common, produce_serving, serve_once_front
from netns import Namespace, network_namespace
from tools import require_tool

from tpusync._src.testing.processes import start_store_node, stop_process

PROMPT_TOKENS = 300
FULL = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def space() -> Iterator[Namespace]:
    with network_namespace() as made:
        yield made


@pytest.fixture(scope="module")
def remote_front(
    tmp_path_factory: pytest.TempPathFactory, space: Namespace
) -> Iterator[subprocess.Popen]:
    """The producer's front in the namespace, started with the module (it imports vLLM)."""
    with serve_once_front(tmp_path_factory, space.name) as child:
        yield child


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "main", seed=0)


def _certificate(folder: Path, *addresses: str) -> tuple[Path, Path]:
    require_tool("openssl", "openssl")
    cert, key = folder / "cert.pem", folder / "key.pem"
    names = ",".join(f"IP:{a}" for a in addresses)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={addresses[0]}", "-addext", f"subjectAltName={names}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_a_consumer_pulls_from_a_producer_at_another_address_over_tls(
    model: Path, tmp_path: Path, space: Namespace, remote_front: subprocess.Popen
) -> None:
    child = remote_front
    with engine(model) as llm:  # one engine alone: the reference
        # a prompt chosen here, on this machine's arithmetic: a fixed seed tied at step 7 on
        # some CPUs of our kind, which no comparison of greedy tokens can survive
        prompt, reference = choose_prompt(llm, PROMPT_TOKENS, seed=20261248)
    cert, key = _certificate(tmp_path, space.here, space.there)
    flags = ["--host", space.here, "--tls-cert", str(cert), "--tls-key", str(key)]
    node, ready = start_store_node(tmp_path, bytes(range(17, 49)), 16 << 20, flags=flags)
    try:
        assert ready["registry"].startswith(space.here + ":")
        common = kv_common(tmp_path)
        serve = {"registry": ready["registry"], "host": space.there, "tls_cert": str(cert),
                 "tls_key": str(key), "tls_ca": str(cert)}  # fmt: skip
        answer = produce_serving(child, model, {**common, "serve": serve}, prompt)
        assert answer["params"] == {"tpusync": {"blocks": FULL // BLOCK}}
        consume = {**common, "registry": {"address": ready["registry"], "tls_ca": str(cert)}}
        with engine(model, transfer_config(consume, role="kv_consumer")) as consumer:
            ((tokens, cached, _),) = generate_with(
                consumer, [prompt], kv_transfer_params=answer["params"]
            )
            assert (tokens, cached) == (reference, FULL)
            stats = settle(worker_of(consumer))
            assert stats["tiers"]["cluster"]["hits"] == FULL // BLOCK
        finish_front(child)
    finally:
        stop_process(node)
