"""The public conformance suites (tpusync.testing.conformance) over the tiers and registry
backends tpusync ships: the DRAM, disk and shared-FS tiers, and the memory, remote (TCP) and
Redis registries."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_registry import free_port, start_redis, stop

from tpusync.cluster import MemoryRegistry, RedisRegistry, RegistryServer, RemoteRegistry
from tpusync.testing import conformance
from tpusync.testing.conformance import RegistryConformance, TierConformance
from tpusync.tiers import DiskPool, HostPool, PoolLayout, SharedFsPool

SECRET = b"conformance-secret-0123456789abc"


class TestDramTier(TierConformance):
    """A HostPool is a lower tier slot to slot."""

    def open_tier(self, layout: PoolLayout) -> Any:
        return HostPool(layout, 16, populate=False)


class TestDiskTier(TierConformance):
    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        self.directory = tmp_path

    def open_tier(self, layout: PoolLayout) -> Any:
        directory = self.directory / uuid.uuid4().hex[:8]
        directory.mkdir(mode=0o700)
        return DiskPool(layout, 16, directory, slab_slots=4)


class TestSharedFsTier(TierConformance):
    seed = 7

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        self.directory = tmp_path

    def open_tier(self, layout: PoolLayout) -> Any:
        directory = self.directory / uuid.uuid4().hex[:8]
        directory.mkdir(mode=0o700)
        return SharedFsPool(layout, directory, io_threads=2)


def test_check_tier_runs_every_case_through_a_factory(tmp_path: Path) -> None:
    """The function form: one call runs every case, each on a fresh tier."""
    opened: list[Any] = []

    def open_tier(layout: PoolLayout) -> Any:
        directory = tmp_path / f"t{len(opened)}"
        directory.mkdir(mode=0o700)
        opened.append(DiskPool(layout, 16, directory))
        return opened[-1]

    conformance.check_tier(open_tier, seed=3)
    assert len(opened) == len(conformance.TIER_CASES)


def test_a_tier_that_breaks_the_contract_fails_the_suite() -> None:
    """A tier whose get serves nothing does not pass."""

    class Forgetful:
        def __init__(self, layout: PoolLayout) -> None:
            self.inner = HostPool(layout, 16, populate=False)
            self.layout, self.stats = layout, self.inner.stats

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def get(self, keys: Any, target: HostPool) -> None:
            return None  # neither loads nor reports the misses

    with pytest.raises(AssertionError):
        conformance.tier_round_trip(Forgetful)


class TestMemoryRegistry(RegistryConformance):
    def make_registry(self) -> Any:
        return MemoryRegistry()


class TestRemoteRegistry(RegistryConformance):
    @pytest.fixture(autouse=True)
    def _server(self) -> Iterator[None]:
        self.server = RegistryServer(MemoryRegistry(), secret=SECRET)
        try:
            yield
        finally:
            self.server.close()

    def make_registry(self) -> Any:
        return RemoteRegistry(self.server.address, secret=SECRET)


@pytest.fixture(scope="module")
def redis_server_url() -> Iterator[str]:
    port = free_port()
    proc = start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)


class TestRedisRegistry(RegistryConformance):
    @pytest.fixture(autouse=True)
    def _url(self, redis_server_url: str) -> None:
        self.url = redis_server_url

    def make_registry(self) -> Any:
        return RedisRegistry(self.url, prefix=f"c{uuid.uuid4().hex[:10]}")
