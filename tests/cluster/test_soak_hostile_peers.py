"""THE SOAK, bounded for CI: about a minute of 50 hostile peers
against a store node (with its embedded registry), a RegistryServer and a weights Publisher's
block server, all at once, while legitimate clients push, pull and delete blocks on the store
node, register, publish and look up in the registry, and pull the publisher's chunks.

The peers reset (at once, mid-handshake, after a wrong proof, once authenticated), half-close, stall
and send garbage before and after authenticating (the behaviours of tests/helpers/hostile_peers.py),
from a process of their own (tests/helpers/soak_attackers_child.py), as real attackers are: they
share no interpreter lock with the servers and the legitimate clients here. Each of them keeps at
most a few stalled connections open, so the servers face hundreds of pending handshakes (more than
their admission limit of 128).

What must hold: 0 wrong bytes (every pulled block is compared with what was saved); every
visit succeeded and none took more than 1 s (a visit is a fresh connection, the mutual handshake
and 3-4 round trips, milliseconds on loopback; with 50 peers attacking the longest took about
0.5 s at load 12 on 2 cores, beside the vLLM suite and another test session). A server that let
stalled peers hold up its handshake loop fails it: 50 peers keep stalling, and each stall costs
the loop a 2 s handshake deadline or more. Every hostile behaviour ran; nothing was logged at
ERROR; at the end the process's threads and descriptors are back at their baseline.
``TPUSYNC_SOAK_S`` changes the length (default 50 s of attack).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest
from hostile_peers import (
    HOSTILE,
    WAIT_S,
    Tls,
    back_to,
    holdings,
    serving,
    source_pool,
    tls_pair,
)
from paths import HELPERS

from tpusync.tiers import HostPool

ATTACK_S = float(os.environ.get("TPUSYNC_SOAK_S", "50"))
HOSTILE_PEERS = 50
STALLED_PER_PEER = 4  # stalled connections one hostile peer keeps open at most
PAUSE_S = 0.02  # between one peer's behaviours (50 peers share their process's GIL)
LONGEST_S = 1.0  # no legitimate visit may take longer
KINDS = ("store", "registry", "publisher")


@dataclass
class Visits:
    """One legitimate client's record."""

    done: int = 0
    failures: list[str] = field(default_factory=list)
    longest: float = 0.0


@pytest.fixture(scope="module")
def tls() -> Iterator[Tls]:
    with tls_pair() as pair:
        yield pair


@pytest.fixture
def source() -> Iterator[HostPool]:
    with source_pool() as pool:
        yield pool


@contextlib.contextmanager
def attackers_running(spec: dict[str, Any]) -> Iterator[subprocess.Popen[str]]:
    """The hostile peers in their own process (tests/helpers/soak_attackers_child.py), once they
    run; stopped by its pid if the test ends first."""
    child = subprocess.Popen(
        [sys.executable, str(HELPERS / "soak_attackers_child.py"), json.dumps(spec)],
        cwd=HELPERS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # its imports done, its peers started
        assert first == "attacking\n", first + (child.stderr.read() if child.stderr else "")
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=WAIT_S)


def legitimate(visit: Callable[[int], None], record: Visits, stop: threading.Event) -> None:
    """Visits until ``stop``, timing each visit (a fresh connection and real work, every byte
    checked by the visit itself)."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            visit(record.done)
        except Exception as exc:
            record.failures.append(repr(exc))
        took = time.monotonic() - started
        record.longest = max(record.longest, took)
        record.done += 1


@pytest.mark.soak
@pytest.mark.timeout(ATTACK_S + 120)
def test_soak_fifty_hostile_peers_against_a_store_node_a_registry_and_a_publisher(
    source: HostPool,
    shm_names: Callable[[], str],
    tls: Tls,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tpusync")
    with ExitStack() as stack:
        served = [stack.enter_context(serving(k, source, shm_names, tls)) for k in KINDS]
        for server in served:
            server.visit(0)  # the lazy parts (a node's pool, its lease thread) exist now
        baseline = holdings()
        stop_visits = threading.Event()
        spec = {
            "targets": [
                {"kind": s.kind, "address": s.address, "tls": s.client_tls is not None}
                for s in served
            ],
            "ca": str(tls.ca),
            "peers": HOSTILE_PEERS,
            "seconds": ATTACK_S,
            "stalled_per_peer": STALLED_PER_PEER,
            "pause_s": PAUSE_S,
        }
        attackers = stack.enter_context(attackers_running(spec))
        records = {s.kind: Visits() for s in served}
        clients = [
            threading.Thread(
                target=legitimate, args=(s.visit, records[s.kind], stop_visits), name=s.kind
            )
            for s in served
        ]
        for thread in clients:
            thread.start()
        try:  # the visits last as long as the attack
            out, err = attackers.communicate(timeout=ATTACK_S + WAIT_S)
        finally:
            stop_visits.set()
            for thread in clients:
                thread.join(WAIT_S)
        assert attackers.returncode == 0, err
        ran = json.loads(out.splitlines()[-1])
        assert set(ran) == {behave.__name__ for behave in HOSTILE}, ran  # every behaviour ran
        assert not any(t.is_alive() for t in clients), "a client did not finish"
        for server in served:
            server.visit(1)  # still serving once the attack is over
        after = back_to(baseline)
        health = {s.kind: s.server.health() for s in served}
        refusals = {s.kind: s.server.refusals() for s in served}
    for kind, record in records.items():
        print(f"{kind}: {record.done} visits, longest {record.longest:.3f} s, "
              f"refusals {refusals[kind]}")  # fmt: skip
    print(f"threads/fds {baseline} -> {after}; hostile behaviours {ran}")
    assert {k: r.failures for k, r in records.items()} == {k: [] for k in records}
    assert all(r.longest <= LONGEST_S for r in records.values()), {
        k: r.longest for k, r in records.items()
    }
    assert all(r.done >= 10 for r in records.values()), {k: r.done for k, r in records.items()}
    assert after[0] <= baseline[0] and after[1] <= baseline[1], (baseline, after)
    for kind, report in health.items():
        assert report["ok"], (kind, report)
        assert report["loops"]["handshakes"] == {"alive": True, "restarts": 0}, (kind, report)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
