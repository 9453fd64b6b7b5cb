"""The connector's figures in vLLM's own stats, scraped from a real OpenAI server's ``/metrics``
(``python -m vllm.entrypoints.openai.api_server``, its engine in the server's process): the
store's counters per tier as ``vllm:tpusync_*``, and the hit's tokens under vLLM's
``prompt_tokens_cached_by_source`` named by the tier they came from (``host`` for DRAM)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from engines import BLOCK, build_model

from tpusync._src.testing.processes import stop_process

PROMPT = np.random.default_rng(20261207).integers(1, 1000, 300).tolist()
FULL = (len(PROMPT) - 1) // BLOCK * BLOCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, data: dict | None = None, timeout: float = 60) -> bytes:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An OpenAI server with the connector (DRAM only), its URL; stopped by its pid."""
    root = tmp_path_factory.mktemp("metrics")
    model = build_model(root / "model", seed=0)
    port = _free_port()
    kv = {
        "kv_connector": "TpuSyncConnector",
        "kv_connector_module_path": "tpusync.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "dram": {"capacity_blocks": 64},
            "socket_dir": str(root / "s"),
        },
    }
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
        "--block-size", str(BLOCK), "--max-model-len", "2048", "--skip-tokenizer-init",
        "--num-gpu-blocks-override", "256", "--distributed-executor-backend", "uni",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed below)
    child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # ~30 s on an idle 2-core machine
        while True:
            assert child.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                _get(f"{url}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start in 240 s"
                time.sleep(0.5)
        yield url
    finally:
        stop_process(child, timeout=30)
        log.close()


def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {"name{labels}": value}, the engine and model labels dropped."""
    values = {}
    for line in _get(f"{url}/metrics").decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        if "{" in name:
            base, _, labels = name.partition("{")
            kept = [
                pair
                for pair in labels.rstrip("}").split(",")
                if pair and not pair.startswith(("engine=", "model_name="))
            ]
            name = base + ("{" + ",".join(kept) + "}" if kept else "")
        values[name] = float(value)
    return values


@pytest.mark.timeout(300)  # the server's start (its fixture) counts
def test_metrics_show_the_stores_figures_per_tier_and_the_hits_source(server: str) -> None:
    completion = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    # the served model's name is its path: ask the server for it
    completion["model"] = json.loads(_get(f"{server}/v1/models"))["data"][0]["id"]
    cold = json.loads(_get(f"{server}/v1/completions", completion))
    _get(f"{server}/reset_prefix_cache", {})  # vLLM forgets; the store does not
    warm = json.loads(_get(f"{server}/v1/completions", completion))
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    # vLLM folds the connector's stats into its metrics every few steps: poll for them
    deadline = time.monotonic() + 30
    while True:
        metrics = _metrics(server)
        if metrics.get('vllm:tpusync_hit_tokens_total{tier="dram"}', 0) >= FULL:
            break
        assert time.monotonic() < deadline, {k: v for k, v in metrics.items() if "tpusync" in k}
        _get(f"{server}/v1/completions", {**completion, "prompt": PROMPT[:20], "max_tokens": 1})
        time.sleep(0.5)
    assert metrics['vllm:tpusync_hit_tokens_total{tier="dram"}'] == FULL
    assert metrics["vllm:tpusync_loads_total"] == 1
    assert metrics["vllm:tpusync_loaded_bytes_total"] > 0
    assert metrics["vllm:tpusync_load_seconds_total"] > 0
    assert metrics["vllm:tpusync_saved_blocks_total"] >= FULL // BLOCK
    assert metrics["vllm:tpusync_saved_bytes_total"] > 0
    assert metrics.get("vllm:tpusync_load_failed_blocks_total", 0) == 0
    assert metrics['vllm:prompt_tokens_cached_by_source_total{source="host"}'] == FULL
    assert metrics['vllm:prompt_tokens_cached_by_source_total{source="external_unspecified"}'] == 0
