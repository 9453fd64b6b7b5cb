"""Peers that need an environment of their own: Google TPU Sync (Python 3.12, jax >= 0.11) and
Mooncake's transfer engine. ``benchmarks/peers/setup.sh`` makes one virtual environment per peer
under the peers directory; a benchmark starts a peer's worker
(:mod:`tpusync._src.bench.peer_workers`) with that interpreter, and lists the peer as skipped, with
the reason, when it is not there."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpusync._src.bench.common import benchmarks_path
from tpusync._src.bench.network_procs import Child, start_child

__all__ = [
    "PEERS",
    "ExternalPeer",
    "default_peers_dir",
    "peer_python",
    "peer_state",
    "setup_hint",
    "start_peer",
]

WORKERS_DIR = Path(__file__).resolve().parent / "peer_workers"


@dataclass(frozen=True)
class ExternalPeer:
    """A peer in its own environment: ``venv`` under the peers directory, ``uses`` says which
    benchmark rows it gives."""

    title: str
    venv: str
    uses: str


PEERS: dict[str, ExternalPeer] = {
    "tpu-sync": ExternalPeer("Google TPU Sync", ".venv-tpu-sync", "transfer (KVCacheManager)"),
    "mooncake": ExternalPeer("Mooncake", ".venv-mooncake", "network (transfer engine, TCP)"),
}


def default_peers_dir() -> Path:
    """Where the peers' environments are unless told: :func:`benchmarks_path` ``("peers")``."""
    return benchmarks_path("peers")


def setup_hint(peers_dir: str | Path | None = None) -> str:
    """How to make the peers' environments in ``peers_dir``: the script of the source checkout
    it is in, or that this tpusync runs from; an installed tpusync (pip) has no script, so
    where to get it."""
    folders = [benchmarks_path("peers")]
    if peers_dir is not None:
        folders.insert(0, Path(peers_dir))
    for folder in folders:
        if (folder / "setup.sh").is_file():
            return f"make it with `bash {folder / 'setup.sh'}`"
    return (
        "pip installs no scripts: make it with benchmarks/peers/setup.sh of a clone of tpusync's "
        "source repository, then pass --peers-dir CLONE/benchmarks/peers"
    )


def peer_python(key: str, peers_dir: str | Path | None = None) -> Path | None:
    """The interpreter of peer ``key``'s environment, or None where it is not set up."""
    base = Path(peers_dir) if peers_dir is not None else default_peers_dir()
    python = base / PEERS[key].venv / "bin" / "python"
    return python if python.exists() else None


def peer_state(key: str, peers_dir: str | Path | None = None) -> str:
    """ "runs" or why peer ``key`` is skipped."""
    if peer_python(key, peers_dir) is not None:
        return "runs"
    base = Path(peers_dir) if peers_dir is not None else default_peers_dir()
    return f"skipped: no environment at {base / PEERS[key].venv} ({setup_hint(peers_dir)})"


def peer_environment() -> dict[str, str]:
    """This process's environment without what would point another interpreter at this one's
    packages (a PYTHONPATH naming this environment's site-packages breaks the peer's numpy)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def start_peer(
    stack: contextlib.ExitStack,
    key: str,
    worker: str,
    kind: str,
    config: dict[str, Any],
    log_dir: str,
    peers_dir: str | Path | None = None,
    timeout: float = 300.0,
) -> tuple[Child, dict[str, Any]]:
    """Starts ``peer_workers/<worker>.py --child kind config`` under peer ``key``'s interpreter
    (stopped by ``stack``) and returns it with its first answer; refuses a worker whose check
    failed. Raises LookupError where the peer is not set up."""
    python = peer_python(key, peers_dir)
    if python is None:
        raise LookupError(peer_state(key, peers_dir))
    program = (str(python), str(WORKERS_DIR / f"{worker}.py"))
    child, first = start_child(stack, f"{key}-{kind}", kind, config, log_dir, timeout=timeout,
                               program=program, env=peer_environment())  # fmt: skip
    if not first.get("verified"):
        raise RuntimeError(f"{PEERS[key].title}: its round trip moved wrong bytes: {first}")
    return child, first
