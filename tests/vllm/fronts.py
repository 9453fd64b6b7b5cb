"""vLLM engines in child processes for the connector tests: ``serve_once.py`` started early
(its import of vLLM overlaps the tests before the one that uses it), read line by line with
deadlines, stopped by its pid group, and what a killed engine leaves in /dev/shm removed."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
# a front builds vLLM's engine (other processes, spawned) for the request, then answers: ~30 s
# on an idle 2-core machine, past 110 s beside the other suites and two busy loops
ANSWER_S = 300.0


@contextlib.contextmanager
def serve_once_front(
    tmp_path_factory: pytest.TempPathFactory, namespace: str | None = None
) -> Iterator[subprocess.Popen]:
    """``serve_once.py`` (vLLM's multi-process engine: its front, engine-core and worker
    processes), in network namespace ``namespace`` if given, stopped by its pid group."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    scratch = tmp_path_factory.mktemp("mp-scratch")  # vLLM's IPC sockets (it leaves them)
    env.update(VLLM_RPC_BASE_PATH=str(scratch), TMPDIR=str(scratch))
    before = set(os.listdir("/dev/shm"))
    enter = ["ip", "netns", "exec", namespace] if namespace else []  # it execs: the same pid
    child = subprocess.Popen(
        [*enter, sys.executable, str(HERE / "serve_once.py")],
        cwd=HERE,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    child.shm_before = before  # type: ignore[attr-defined]
    try:
        yield child
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        remove_orphaned_vllm_shm(before)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def mapped_shm_files(other_than: int | None = None) -> set[str]:
    """The /dev/shm files some live process (other than pid ``other_than``) has mapped."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            mine = proc.name == str(other_than)
            maps = (proc / "maps").read_text() if proc.name.isdigit() and not mine else ""
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                found.add(parts[5])
    return found


def remove_orphaned_vllm_shm(before: set[str]) -> None:
    """Removes vLLM's shared-memory queues and semaphores (``psm_*``, ``sem.mp-*``) made since
    ``before`` that no live process maps: what an engine killed by SIGKILL leaves behind."""
    mapped = mapped_shm_files()
    for path in Path("/dev/shm").iterdir():
        if (
            path.name.startswith(("psm_", "sem.mp-"))
            and path.name not in before
            and str(path) not in mapped
        ):
            path.unlink(missing_ok=True)


def line_before(child: subprocess.Popen, deadline: float) -> str | None:
    """The child's next stdout line, or None when it closes or the deadline passes."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
    line = child.stdout.readline() if ready else ""
    return line.strip() if line else None


def ask_front(child: subprocess.Popen, request: dict[str, Any], deadline: float) -> dict:
    """Sends ``request`` to a ``serve_once.py`` front once it is ready; returns its answer."""
    while (line := line_before(child, deadline)) != "ready":  # vLLM logs to stdout too
        assert line is not None, "serve_once.py ended or hung before it was ready"
    assert child.stdin is not None
    child.stdin.write(json.dumps(request) + "\n")
    child.stdin.flush()
    while True:
        line = line_before(child, deadline)
        assert line is not None, "the producer ended or hung before it answered"
        if line.startswith("{"):
            return json.loads(line)


def kv_common(tmp_path: Path) -> dict[str, Any]:
    """The connector config both roles of a disaggregation test share: the secret, the
    lookup sockets' folder and a DRAM tier."""
    return {"secret_file": str(tmp_path / "secret"), "socket_dir": str(tmp_path / "s"),
            "dram": {"capacity_blocks": 64}}  # fmt: skip


def produce_serving(
    child: subprocess.Popen, model: Path, kv: dict[str, Any], prompt: list[int]
) -> dict:
    """Has the ``serve_once.py`` front ``child`` prefill ``prompt`` as a producer with config
    ``kv`` (its ``serve`` section included) in vLLM's multi-process engine, holding the engine
    (and its served DRAM) until :func:`finish_front`; returns its answer."""
    request = {"model": str(model), "kv": kv, "prompt": prompt, "executor": "mp",
               "role": "kv_producer", "max_tokens": 1, "hold": True}  # fmt: skip
    return ask_front(child, request, time.monotonic() + ANSWER_S)


def finish_front(child: subprocess.Popen) -> None:
    """Lets a holding front close its engine, and checks that it exits cleanly."""
    assert child.stdin is not None
    child.stdin.write("done\n")
    child.stdin.close()
    assert child.wait(timeout=60) == 0
