"""The benchmark peers that run in their own environments: Google TPU Sync's
KVCacheManager and Mooncake's transfer engine, each started by the benchmark under its own
interpreter (``benchmarks/peers/setup.sh`` makes them; CI runs it). Each worker's first answer
says whether the peer moved every byte where it belongs; a benchmark without a peer lists it
as skipped with the command that sets it up. No figure is asserted."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import REPO
from tools import skip_or_fail

import tpusync
from tpusync._src.bench.command import peers
from tpusync._src.bench.common import PACKAGE_DIR, benchmarks_path
from tpusync._src.bench.external import (
    PEERS,
    default_peers_dir,
    peer_python,
    peer_state,
    start_peer,
)

# The tests run against the installed package, which has no checkout beside it: the peers'
# environments are the checkout's (benchmarks/peers/setup.sh makes them there).
PEERS_DIR = REPO / "benchmarks" / "peers"

ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(
        [str(Path(tpusync.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    ),
)


def _require(key: str) -> None:
    if peer_python(key, PEERS_DIR) is None:
        skip_or_fail(f"{PEERS[key].title}: {peer_state(key, PEERS_DIR)}")


def test_missing_peers_are_listed_as_skipped_with_the_setup_command(tmp_path: Path) -> None:
    found = peers(tmp_path)
    for key, peer in PEERS.items():
        assert peer_python(key, tmp_path) is None
        state = found[peer.title]
        assert state.startswith("skipped") and "benchmarks/peers/setup.sh" in state
        assert str(tmp_path / peer.venv) in state
    with contextlib.ExitStack() as stack, pytest.raises(LookupError, match=r"setup\.sh"):
        start_peer(stack, "tpu-sync", "tpu_sync_transfer", "transfer", {}, str(tmp_path),
                   peers_dir=tmp_path)  # fmt: skip


def test_default_peers_dir_is_the_checkouts_or_the_working_directorys() -> None:
    checkout = PACKAGE_DIR.parents[2] / "benchmarks"
    expected = checkout / "peers" if checkout.is_dir() else Path.cwd() / "tpusync-bench-peers"
    assert default_peers_dir() == benchmarks_path("peers") == expected


@pytest.mark.parametrize("block_bytes", [4096, 256 << 10])
def test_tpu_sync_worker_round_trip_moves_every_byte(tmp_path: Path, block_bytes: int) -> None:
    _require("tpu-sync")
    config = {"blocks": 24, "block_bytes": block_bytes, "seed": 3}
    with contextlib.ExitStack() as stack:
        child, first = start_peer(stack, "tpu-sync", "tpu_sync_transfer", "transfer", config,
                                  str(tmp_path), PEERS_DIR, timeout=120)  # fmt: skip
        assert first["verified"] is True and first["backend"] == "cpu"
        assert tuple(int(p) for p in first["jax"].split(".")[:2]) >= (0, 11)
        for op in ("d2h", "h2d"):
            assert child.request({"op": op}, timeout=60)["seconds"] > 0
        with pytest.raises(RuntimeError, match="unknown op"):
            child.request({"op": "nope"}, timeout=60)
        proc = child.proc
    assert proc.poll() is not None  # stopped by its pid with the stack


def test_a_pythonpath_into_this_environment_does_not_reach_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This interpreter's site-packages on PYTHONPATH (as when a test or a user sets it) would
    give the peer's Python 3.12 this environment's numpy; the worker starts without it."""
    _require("tpu-sync")
    monkeypatch.setenv("PYTHONPATH", str(Path(np.__file__).resolve().parents[1]))
    config = {"blocks": 4, "block_bytes": 4096, "seed": 1}
    with contextlib.ExitStack() as stack:
        _, first = start_peer(stack, "tpu-sync", "tpu_sync_transfer", "transfer", config,
                              str(tmp_path), PEERS_DIR, timeout=120)  # fmt: skip
        assert first["verified"] is True


def test_mooncake_worker_pull_delivers_every_byte(tmp_path: Path) -> None:
    _require("mooncake")
    config = {"blocks": 8, "block_bytes": 1 << 20, "seed": 5}
    with contextlib.ExitStack() as stack:
        child, first = start_peer(stack, "mooncake", "mooncake_pull", "client", config,
                                  str(tmp_path), PEERS_DIR, timeout=120)  # fmt: skip
        assert first["verified"] is True and first["mooncake"] != "unknown"
        assert child.request({"op": "pull"}, timeout=60)["seconds"] > 0
        proc = child.proc
    assert proc.poll() is not None


def test_bench_transfer_runs_tpu_sync_beside_tpusync(tmp_path: Path) -> None:
    _require("tpu-sync")
    results = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "tpusync", "bench", "transfer", "--quick", "--total-mib", "4",
         "--repeats", "1", "--results-dir", str(results), "--peers-dir", str(PEERS_DIR)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (path,) = (results / "transfer").glob("*.json")
    record = json.loads(path.read_text())
    row = record["results"][0]
    for way in ("d2h", "h2d"):
        assert row[f"{way}_tpu_sync_gbps"] > 0
        assert row[f"{way}_best_peer"] in ("pure-JAX engine", "Google TPU Sync")
    assert record["peers"]["Google TPU Sync"] == "runs"
    assert "TPU Sync" in done.stdout and "x peer" in done.stdout
