"""Child processes of the demo, the benchmarks and the tests: a `tpusync serve` store node, and
a Python module run once for the JSON object it prints last; started and stopped by pid with
timeouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_json_child", "start_store_node", "stop_process", "write_secret_file"]


def write_secret_file(path: Path, secret: bytes) -> Path:
    """Writes ``secret`` in hex to a new file ``path`` of mode 0600 (as
    :func:`tpusync.kv.load_secret` requires) and returns the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, secret.hex().encode())
    finally:
        os.close(fd)
    return path


def start_store_node(
    work: Path,
    secret: bytes,
    dram_bytes: int,
    *,
    quiet: bool = True,
    registry_port: int | None = 0,
    flags: Sequence[str] = (),
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Runs `tpusync serve` in a child process, hosting the registry too (on
    ``registry_port``; 0: any free port; None: none, e.g. with ``--registry`` in ``flags``),
    with ``secret`` in ``work/secret`` and any other ``flags`` (e.g. ``--host``,
    ``--tls-cert``); returns the process and its ready line (``{"address", "registry"}``).
    Stop it with :func:`stop_process`."""
    secret_file = work / "secret"
    write_secret_file(secret_file, secret)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpusync",
            "serve",
            "--dram",
            str(dram_bytes),
            "--secret-file",
            str(secret_file),
            *(() if registry_port is None else ("--registry-port", str(registry_port))),
            "--ready-json",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        code = stop_process(process)
        raise RuntimeError(f"the store node failed to start (exit {code})")
    return process, json.loads(line)


def stop_process(process: subprocess.Popen[str], timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; closes its stdout; returns its exit code."""
    try:
        if process.poll() is None:
            process.terminate()
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(timeout=timeout)
    finally:
        if process.stdout is not None:
            process.stdout.close()


def run_json_child(module: str, spec: dict[str, Any], *, timeout: float = 300.0) -> Any:
    """Runs ``python -m module --child <spec as JSON>`` on the JAX CPU backend and returns the
    JSON object of its last stdout line; a child that runs past ``timeout`` is killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    if process.returncode != 0:
        raise RuntimeError(f"the child {module} failed (exit {process.returncode})")
    return json.loads(out.strip().splitlines()[-1])
