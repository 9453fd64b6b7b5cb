"""A trainer of several ``jax.distributed`` processes (2 x 4 and 4 x 2 CPU devices, one global
array per leaf, each process holding only its shards) publishes each version from every
process without gathering; a sampler in another process (this one, 8 devices) pulls it into its
own meshes bit for bit, each box from the process holding it; a trainer process killed
mid-publish leaves nothing visible and the sampler on its version. A sampler of two processes
(a 2x4 mesh over both) pulls from a trainer of two, each its own shards, and commits every
version all or none: a process failing, pulling another version or killed mid-pull leaves both
on the last. The
trainer's and sampler's processes are tpusync._src.testing.weights_procs children. A
manifest naming processes it cannot tell apart or reach is refused, and the first process
checks every part before it commits."""

from __future__ import annotations

import contextlib
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from run_names import run_name

from tpusync._src.testing.weights_procs import (
    Child,
    leaf_bytes,
    np_dtype,
    stop_together,
    tree_spec,
)
from tpusync._src.tiers.dram.shm_admin import remove_pool
from tpusync._src.weights.manifest import LeafEntry, Manifest, structure_digest
from tpusync.cluster import MemoryRegistry, RegistryServer, RemoteRegistry
from tpusync.errors import VersionUnavailableError, WeightSyncError
from tpusync.weights import Publisher, Subscriber, WeightsClientOptions

SECRET = secrets.token_bytes(32)
LEAVES = 24


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Trainer:
    """``count`` trainer processes of one jax.distributed job."""

    def __init__(self, registry: str, count: int) -> None:
        self.name, self.count = run_name("mc"), count
        coordinator = f"127.0.0.1:{_free_port()}"
        self.children = [
            Child(
                ["multitrainer", self.name, registry, coordinator, str(i), str(count), str(LEAVES)],
                {"TPUSYNC_TEST_SECRET": SECRET.hex()},
            )
            for i in range(count)
        ]
        for child in self.children:
            assert child.answer(timeout=120)["ready"]

    def publish(self, version: int) -> list[dict[str, Any]]:
        for child in self.children:
            child.send(f"publish {version}")
        return [child.answer(timeout=120) for child in self.children]

    def close(self) -> None:
        stop_together(self.children)
        for i in range(self.count):
            with contextlib.suppress(Exception):
                remove_pool(f"weights-{self.name}-p{i}", force=True)


def _expected(version: int) -> dict[str, np.ndarray]:
    return {
        path: np.frombuffer(leaf_bytes(0, version, i, shape, dtype), np_dtype(dtype)).reshape(shape)
        for i, (path, shape, dtype) in enumerate(tree_spec(LEAVES))
    }


def _target(mesh_shape: tuple[int, int]) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("x", "y"))
    return {
        path: jax.ShapeDtypeStruct(
            shape,
            np_dtype(dtype),
            sharding=NamedSharding(mesh, P("y", "x") if len(shape) == 2 else P("x")),
        )
        for path, shape, dtype in tree_spec(LEAVES)
    }


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    with RegistryServer(MemoryRegistry(), secret=SECRET) as server:
        yield server


@pytest.mark.parametrize("count", [2, 4])
def test_every_process_publishes_its_shards_and_a_sampler_pulls_them_all(registry, count) -> None:
    trainer = Trainer(registry.address, count)
    client = RemoteRegistry(registry.address, secret=SECRET)
    try:
        answers = trainer.publish(1)
        assert all(a.get("published") == 1 for a in answers), answers
        # each process staged only its own boxes: together the version once
        assert sum(a["nbytes"] for a in answers) == sum(x.nbytes for x in _expected(1).values())
        assert all(a["nbytes"] > 0 for a in answers)
        options = WeightsClientOptions(timeout_s=5.0, deadline_s=60.0)
        # the versions each sampler mesh pulls (version 2 published by the first's turn)
        for mesh, versions in (((2, 4), (1, 2)), ((1, 8), (1,)), ((4, 2), (2,))):
            with Subscriber(
                trainer.name, _target(mesh), secret=SECRET, registry=client, client=options
            ) as sub:
                for version in versions:
                    if version == 2 and mesh == (2, 4):
                        assert all(a.get("published") == 2 for a in trainer.publish(2))
                    got = sub.update(version)
                    for path, want in _expected(version).items():
                        assert np.asarray(got[path]).tobytes() == want.tobytes(), (mesh, path)
                        assert got[path].sharding == _target(mesh)[path].sharding
    finally:
        client.close()
        trainer.close()


def test_a_trainer_process_killed_mid_publish_leaves_nothing_visible(registry) -> None:
    trainer = Trainer(registry.address, 2)
    client = RemoteRegistry(registry.address, secret=SECRET)
    options = WeightsClientOptions(timeout_s=5.0, deadline_s=60.0)
    try:
        assert all(a.get("published") == 1 for a in trainer.publish(1))
        with Subscriber(
            trainer.name, _target((2, 4)), secret=SECRET, registry=client, client=options
        ) as sub:
            sub.update(1)
            trainer.children[1].kill()  # the second process dies before it publishes 2
            trainer.children[0].send("publish 2")
            answer = trainer.children[0].answer(timeout=120)  # the first gives up on its part
            assert answer.get("error") == "WeightSyncError" and "process 1" in answer["message"]
            with pytest.raises((VersionUnavailableError, WeightSyncError)):
                sub.pull(2)
            assert sub.version == 1
            for path, want in _expected(1).items():
                assert np.asarray(sub.params[path]).tobytes() == want.tobytes()
        trainer.children[0].kill()  # its shutdown would wait for the killed process
    finally:
        client.close()
        trainer.close()


class Sampler:
    """``count`` sampler processes of one jax.distributed job, pulling ``name``."""

    def __init__(self, name: str, registry: str, count: int) -> None:
        coordinator = f"127.0.0.1:{_free_port()}"
        self.children = [
            Child(
                ["multisampler", name, registry, coordinator, str(i), str(count), str(LEAVES)],
                {"TPUSYNC_TEST_SECRET": SECRET.hex()},
            )
            for i in range(count)
        ]
        for child in self.children:
            assert child.answer(timeout=120)["ready"]

    def each(self, *commands: str) -> list[dict[str, Any]]:
        """Sends each child its command (one for all when one is given); their answers."""
        commands = commands * len(self.children) if len(commands) == 1 else commands
        for child, command in zip(self.children, commands, strict=True):
            child.send(command)
        return [child.answer(timeout=60) for child in self.children]

    def pull(self, *commands: str) -> list[dict[str, Any]]:
        assert all("pulling" in a for a in self.each(*commands))
        return [child.answer(timeout=60) for child in self.children]

    def close(self) -> None:
        stop_together(self.children)


def test_a_sampler_of_two_processes_commits_every_version_all_or_none(registry) -> None:
    """Both sides multi-controller: a trainer of two processes publishes, a sampler of two
    (a 2x4 mesh over both) pulls each process's own shards."""
    trainer = Trainer(registry.address, 2)
    sampler = Sampler(trainer.name, registry.address, 2)

    def publish(version: int) -> None:
        assert all(a.get("published") == version for a in trainer.publish(version))

    try:
        publish(1)
        assert sampler.each("latest") == [{"latest": 1}] * 2
        for version in (1, 2):
            if version == 2:  # both wait for it and are told the same version
                for child in sampler.children:
                    child.send("wait 1 60")
                publish(2)
                assert [c.answer(timeout=90) for c in sampler.children] == [{"newer": 2}] * 2
            pulled = sampler.pull(f"pull {version}")
            assert [a.get("pulled") for a in pulled] == [version] * 2, pulled
            assert all(a["nbytes"] > 0 for a in pulled)  # each its own shards
            assert sampler.each("commit") == [{"committed": version}] * 2
            assert sampler.each(f"check {version}") == [{"version": version, "exact": True}] * 2

        publish(3)
        # process 1 misses its deadline: neither commits version 3
        answers = sampler.pull("pull 3", "pull 3 0 0.000001")
        assert [a.get("error") for a in answers] == ["WeightSyncError"] * 2, answers
        assert "process 1" in answers[0]["message"] and "none of them" in answers[0]["message"]
        # the two pull different versions: neither commits either
        publish(4)
        answers = sampler.pull("pull 4", "pull 3")
        assert [a.get("error") for a in answers] == ["WeightSyncError"] * 2, answers
        assert "pulled version" in answers[0]["message"]
        assert sampler.each("commit")[0].get("error") == "InvalidArgumentError"  # nothing to
        assert sampler.each("check 2") == [{"version": 2, "exact": True}] * 2
    finally:
        sampler.close()
        trainer.close()


def test_a_sampler_process_killed_mid_pull_leaves_the_other_on_its_version(registry) -> None:
    trainer = Trainer(registry.address, 2)
    sampler = Sampler(trainer.name, registry.address, 2)
    try:
        for version in (1, 2):
            assert all(a.get("published") == version for a in trainer.publish(version))
        assert [a.get("pulled") for a in sampler.pull("pull 1")] == [1, 1]
        assert sampler.each("commit") == [{"committed": 1}] * 2
        # process 1 is killed before its part lands: process 0 gives up on it at its deadline
        for child, command in zip(sampler.children, ("pull 2", "pull 2 30"), strict=True):
            child.send(command)
        assert [c.answer(timeout=60) for c in sampler.children] == [{"pulling": 2}] * 2
        sampler.children[1].kill()
        answer = sampler.children[0].answer(timeout=60)
        assert answer.get("error") == "WeightSyncError" and "process 1" in answer["message"]
        assert sampler.children[0].ask("check 1") == {"version": 1, "exact": True}
        sampler.children[0].kill()  # its shutdown would wait for the killed process
    finally:
        sampler.close()
        trainer.close()


def _parts_manifest(addresses: list[str]) -> bytes:
    boxes = (((0, 4), (0, 4)), ((4, 8), (0, 4)))
    leaf = LeafEntry("[0]", (8, 4), "float32", boxes, (0, 0), parts=(0, len(addresses)))
    parts = tuple((a, np.zeros(1, np.uint64)) for a in addresses)
    manifest = Manifest("w", 1, None, 4096, 64, (leaf,), np.zeros(1, np.uint64), {"l": [0]},
                        parts=parts)  # fmt: skip
    return manifest.to_bytes()


@pytest.mark.parametrize(
    "addresses",
    [
        ["127.0.0.1:7200", "127.0.0.1:7200"],  # two processes at one address
        ["0.0.0.0:7200"],  # no address to reach
        ["127.0.0.1:0"],
        ["127.0.0.1:99999"],
        ["host name:7200"],
        ["127.0.0.1"],
    ],
)
def test_a_manifest_whose_processes_cannot_be_told_apart_or_reached_is_refused(addresses) -> None:
    parsed = Manifest.from_bytes(_parts_manifest(["127.0.0.1:7201"]), name="w", version=1)
    assert [s[2] for s in parsed.streams] == [None, "127.0.0.1:7201"]
    with pytest.raises(WeightSyncError, match="malformed"):
        Manifest.from_bytes(_parts_manifest(addresses), name="w", version=1)


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"error": "TierFullError('no room')"}, "process 1 failed to stage its part"),
        ({"digest": "0" * 32, "chunk_bytes": 4096}, "another tree or chunk size"),
        ({"offsets": []}, "1 of its boxes are missing"),
        ({"offsets": [[0, 1, 0], [0, 1, 0]]}, "twice"),
        ({"offsets": [[0, 0, 0]]}, "not process 1's"),
    ],
)
def test_the_first_process_checks_every_part(shm_names, part, match) -> None:
    """A part another process shares is checked before the version is committed: an error it
    met, another tree, a box missing, twice or not its own."""
    box = ((0, 4), (0, 4))
    entries = [LeafEntry("[0]", (8, 4), "float32", (box, ((4, 8), (0, 4))), (0, 0), parts=(0, 1))]
    with Publisher(shm_names(), secret=SECRET) as pub:
        whole = {
            "address": "127.0.0.1:7201",
            "checksums": "00" * 8,
            "digest": structure_digest([("[0]", (8, 4), "float32")]),
            "chunk_bytes": pub.pool_options.chunk_bytes,
            "offsets": [[0, 1, 0]],
        }
        merged = pub._merged(1, None, 64, entries, np.zeros(1, np.uint64), None, [whole])
        assert merged.leaves[0].offsets == (0, 0) and merged.parts[0][0] == "127.0.0.1:7201"
        with pytest.raises(WeightSyncError, match=match):
            pub._merged(1, None, 64, entries, np.zeros(1, np.uint64), None, [{**whole, **part}])
