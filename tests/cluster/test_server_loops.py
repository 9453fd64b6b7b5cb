"""No peer can stop a tpusync server. Real servers, real sockets on
loopback, in this process (so that its threads and descriptors can be counted):

* a flood of hostile peers against each server kind (a store node's data port as `tpusync
  serve` runs it, a RegistryServer, a weights Publisher's block server, a RegistryServer under
  TLS): peers that reset (SO_LINGER 0) right after connecting, mid-handshake, after a wrong
  proof or once authenticated; that half-close; that stall; that send garbage before and after
  authenticating. A legitimate client is served throughout, nothing is logged at ERROR, and
  afterwards the process's threads and descriptors come back to their baseline;
* 2,000 resets in a row against one server, then a legitimate request (ten were enough to stop
  every server for good: the first send of the hello raised in the admission loop);
* a loop that dies of a bug is restarted; one that keeps dying is given up on: the server stops
  listening, and `tpusync serve` exits 1 with the traceback;
* `tpusync health`: exit 0 for a healthy server; 1 with one line for nothing listening, a wrong
  secret, a wedged handshake loop, TLS on one side only.

No wall-clock bound here would fail at 5x load: waits are on events, or bounded by generous
margins (the handshake deadline is 2 s; a flood's clean-up is given 30 s).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile_peers import (
    KINDS,
    SECRET,
    WAIT_S,
    Peer,
    Tls,
    _address,
    _frame,
    _recv_exact,
    _reset,
    attack,
    back_to,
    holdings,
    serving,
    source_pool,
    tls_pair,
)
from preauth_child import key_for

from tpusync._src import cli
from tpusync._src.cluster._admission import INTERNAL, HandshakeLoop
from tpusync.cluster import (
    BlockServer,
    LeaseTable,
    MemoryRegistry,
    RegistryServer,
    RemoteRegistry,
    probe_health,
)
from tpusync.tiers import HostPool


@pytest.fixture(scope="module")
def tls() -> Iterator[Tls]:
    with tls_pair() as pair:
        yield pair


@pytest.fixture
def source() -> Iterator[HostPool]:
    with source_pool() as pool:
        yield pool


@pytest.fixture
def names(shm_names: Callable[[], str]) -> Callable[[], str]:
    return shm_names


@pytest.mark.parametrize("kind", KINDS)
def test_a_flood_of_hostile_peers_stops_nothing(
    kind: str,
    source: HostPool,
    names: Callable[[], str],
    tls: Tls,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Resets (at once, mid-TLS, mid-handshake, after a wrong proof, once authenticated),
    half-closes, stalls and garbage (before and after authenticating) from three threads,
    while a legitimate client keeps visiting: every visit succeeds, nothing is logged at ERROR
    and no peer reached the loop's last-resort handler, the handshake loop was never
    restarted, and afterwards the threads and descriptors come back to their baseline."""
    caplog.set_level(logging.WARNING, logger="tpusync")
    with serving(kind, source, names, tls) as served:
        served.visit(0)  # the lazy parts (a store node's pool, its lease thread) exist now
        baseline = holdings()
        stalled: list[Peer] = []
        errors: queue.Queue[str] = queue.Queue()
        attackers = [
            threading.Thread(target=attack, args=(served, 30, stalled, errors), daemon=True)
            for _ in range(3)
        ]
        for thread in attackers:
            thread.start()
        visits, failures = 0, []
        while any(t.is_alive() for t in attackers) or visits < 3:
            try:
                served.visit(visits + 1)
            except Exception as exc:
                failures.append(repr(exc))
            visits += 1
        for thread in attackers:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in attackers), "the attackers did not finish"
        for peer in stalled:
            peer.close()
        served.visit(visits + 1)  # still serving once the flood is over
        after = back_to(baseline)
        health = served.server.health()
    assert errors.empty(), list(errors.queue)
    assert failures == [], failures
    print(f"{kind}: {visits} visits, {len(stalled)} stalled, threads/fds {baseline} -> {after}, "
          f"refusals {served.server.refusals()}")  # fmt: skip
    assert after[0] <= baseline[0] and after[1] <= baseline[1], (baseline, after)
    assert health["ok"] and health["loops"]["handshakes"] == {"alive": True, "restarts": 0}
    assert INTERNAL not in served.server.refusals()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("kind", KINDS)
def test_two_thousand_resets_in_a_row_then_a_legitimate_request(
    kind: str,
    source: HostPool,
    names: Callable[[], str],
    tls: Tls,
) -> None:
    """2,000 connections reset (SO_LINGER 0) right after connecting, one after the other; then
    a legitimate client is served and the loop never died. (Ten were enough to stop every
    server for good: the hello's send raised ConnectionResetError in the admission loop.)"""
    with serving(kind, source, names, tls) as served:
        served.visit(0)
        baseline = holdings()
        host_port = _address(served.address)
        for _ in range(2000):
            _reset(socket.create_connection(host_port, timeout=WAIT_S))
        served.visit(1)
        after = back_to(baseline)
        loop = served.server.health()["loops"]["handshakes"]
    assert loop == {"alive": True, "restarts": 0}
    assert after[0] <= baseline[0] and after[1] <= baseline[1], (baseline, after)


# -- a loop that dies of a bug ---------------------------------------------------------------------


def test_a_loop_that_dies_of_a_bug_is_restarted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The handshake loop's accept step raises once (an injected bug): the loop is logged
    with its traceback and started again, and clients are served as before."""
    accept = HandshakeLoop._accept
    raised = threading.Event()

    def buggy(self: HandshakeLoop) -> None:
        if not raised.is_set():
            raised.set()
            raise RuntimeError("injected: a bug in the accept step")
        accept(self)

    monkeypatch.setattr(HandshakeLoop, "_accept", buggy)
    caplog.set_level(logging.ERROR, logger="tpusync")
    with RegistryServer(MemoryRegistry(), secret=SECRET) as server:
        with RemoteRegistry(server.address, secret=SECRET, timeout_s=WAIT_S) as client:
            client.ping()  # its connection was the one that met the bug
            assert client.nodes() == []
        health = server.health()
    assert raised.is_set()
    assert health["ok"] and health["loops"]["handshakes"] == {"alive": True, "restarts": 1}
    (record,) = [r for r in caplog.records if "died" in r.getMessage()]
    assert record.exc_info is not None and "injected" in str(record.exc_info[1])
    assert "starting it again" in record.getMessage()


def test_a_lease_expiry_loop_that_dies_is_restarted_and_still_expires(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, source: HostPool
) -> None:
    expiry = LeaseTable._expiry_loop
    raised = threading.Event()

    def buggy(self: LeaseTable) -> None:
        if not raised.is_set():
            raised.set()
            raise RuntimeError("injected: a bug in the expiry loop")
        expiry(self)

    monkeypatch.setattr(LeaseTable, "_expiry_loop", buggy)
    caplog.set_level(logging.CRITICAL, logger="tpusync")
    with BlockServer(source, secret=SECRET) as server:
        assert raised.wait(WAIT_S)
        server.leases.acquire([key_for(0)], 0.2)
        deadline = time.monotonic() + WAIT_S
        while server.leases.expired == 0:  # no call: only the (restarted) thread expires it
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.02)
        health = server.health()
    assert health["ok"] and health["loops"]["lease expiry"] == {"alive": True, "restarts": 1}


def test_a_loop_that_keeps_dying_is_given_up_and_the_server_stops_listening(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An accept step that always raises: six deaths within a minute, then the loop is given
    up on; the server closes its listener (a client is refused at once, not queued for
    nobody), reports the failure (on_failure, health) and logs the traceback."""

    def always(self: HandshakeLoop) -> None:
        raise RuntimeError("injected: the accept step always fails")

    monkeypatch.setattr(HandshakeLoop, "_accept", always)
    failed = threading.Event()
    heard: list[tuple[str, BaseException]] = []
    caplog.set_level(logging.ERROR, logger="tpusync")
    with RegistryServer(MemoryRegistry(), secret=SECRET) as server:
        server.on_failure(lambda loop, exc: (heard.append((loop, exc)), failed.set()))
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S):
            assert failed.wait(WAIT_S), "the loop was never given up on"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S).close()
        health = server.health()
        late: list[str] = []
        server.on_failure(lambda loop, exc: late.append(loop))  # told at once, too
    ((loop, exc),) = heard
    assert loop == f"the handshake loop of the registry server at {server.address}"
    assert isinstance(exc, RuntimeError) and late == [loop]
    assert health["ok"] is False and "injected" in health["failure"]
    assert isinstance(server.failure, RuntimeError)
    critical = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert any("giving up" in m and "Traceback" in m and "injected" in m for m in critical)


SERVE_WITH_A_BUG = """
import sys
from tpusync._src.cluster import _admission

def always(self):
    raise RuntimeError("injected: the accept step always fails")

_admission.HandshakeLoop._accept = always
from tpusync._src.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _secret_file(tmp_path: Path, secret: bytes = SECRET) -> str:
    path = tmp_path / "secret"
    path.write_text(secret.hex())
    path.chmod(0o600)
    return str(path)


def _child_env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_tpusync_serve_exits_1_with_the_traceback_when_a_loop_keeps_dying(
    tmp_path: Path,
) -> None:
    """`tpusync serve` whose accept step always fails (injected in the child): once a peer
    connects, the loop dies six times, is given up on, and the command exits 1 with the
    traceback (a supervisor then restarts it) instead of running on deaf."""
    argv = ["serve", "--dram", "4MiB", "--secret-file", _secret_file(tmp_path), "--json"]
    with subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_A_BUG, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    ) as child:
        try:
            assert child.stdout is not None
            ready = json.loads(child.stdout.readline())
            with socket.create_connection(_address(ready["address"]), timeout=WAIT_S):
                code = child.wait(timeout=60)
            _, err = child.communicate(timeout=WAIT_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=WAIT_S)
    assert code == 1, err[-3000:]
    assert "tpusync serve: the handshake loop of the store node at" in err
    assert "kept dying; exiting so that a supervisor restarts this process" in err
    assert "Traceback (most recent call last)" in err and "injected" in err


# -- tpusync health -------------------------------------------------------------------------------


def health(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["health", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", KINDS)
def test_health_of_a_healthy_server_exits_0(
    kind: str,
    source: HostPool,
    names: Callable[[], str],
    tls: Tls,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = _secret_file(tmp_path)
    with serving(kind, source, names, tls) as served:
        flags = ["--secret-file", secret]
        if served.client_tls is not None:
            flags += ["--tls-ca", str(tls.ca)]
        code, out, err = health(capsys, served.address, *flags)
        code_json, out_json, _ = health(capsys, served.address, *flags, "--json")
    assert (code, err) == (0, ""), err
    label = {"store": "store node", "publisher": "block server"}.get(kind, "registry server")
    assert out.startswith(f"{served.address}: healthy: {label}: authenticated;"), out
    assert code_json == 0
    answer = json.loads(out_json)
    assert answer["healthy"] is True and answer["report"]["loops"]["handshakes"]["alive"]


def test_health_says_why_not_in_one_line(
    tmp_path: Path,
    tls: Tls,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 1 and one line on stderr: nothing listens; a wrong secret; TLS on one side only;
    a usage error exits 2."""
    secret = _secret_file(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as spare:
        free = f"127.0.0.1:{spare.getsockname()[1]}"
    cases = []
    cases.append(health(capsys, free, "--secret-file", secret))
    with RegistryServer(MemoryRegistry(), secret=SECRET) as plain:
        (tmp_path / "other").mkdir()
        wrong = _secret_file(tmp_path / "other", os.urandom(32))
        cases.append(health(capsys, plain.address, "--secret-file", wrong))
        cases.append(
            health(capsys, plain.address, "--secret-file", secret, "--tls-ca", str(tls.ca))
        )
    with RegistryServer(MemoryRegistry(), secret=SECRET, tls=tls.server) as tls_only:
        cases.append(health(capsys, tls_only.address, "--secret-file", secret, "--timeout", "30"))
    usage = health(capsys, "no-port-here", "--secret-file", secret)
    expected = [
        "nothing listens there (connection refused)",
        "rejected this client's secret: pass the secret the server was started with",
        "does not serve TLS (it answered in the clear)",
        "serves TLS only, and this client connected without it",
    ]
    for (code, out, err), words in zip(cases, expected, strict=True):
        assert code == 1 and out == "", (code, out, err)
        assert err.startswith("tpusync health: 127.0.0.1:") and words in err, err
        assert err.count("\n") == 1, err
    assert usage[0] == 2 and "HOST:PORT: expected 'host:port'" in usage[2], usage


def test_health_of_a_server_whose_handshake_loop_is_wedged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer's proof wedges the handshake loop (its answer step blocks, injected): the
    kernel still accepts connections, but the probe gets no hello and says so within its
    timeout."""
    entered, release = threading.Event(), threading.Event()
    with RegistryServer(MemoryRegistry(), secret=SECRET) as server:
        assert server._handshakes is not None
        answer = server._handshakes._answer

        def wedged(state: Any, frame: bytes) -> tuple[bytes, str | None]:
            entered.set()
            release.wait(WAIT_S)
            return answer(state, frame)

        server._handshakes._answer = wedged
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as peer:
                (n,) = struct.unpack(">I", _recv_exact(peer, 4))
                _recv_exact(peer, n)
                peer.sendall(_frame(b"{}"))
                assert entered.wait(WAIT_S)
                start = time.monotonic()
                code, out, err = health(capsys, server.address, "--secret-file",
                                        _secret_file(tmp_path), "--timeout", "1")  # fmt: skip
                took = time.monotonic() - start
        finally:
            release.set()
    assert code == 1 and out == ""
    assert "sent no hello within 1 s: its handshake loop is stuck or overloaded" in err, err
    assert took < WAIT_S  # bounded by the probe's timeout (a watchdog), not by the server


def test_probe_health_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        probe_health("127.0.0.1:1", secret=SECRET, timeout_s=0)
    with pytest.raises(ValueError, match=r"address: '10\.1\.2\.3' is not a loopback address"):
        probe_health("10.1.2.3:7400", secret=SECRET)
    with pytest.raises(ValueError, match="secret"):
        probe_health("127.0.0.1:1", secret=b"short")


def test_tpusync_health_against_tpusync_serve(tmp_path: Path) -> None:
    """The supervisor's view: `tpusync health` (a child) exits 0 for both ports of a running
    `tpusync serve` (data plane and embedded registry), and 1 once it has stopped."""
    secret = _secret_file(tmp_path)
    argv = ["serve", "--dram", "4MiB", "--secret-file", secret, "--registry-port", "0", "--json"]

    def probe(address: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tpusync", "health", address, "--secret-file", secret],
            capture_output=True, text=True, timeout=120, env=_child_env(),
        )  # fmt: skip

    with subprocess.Popen(
        [sys.executable, "-m", "tpusync", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    ) as child:
        try:
            assert child.stdout is not None
            ready = json.loads(child.stdout.readline())
            data, registry = probe(ready["address"]), probe(ready["registry"])
            child.terminate()
            assert child.wait(timeout=60) == 0
            stopped = probe(ready["address"])
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=WAIT_S)
    assert data.returncode == 0 and "healthy: store node" in data.stdout, data.stderr
    assert registry.returncode == 0 and "healthy: registry server" in registry.stdout
    assert stopped.returncode == 1 and "nothing listens there" in stopped.stderr
