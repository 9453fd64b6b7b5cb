"""The fan-out part of ``tpusync bench weights``: one trainer and 1, 2, 4 and 8 samplers, each
on its own host (a network namespace) with one link shaped to ``--rate-mbit`` both ways, all on
one switch (:mod:`tpusync._src.testing.hosts`). Each sampler runs a relay beside it, chained
(the first takes from the trainer, each other from the one before) and takes its chunks from
it. In one run beside: the link's limit (one iperf3 stream between two hosts), one sampler
pulling straight from the trainer (no relay), and N such pulls one after another (what N
samplers without fan-out cost the trainer's link). Timed from each ``publish`` returning to
the last sampler's commit, in this process; every sampler checks every byte of every version.

The tree is ``--fanout-mib`` of float32 in 8 leaves; each sampler holds up to five copies (its
relay's pool of three versions, its committed version and the next one's buffers), so eight
samplers take 40 of them in memory.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import time
import uuid
from typing import Any

from tpusync._src.bench.common import median
from tpusync._src.cluster.registry import MemoryRegistry, RegistryServer
from tpusync._src.testing.hosts import Host, hosts_on_a_switch
from tpusync._src.testing.weights_procs import Child

__all__ = ["fanout"]


def _link_gbps(server: Host, client: Host, nbytes: int) -> float:
    """GB/s of one iperf3 stream of ``nbytes`` from ``client`` to ``server``."""
    listening = subprocess.Popen(
        server.command(["iperf3", "-s", "-1", "-B", server.address]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):  # the server's socket, up within a moment
            out = subprocess.run(
                client.command(["iperf3", "-c", server.address, "-n", str(nbytes), "-J"]),
                capture_output=True,
                text=True,
                timeout=120,
            )
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not up yet: again
                received = json.loads(out.stdout)["end"]["sum_received"]
                return received["bits_per_second"] / 8e9
            time.sleep(0.1)
        raise RuntimeError(f"iperf3 between hosts failed: {out.stderr[-300:]}")
    finally:
        listening.kill()
        listening.wait(timeout=10)


def _round(samplers: list[Child], trainer: Child, version: int) -> tuple[float, list[dict]]:
    """Publishes ``version``; seconds from publish() returning to the last commit."""
    published = trainer.ask(f"publish {version}", timeout=600)
    if published.get("published") != version:
        raise RuntimeError(f"trainer: {published}")
    start = time.perf_counter()
    for child in samplers:
        child.send(f"pull {version}")
    answers = [child.answer(timeout=600) for child in samplers]
    seconds = time.perf_counter() - start
    wrong = [a for a in answers if not a.get("exact")]
    if wrong:
        raise RuntimeError(f"a sampler did not commit version {version} exactly: {wrong[0]}")
    return seconds, answers


def fanout(mib: int, counts: list[int], repeats: int, rate_mbit: int) -> dict[str, Any]:
    """The fan-out measurements (see the module docstring)."""
    secret = secrets.token_bytes(32)
    env = {"TPUSYNC_TEST_SECRET": secret.hex()}
    name = f"bench-fan-{uuid.uuid4().hex[:8]}"
    nbytes = mib << 20
    version = 0
    with contextlib.ExitStack() as stack:
        switch = stack.enter_context(hosts_on_a_switch(max(counts) + 1, rate_mbit))
        registry = stack.enter_context(
            RegistryServer(MemoryRegistry(), host=switch.address, secret=secret, insecure=True)
        )
        trainer_host, *hosts = switch.hosts
        link = median([_link_gbps(trainer_host, hosts[0], nbytes) for _ in range(3)])
        common = [name, registry.address]
        trainer = Child(["fanouttrainer", *common, trainer_host.address, str(mib)], env,
                        host=trainer_host)  # fmt: skip
        stack.callback(trainer.stop)
        trainer.answer(timeout=300)

        def run(args_of: list[list[str]]) -> tuple[list[float], list[int]]:
            nonlocal version
            samplers = [
                Child(["fanoutsampler", *common, *args, str(mib)], env, host=hosts[k])
                for k, args in enumerate(args_of)
            ]
            try:
                for child in samplers:
                    child.answer(timeout=300)
                times, sent = [], []
                for r in range(repeats + 1):  # the first: a warm-up
                    version += 1
                    before = trainer_host.sent_bytes()
                    seconds, _ = _round(samplers, trainer, version)
                    if r:
                        times.append(seconds)
                        sent.append(trainer_host.sent_bytes() - before)
                return times, sent
            finally:
                for child in samplers:
                    child.stop()

        direct, direct_sent = run([[hosts[0].address, "none"]])
        chained = {}
        for n in counts:
            chain = [
                [hosts[k].address, "-" if k == 0 else f"{hosts[k - 1].address}:7400"]
                for k in range(n)
            ]
            times, sent = run(chain)
            chained[n] = {"seconds": times, "trainer_sent_bytes": sent}
    one = median(direct)
    return {
        "mib": mib,
        "rate_mbit": rate_mbit,
        "link_gbps": link,
        "direct_seconds": direct,
        "direct_trainer_sent_bytes": direct_sent,
        "relayed": {
            str(n): {
                **c,
                "median_seconds": median(c["seconds"]),
                "x_one_sampler": median(c["seconds"]) / one,
                "x_sequential": median(c["seconds"]) / (n * one),
                "trainer_copies": median(c["trainer_sent_bytes"]) / nbytes,
            }
            for n, c in chained.items()
        },
    }


HEADERS = ["fan-out (hosts on one switch)", "GB/s a sampler", "x link limit", "x 1 sampler",
           "seconds to last commit", "trainer copies/version"]  # fmt: skip


def fanout_rows(found: dict[str, Any]) -> list[list[Any]]:
    """The table rows of :func:`fanout`'s results (columns :data:`HEADERS`)."""
    nbytes = found["mib"] << 20
    one = median(found["direct_seconds"])
    link = found["link_gbps"]
    copies = median(found["direct_trainer_sent_bytes"]) / nbytes
    rows = [
        [f"link limit: iperf3, 1 stream, {found['rate_mbit']} Mbit/s shaped", f"{link:.3f}",
         "", "", "", ""],
        ["1 sampler straight from the trainer (no relay)", f"{nbytes / one / 1e9:.3f}",
         nbytes / one / 1e9 / link, "1.00", f"{one:.2f}", f"{copies:.2f}"],
    ]  # fmt: skip
    for n, c in found["relayed"].items():
        seconds = c["median_seconds"]
        rows.append([
            f"{n} samplers through chained relays ({n} sequential pulls: {int(n) * one:.2f} s)",
            f"{nbytes / seconds / 1e9:.3f}", nbytes / seconds / 1e9 / link,
            f"{c['x_one_sampler']:.2f}", f"{seconds:.2f}", f"{c['trainer_copies']:.2f}",
        ])  # fmt: skip
    return rows
