"""The public conformance suites (tpusync.testing.conformance) over the tiers and registry
backends tpusync ships: the DRAM, disk and shared-FS tiers, and the memory, remote (TCP) and
Redis registries, and JaxRegistry on the real coordination service of a ``jax.distributed`` job
(in a child process, tests/helpers/registry_jax_conformance_child.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paths import HELPERS
from registry_jax_conformance_child import KV_SCRIPT, run_kv_script
from registry_servers import FakeCoordinationClient, free_port, start_redis, stop

from tpusync._src.testing import conformance  # its single cases too, beyond the public suite
from tpusync._src.testing.conformance import RegistryConformance, TierConformance
from tpusync.cluster import MemoryRegistry, RedisRegistry, RegistryServer, RemoteRegistry
from tpusync.tiers import DiskPool, HostPool, PoolLayout, SharedFsPool

SECRET = b"conformance-secret-0123456789abc"
CHILD_DEADLINE_S = 25.0  # the child takes a few seconds; a hung one is stopped by pid


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


# -- JaxRegistry on a real coordination service --------------------------------------------------


@pytest.fixture(scope="module")
def real_service(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What tests/helpers/registry_jax_conformance_child.py reported from a real 1-process
    ``jax.distributed`` job: ``cases`` (case name -> result) and ``kv_script``."""
    folder = tmp_path_factory.mktemp("jax-conformance")
    out, err = folder / "child.out", folder / "child.err"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # the 8 fake devices are the test process's, not the child's
    child = HELPERS / "registry_jax_conformance_child.py"
    with out.open("w") as fout, err.open("w") as ferr:
        proc = subprocess.Popen(
            [sys.executable, str(child), str(free_port())], stdout=fout, stderr=ferr, env=env
        )
    start = time.monotonic()
    try:
        code = proc.wait(timeout=CHILD_DEADLINE_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop(proc)
    log = err.read_text()[-3000:]
    assert code == 0, f"the child failed ({code}) after {time.monotonic() - start:.1f} s:\n{log}"
    results = [
        json.loads(line.removeprefix("RESULT "))
        for line in out.read_text().splitlines()
        if line.startswith("RESULT ")
    ]
    cases = {r["case"]: r for r in results if "case" in r}
    scripts = [r["kv_script"] for r in results if "kv_script" in r]
    assert len(scripts) == 1, f"the child reported no key-value script:\n{log}"
    return {"cases": cases, "kv_script": scripts[0]}


class TestJaxRegistryOnTheRealService:
    """Every registry case against JaxRegistry on a real coordination service (not the fake
    client of tests/cluster/test_registry.py), and the fake checked against that service."""

    @pytest.mark.parametrize("case", [c.__name__ for c in conformance.REGISTRY_CASES])
    def test_case(self, real_service: dict[str, Any], case: str) -> None:
        result = real_service["cases"].get(case)
        assert result is not None, f"{case} did not run in the child"
        assert result["ok"], f"{case} failed on the real service:\n{result['error']}"

    def test_every_case_ran(self, real_service: dict[str, Any]) -> None:
        assert sorted(real_service["cases"]) == sorted(
            c.__name__ for c in conformance.REGISTRY_CASES
        )

    def test_fake_client_answers_as_the_real_service(self, real_service: dict[str, Any]) -> None:
        """The same key-value calls on the fake: the same values, and the same errors (type and
        first line, e.g. ``NOT_FOUND: Config key ... not found.``, which JaxRegistry reads as
        "no such node"; the gRPC details after it vary in order, so they are not compared)."""

        def first_lines(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [
                {k: v.splitlines()[0] if k == "message" else v for k, v in answer.items()}
                for answer in answers
            ]

        real = real_service["kv_script"]
        fake = json.loads(json.dumps(run_kv_script(FakeCoordinationClient())))
        assert len(real) == len(fake) == len(KV_SCRIPT)
        for (call, args), want, got in zip(
            KV_SCRIPT, first_lines(real), first_lines(fake), strict=True
        ):
            assert got == want, f"{call}{args}: the fake answered {got}, the service {want}"
        assert real[0]["message"].startswith("NOT_FOUND: ")  # what JaxRegistry._record tests
