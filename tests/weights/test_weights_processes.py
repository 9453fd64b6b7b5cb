"""Weight sync across real processes: a trainer (8 CPU devices, mesh 8x1) publishes versions of
~100 leaves of mixed shapes and dtypes; samplers in other processes (meshes 2x4, 4x2, 1x8)
pull each into their own layout through a registry server, bit for bit, while a toy step loop
stamps every step with the versions of the leaves it read: never two in one step, across a
SIGKILL of the trainer mid-publish, a registry restart and a late joiner asking for an older
kept version; a follower told only the registry and the name finds and follows every version,
a tree that gained a leaf included. The children are tpusync._src.testing.weights_procs."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from run_names import run_name

from tpusync._src.testing.weights_procs import Child, digest, leaf_bytes, tree_spec
from tpusync._src.tiers.dram.shm_admin import remove_pool
from tpusync.cluster import MemoryRegistry, RegistryServer

SECRET = secrets.token_bytes(32)
LEAVES = 100
MESHES = ("2x4", "4x2", "1x8")


def expected(version: int, leaves: int = LEAVES) -> dict[str, str]:
    return {
        path: digest(leaf_bytes(0, version, i, shape, dtype))
        for i, (path, shape, dtype) in enumerate(tree_spec(leaves))
    }


class Cluster:
    def __init__(self) -> None:
        self.name = run_name("w")
        self.registry = RegistryServer(MemoryRegistry(), secret=SECRET)
        self.children: list[Child] = []
        self.latest: int | None = None  # the last version published
        self.trainer = self.start("trainer", self.name, self.registry.address, str(LEAVES))
        self.samplers = {
            mesh: self.start("sampler", self.name, self.registry.address, mesh, str(LEAVES))
            for mesh in MESHES
        }
        for child in [self.trainer, *self.samplers.values()]:
            assert child.answer(timeout=120)["ready"]

    def start(self, *args: str) -> Child:
        child = Child(list(args), {"TPUSYNC_TEST_SECRET": SECRET.hex()})
        self.children.append(child)
        return child

    def publish(self, version: int) -> dict[str, Any]:
        answer = self.trainer.ask(f"publish {version}")
        assert answer["published"] == version, answer
        self.latest = version
        return answer

    def pull_everywhere(self, version: int) -> None:
        for sampler in self.samplers.values():
            sampler.send(f"pull {version}")
        want = expected(version)
        for mesh, sampler in self.samplers.items():
            answer = sampler.answer()
            assert answer.get("version") == version, (mesh, answer)
            assert answer["shardings_ok"], mesh
            assert answer["digests"] == want, f"{mesh}: leaves differ from the trainer's"
            assert answer["local"] > 0 and answer["network"] == 0  # same host: /dev/shm

    def close(self) -> None:
        for child in self.children:
            child.stop()
        self.registry.close()
        with contextlib.suppress(Exception):
            remove_pool(f"weights-{self.name}", force=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    try:
        yield made
    finally:
        made.close()


def test_every_sampler_mesh_gets_each_version_bit_for_bit(cluster):
    for version in (1, 2):
        cluster.publish(version)
        cluster.pull_everywhere(version)
    for sampler in cluster.samplers.values():
        assert sampler.ask("loop")["looping"]
    cluster.publish(3)
    cluster.pull_everywhere(3)


def test_a_trainer_killed_mid_publish_leaves_every_sampler_on_its_version(cluster):
    cluster.publish(4)
    cluster.pull_everywhere(4)
    assert cluster.trainer.ask("stall 5")["stalled"] == 5  # chunks staged, no manifest
    cluster.trainer.kill()
    for mesh, sampler in cluster.samplers.items():
        answer = sampler.ask("pull 5")
        assert answer.get("error") in ("VersionUnavailableError", "WeightSyncError"), answer
        assert answer["committed"] == 4, mesh
    cluster.trainer = cluster.start("trainer", cluster.name, cluster.registry.address, str(LEAVES))
    assert cluster.trainer.answer(timeout=120)["ready"]  # re-attaches the pool the dead one left
    cluster.publish(6)
    cluster.pull_everywhere(6)


def test_a_registry_restart_and_a_late_joiner(cluster):
    port = int(cluster.registry.address.rsplit(":", 1)[1])
    cluster.registry.close()
    cluster.registry = RegistryServer(MemoryRegistry(), secret=SECRET, port=port)
    cluster.publish(7)
    # the trainer's registry link registers again at its next heartbeat
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        answer = cluster.samplers["2x4"].ask("pull 7")
        if answer.get("version") == 7:
            break
        assert answer["committed"] == 6
        time.sleep(0.5)
    assert answer.get("version") == 7 and answer["digests"] == expected(7)
    for mesh in ("4x2", "1x8"):
        assert cluster.samplers[mesh].ask("pull 7")["digests"] == expected(7)
    cluster.publish(8)  # keeps 7 and 8
    late = cluster.start("sampler", cluster.name, cluster.registry.address, "4x2", str(LEAVES))
    assert late.answer(timeout=120)["ready"]
    assert late.ask("pull 7")["digests"] == expected(7)  # an older kept version
    assert late.ask("pull 8")["digests"] == expected(8)
    for mesh, sampler in cluster.samplers.items():
        stamps = sampler.ask("stamps")
        assert stamps["mixed"] == 0, f"{mesh}: a step read two versions"
        assert stamps["one"] > 0 and {3, 4, 6, 7} <= set(stamps["seen"]), (mesh, stamps)


def test_a_follower_told_only_the_registry_follows_every_version(cluster):
    follower = cluster.start("follower", cluster.name, cluster.registry.address, "4x2")
    assert follower.answer(timeout=120)["ready"]
    if cluster.latest is None:  # run alone: a first version to find
        cluster.publish(1)
    newest = cluster.latest
    assert newest is not None
    first = follower.answer(timeout=120)  # the newest kept, found by itself
    assert first.get("version") == newest and first["digests"] == expected(newest), first
    for version in (newest + 1, newest + 2):
        cluster.publish(version)
        got = follower.answer(timeout=120)
        assert got.get("version") == version and got["digests"] == expected(version), got
    grown = newest + 3
    assert cluster.trainer.ask(f"grow {grown}")["published"] == grown  # the tree gains a leaf
    got = follower.answer(timeout=120)
    assert got.get("version") == grown and got["leaves"] == LEAVES + 1, got
    assert got["digests"] == expected(grown, LEAVES + 1)
