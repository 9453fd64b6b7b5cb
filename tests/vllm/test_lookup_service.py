"""The scheduler-worker lookup service on its own: a real Unix socket, real processes of this
and of another uid, a real store under the worker side (vLLM-shaped CPU KV tensors)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from engines import matched_when_answered, small_worker, vllm_request
from tools import skip_or_fail

from tpusync._src.connectors.vllm.events import MAX_KNOWN_BLOCKS, BlockEventLog
from tpusync._src.connectors.vllm.lookup_service import (
    MAX_HASHES,
    LookupClient,
    LookupServer,
    encode_request,
)
from tpusync._src.connectors.vllm.scheduler import SchedulerSide
from tpusync._src.connectors.vllm.settings import default_socket_dir, read_settings
from tpusync._src.connectors.vllm.worker import WorkerSide
from tpusync.errors import UnsafeFileError

BLOCK = 32
ENGINE = dict(
    model="m", block_size=BLOCK, tp_rank=0, tp_size=1, num_blocks=8, engine_id="e",
)  # fmt: skip


@pytest.fixture
def worker(tmp_path: Path):
    with small_worker(tmp_path / "s", "e") as side:
        # the two layers are views of one bf16 buffer: it is mapped once
        assert side.prefaulted_bytes == 2 * 8 * 2 * BLOCK * 64 * 2
        yield side


def _saved(worker: WorkerSide, n: int) -> list[bytes]:
    hashes = [os.urandom(32) for _ in range(n)]
    worker.store.save_engine_blocks_async(hashes, list(range(n))).result()
    return hashes


def test_a_lookup_pins_and_answers_over_the_socket(worker) -> None:
    hashes = _saved(worker, 3)
    client = LookupClient(worker.settings.socket_path, timeout_s=5)
    try:
        assert client.lookup("r1", 1, [*hashes, os.urandom(32)]) == (3, False)
        assert client.lookup("r2", 2, [os.urandom(32)]) == (0, False)
    finally:
        client.close()
    assert worker.store.stats()["store"]["open_handles"] == 1  # r1's pins
    worker.release("r1", 1)
    assert worker.store.stats()["store"]["open_handles"] == 0


def test_answers_in_any_order_the_highest_sequence_wins(worker) -> None:
    hashes = _saved(worker, 2)
    assert worker.answer("r", 2, hashes) == (2, False)
    assert worker.answer("r", 1, hashes) == (0, False)  # late: overtaken, pins nothing
    assert worker._pins["r"][0] == 2
    worker.release("r", 1)  # an older lookup's release leaves the newer pins
    assert "r" in worker._pins
    worker.release("r", 2)
    assert worker.answer("r", 2, hashes) == (0, False)  # released before it answered
    assert worker.store.stats()["store"]["open_handles"] == 0


def test_in_one_process_a_dram_lookup_is_answered_on_the_schedulers_thread(
    worker, monkeypatch
) -> None:
    """A store whose only tier is DRAM: its index settles every lookup, whole or partial, in
    the scheduler's call. The asker thread takes a lookup only while the store is busy (its
    lock held, as by a lower tier's lookup over the network) or when the DRAM lookup fails."""
    prompt = list(range(1, 201))  # 6 full blocks before the last token
    hashes = list(vllm_request(prompt).block_hashes)
    worker.store.save_engine_blocks_async(hashes[:3], [0, 1, 2]).result()
    scheduler = SchedulerSide(worker.settings, BLOCK)
    asked: list[str] = []
    submit = scheduler._asker.submit
    monkeypatch.setattr(
        scheduler._asker, "submit", lambda fn, *args: asked.append(args[0]) or submit(fn, *args)
    )
    try:
        part = vllm_request(prompt, "part")
        assert scheduler.matched_tokens(part, 0) == (3 * BLOCK, False)  # in the call
        assert asked == [] and worker._pins["part"][1].num_blocks == 3
        scheduler.finished(part)
        held, done = threading.Event(), threading.Event()

        def hold() -> None:
            with worker.store._stack.lock:
                held.set()
                done.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(10)
            busy = vllm_request(prompt, "busy")
            assert scheduler.matched_tokens(busy, 0) == (None, False)  # the asker waits
        finally:
            done.set()
            holder.join(10)
        assert matched_when_answered(scheduler, busy) == 3 * BLOCK and asked == ["busy"]
        scheduler.finished(busy)

        def broken(*args: Any) -> None:
            raise RuntimeError("a fault in the DRAM lookup")

        monkeypatch.setattr(worker, "answer_from_dram", broken)
        failed = vllm_request(prompt, "failed")
        assert matched_when_answered(scheduler, failed) == 3 * BLOCK and asked == ["busy", "failed"]
        scheduler.finished(failed)
        assert worker.store.stats()["store"]["open_handles"] == 0
    finally:
        scheduler.close()


def test_a_slow_worker_is_a_miss_within_the_deadline(tmp_path: Path) -> None:
    def slow(req_id: str, sequence: int, hashes: list[bytes]) -> tuple[int, bool]:
        if sequence == 1:
            time.sleep(1.0)
        return 5, sequence == 1

    server = LookupServer(tmp_path / "s" / "x.sock", slow)
    client = LookupClient(server.path, timeout_s=0.2)
    try:
        started = time.monotonic()
        assert client.lookup("r", 1, [b"h"]) is None
        assert time.monotonic() - started < 0.8
        # a new connection: never the stale answer of the first (which said True)
        assert client.lookup("r", 2, [b"h"]) == (5, False)
    finally:
        client.close()
        server.close()
    assert not server.path.exists()


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"X" + bytes(12),
        encode_request("r", 1, [b"h"])[4:-2],  # truncated
        encode_request("r", 1, [b"h"])[4:] + b"\0",  # trailing
        struct.pack("<BQH", ord("L"), 1, 1) + b"r" + struct.pack("<I", MAX_HASHES + 1),
        struct.pack("<BQH", ord("L"), 1, 1) + b"r" + struct.pack("<I", 1) + b"\0",
        struct.pack("<BQH", ord("L"), 1, 2) + b"\xff\xfe" + struct.pack("<I", 0),
    ],
)
def test_a_malformed_frame_closes_the_connection_and_the_server_goes_on(
    tmp_path: Path, body: bytes
) -> None:
    calls = []
    server = LookupServer(tmp_path / "s" / "x.sock", lambda *a: calls.append(a) or (1, False))
    try:
        with socket.socket(socket.AF_UNIX) as raw:
            raw.settimeout(5)
            raw.connect(os.fspath(server.path))
            raw.sendall(struct.pack("<I", len(body)) + body)
            assert raw.recv(16) == b""  # closed, no answer
        with socket.socket(socket.AF_UNIX) as raw:  # a frame larger than the bound
            raw.settimeout(5)
            raw.connect(os.fspath(server.path))
            raw.sendall(struct.pack("<I", 1 << 30))
            assert raw.recv(16) == b""
        client = LookupClient(server.path, timeout_s=5)
        assert client.lookup("r", 1, [b"h"]) == (1, False)
        client.close()
        assert len(calls) == 1
    finally:
        server.close()


def test_a_worker_already_serving_the_path_is_not_replaced(tmp_path: Path) -> None:
    server = LookupServer(tmp_path / "s" / "x.sock", lambda *a: (0, False))
    try:
        with pytest.raises(Exception, match="another worker serves lookups"):
            LookupServer(server.path, lambda *a: (0, False))
    finally:
        server.close()


def test_a_process_of_another_user_gets_no_answer(tmp_path: Path) -> None:
    """Even where the directory and socket let it in, a peer of another uid is refused
    (SO_PEERCRED) and its lookup never reaches the worker."""
    if os.geteuid() != 0:
        skip_or_fail("needs root to run a child as another uid")
    calls = []
    directory = tmp_path / "s"
    server = LookupServer(directory / "x.sock", lambda *a: calls.append(a) or (1, False))
    try:
        for path in (tmp_path, directory):
            path.chmod(0o711)
        server.path.chmod(0o666)
        code = (  # imports first: this user cannot read the interpreter's files
            "import os, pathlib, sys; "
            "from tpusync._src.connectors.vllm.lookup_service import LookupClient; "
            # the client imports no vLLM (seconds of CPU, a minute under load)
            "assert 'vllm' not in sys.modules, 'the lookup client imported vLLM'; "
            "os.setgid(65534); os.setuid(65534); "
            f"c = LookupClient(pathlib.Path({str(server.path)!r}), 5); "
            "print(c.lookup('r', 1, [b'h']))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "None"
        assert calls == []
    finally:
        server.close()


def test_a_socket_dir_another_user_made_first_is_refused_naming_socket_dir(
    tmp_path: Path,
) -> None:
    """A squatter's directory where the socket goes (as another uid could make
    ``/tmp/tpusync-vllm-<uid>`` first): the worker refuses to serve there, names the key and
    the way out, and touches nothing in it."""
    if os.geteuid() != 0:
        skip_or_fail("needs root to make a directory of another uid")
    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)
    with pytest.raises(UnsafeFileError, match=r"socket_dir: .*owned by uid 65534.*socket_dir"):
        LookupServer(squatted / "x.sock", lambda *a: (0, False))
    assert list(squatted.iterdir()) == []


def test_the_default_socket_dir_is_one_no_other_user_can_make_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_socket_dir() == runtime / f"tpusync-vllm-{os.getuid()}"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    fallback = Path(tempfile.gettempdir()) / f"tpusync-vllm-{os.getuid()}"
    with tempfile.TemporaryDirectory(prefix="h", dir="/tmp") as short:  # a short home
        home = Path(short)
        monkeypatch.setenv("HOME", str(home))
        assert default_socket_dir() == home / ".cache" / "tpusync-vllm"
        settings = read_settings({"dram": {"capacity_blocks": 4}}, **ENGINE)
        assert settings.socket_path.parent == home / ".cache" / "tpusync-vllm"
        if os.geteuid() == 0:  # a home of another uid: the temporary directory
            os.chown(home, 65534, 65534)
            assert default_socket_dir() == fallback
            os.chown(home, 0, 0)
    long_home = tmp_path / ("h" * 80)  # too long for a socket path below it
    long_home.mkdir()
    monkeypatch.setenv("HOME", str(long_home))
    assert default_socket_dir() == fallback
    monkeypatch.setenv("HOME", str(tmp_path / "missing"))
    assert default_socket_dir() == fallback


def test_the_kv_events_remember_as_many_blocks_as_the_tiers_hold(tmp_path: Path) -> None:
    """A block evicted long after it was saved still has its removal published: the event log
    knows at least as many blocks as DRAM and the disk tier hold, and says when it forgets."""
    extra = {
        "dram": {"capacity_blocks": 50_000},
        "disk": {"directory": str(tmp_path / "d"), "capacity_blocks": 100_000, "create": True},
        "socket_dir": str(tmp_path / "s"),
    }
    side = WorkerSide(read_settings(extra, **ENGINE), num_blocks=8)
    assert side.events.max_blocks == 150_000
    log = BlockEventLog(BLOCK, max_blocks=10)
    assert log.max_blocks == MAX_KNOWN_BLOCKS  # never fewer than the floor
    keys = [os.urandom(16) for _ in range(MAX_KNOWN_BLOCKS + 3)]
    log.learn(keys, [os.urandom(32) for _ in keys])
    assert log.forgotten == 3
    log.heard("removed", "dram", keys[:3])  # forgotten: no event
    log.heard("removed", "dram", keys[-1:])
    assert len(log.take().get_all_events()) == 1
