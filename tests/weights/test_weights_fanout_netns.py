"""Fan-out across hosts: a trainer and eight samplers, each on its own host (a network
namespace) whose link is shaped to 1 Gbit/s both ways, all on one switch. Each sampler runs a
relay beside it, chained (the first takes from the trainer, each other from the one before),
and takes every chunk from its own relay. Every sampler commits every version bit for bit;
the trainer's link carries about one copy of each version (at most 1.5x, measured on its
link); a relay killed while the chain serves, and one that damages every chunk it holds,
cost retries from the publisher, never a wrong byte. The processes are
tpusync._src.testing.weights_procs children, stopped by their pids."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

import pytest
from run_names import run_name
from tools import require_tool, skip_or_fail

from tpusync._src.testing.hosts import Switch, hosts_on_a_switch
from tpusync._src.testing.weights_procs import Child
from tpusync.cluster import MemoryRegistry, RegistryServer

SECRET = secrets.token_bytes(32)
SAMPLERS = 8
MIB = 16  # a version; at 1 Gbit/s about 0.14 s a copy
ENV = {"TPUSYNC_TEST_SECRET": SECRET.hex()}


@pytest.fixture
def switch() -> Iterator[Switch]:
    if os.geteuid() != 0:
        skip_or_fail("hosts are network namespaces: run the test as root")
    require_tool("ip", "iproute2")
    require_tool("tc", "iproute2")
    with hosts_on_a_switch(SAMPLERS + 1, 1000) as made:
        yield made


def _pull_all(samplers: list[Child], version: int) -> list[dict]:
    for child in samplers:
        child.send(f"pull {version}")
    return [child.answer(timeout=90) for child in samplers]


def test_eight_samplers_take_each_version_through_a_chain_of_relays(switch) -> None:
    trainer_host, *hosts = switch.hosts
    name = run_name("fan")
    children: list[Child] = []
    with RegistryServer(
        MemoryRegistry(), host=switch.address, secret=SECRET, insecure=True
    ) as registry:
        try:
            trainer = Child(
                ["fanouttrainer", name, registry.address, trainer_host.address, str(MIB)],
                ENV,
                host=trainer_host,
            )
            children.append(trainer)
            for k, host in enumerate(hosts):
                upstream = "-" if k == 0 else f"{hosts[k - 1].address}:7400"
                args = ["fanoutsampler", name, registry.address, host.address, upstream, str(MIB)]
                children.append(Child(args, ENV, host=host))
            samplers = children[1:]
            for child in children:
                assert child.answer(timeout=120)["ready"]

            # every sampler takes version 1 from its relay; the trainer sends it about once
            sent = trainer_host.sent_bytes()
            assert trainer.ask("publish 1", timeout=60)["published"] == 1
            answers = _pull_all(samplers, 1)
            assert all(a.get("exact") for a in answers), answers
            assert all(a["relayed"] > 0 and a["direct"] == 0 for a in answers), answers
            trainer_sent = trainer_host.sent_bytes() - sent
            assert trainer_sent <= 1.5 * (MIB << 20), (trainer_sent, [a["relay"] for a in answers])

            # the fourth sampler and its relay are killed while the chain serves version 2
            assert trainer.ask("publish 2", timeout=60)["published"] == 2
            for child in samplers:
                child.send("pull 2")
            first = samplers[0].answer(timeout=90)
            samplers[3].kill()
            rest = [c.answer(timeout=90) for c in samplers[1:3] + samplers[4:]]
            assert all(a.get("exact") for a in [first, *rest]), [first, *rest]

            # the second relay damages every chunk it holds: those below it retry elsewhere
            alive = samplers[:3] + samplers[4:]
            assert samplers[1].ask("flip")["flipping"]
            assert trainer.ask("publish 3", timeout=60)["published"] == 3
            answers = _pull_all(alive, 3)
            assert all(a.get("exact") for a in answers), answers
            # the relay below the damaging one found its chunks damaged and took them from
            # the trainer instead
            assert answers[2]["relay"]["chunks_publisher"] > 0, answers
        finally:
            for child in children:
                with contextlib.suppress(Exception):
                    child.stop()
