"""The soak's hostile peers (tests/cluster/test_soak_hostile_peers.py) in a process of their
own, as real attackers are: their threads share no interpreter lock with the servers under test, so
what the soak times is the servers' answer to them, not this test's GIL.

Run as ``python soak_attackers_child.py SPEC`` where SPEC is JSON: ``targets`` (``kind``,
``address``, ``tls``), ``ca`` (the certificate a TLS target presents), ``peers``, ``seconds``,
``stalled_per_peer`` and ``pause_s``. Prints ``attacking`` once its peers run, then, when
``seconds`` have passed and every peer stopped, one JSON line: how many times each behaviour
ran."""

from __future__ import annotations

import collections
import contextlib
import json
import random
import ssl
import sys
import threading
from typing import Any

from hostile_peers import HOSTILE, WAIT_S, Peer, Served


def hostile_peer(
    targets: list[Served],
    stop: threading.Event,
    seed: int,
    spec: dict[str, Any],
    ran: collections.Counter[str],
) -> None:
    """One hostile peer: every behaviour, in a random order, against a random server, until
    ``stop``; its stalled connections are closed oldest first beyond ``stalled_per_peer``."""
    rng = random.Random(seed)
    stalled: list[Peer] = []
    try:
        while not stop.is_set():
            behave = rng.choice(HOSTILE)
            # the server dropping this peer first is its right
            with contextlib.suppress(OSError, EOFError, ssl.SSLError):
                behave(rng.choice(targets), stalled)
            ran[behave.__name__] += 1  # one counter per thread's step: the GIL orders them
            while len(stalled) > spec["stalled_per_peer"]:
                stalled.pop(0).close()
            stop.wait(spec["pause_s"])
    finally:
        for peer in stalled:
            peer.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    client_tls = ssl.create_default_context(cafile=spec["ca"])
    targets = [
        Served(t["kind"], t["address"], None, client_tls if t["tls"] else None, lambda _: None)
        for t in spec["targets"]
    ]
    stop = threading.Event()
    ran: collections.Counter[str] = collections.Counter()
    peers = [
        threading.Thread(target=hostile_peer, args=(targets, stop, seed, spec, ran))
        for seed in range(spec["peers"])
    ]
    for peer in peers:
        peer.start()
    print("attacking", flush=True)
    stop.wait(spec["seconds"])
    stop.set()
    for peer in peers:
        peer.join(WAIT_S)
    if any(peer.is_alive() for peer in peers):
        sys.exit("a hostile peer did not stop")
    print(json.dumps(dict(ran)), flush=True)


if __name__ == "__main__":
    main()
