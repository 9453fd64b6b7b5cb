"""TpuSyncHiCacheStorage across processes and through SGLang's own cache controller: two SGLang
processes sharing pages through a store node (a real ``tpusync serve`` process), and the
controller's real backup and prefetch code (``HiCacheController._page_backup`` /
``_page_transfer``, batches of 128 pages) driving the backend, a prefetch that times out
included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.srt.managers.cache_controller import (
    PrefetchOperation,
    StorageOperation,
)

from tests.sglang.conftest import host_pool, indices, keys, page_bytes
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync._src.testing.sglang_controller import controller as make_controller

ROOT = Path(__file__).resolve().parents[2]


def test_two_sglang_processes_share_pages_through_a_store_node(backends, tmp_path):
    node, ready = start_store_node(tmp_path, os.urandom(32), 64 << 20)
    try:
        extra = {
            "dram": {"capacity_blocks": 16},
            "store_node": {"address": ready["address"], "timeout_s": 5.0},
            "secret_file": str(tmp_path / "secret"),
        }
        pool = host_pool("mha", "page_first")
        backend = backends(pool, "mha", extra)
        names = keys(6)
        expected = [page_bytes(pool, p).hex() for p in range(6)]
        assert backend.batch_set_v1(names, indices(list(range(6)), 4)) == [True] * 6
        assert backend.store.flush(30)  # written back to the node
        child = subprocess.run(
            [sys.executable, "-m", "tests.sglang.page_child", json.dumps(extra),
             json.dumps([*names, keys(1)[0]])],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        assert child.returncode == 0, child.stderr[-3000:]
        answer = json.loads(child.stdout.strip().splitlines()[-1])
        assert answer["held"] == 6
        assert answer["loaded"] == expected
        # another secret: the engine does not start, saying why (and is served no byte)
        (tmp_path / "other").write_text(os.urandom(32).hex())
        (tmp_path / "other").chmod(0o600)  # a secret file only its user may read
        wrong = {**extra, "secret_file": str(tmp_path / "other")}
        child = subprocess.run(
            [sys.executable, "-m", "tests.sglang.page_child", json.dumps(wrong), json.dumps(names)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        assert child.returncode != 0 and not child.stdout.strip()
        assert "rejected this client's secret" in child.stderr
    finally:
        stop_process(node)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["v1", "generic"])
def test_sglangs_controller_backs_up_and_prefetches_in_batches(backends, zero_copy):
    pool = host_pool("mha", "page_head", device_tokens=1024)
    backend = backends(pool, "mha", {"dram": {"capacity_blocks": 512}})
    controller = make_controller(backend, pool, zero_copy=zero_copy)
    n, ps = 200, pool.page_size  # two of the controller's batches (128 pages each)
    names = keys(n)
    source = list(range(0, n))
    expected = [page_bytes(pool, p) for p in source]
    backup = StorageOperation(indices(source, ps), list(range(n * ps)), hash_value=names)
    controller._page_backup(backup)
    assert backup.completed_tokens == n * ps
    target = list(range(n + 10, 2 * n + 10))
    prefetch = PrefetchOperation("req-1", list(range(n * ps)))
    prefetch.hash_value, prefetch.host_indices = names, indices(target, ps)
    assert controller._page_transfer(prefetch) == n
    acks = [controller.prefetch_sync_queue.get_nowait() for _ in range(2)]
    assert [a.completed_tokens for a in acks] == [128 * ps, n * ps]
    assert [page_bytes(pool, p) for p in target] == expected
    assert backend.stats()["store"]["open_handles"] == 0


def test_a_prefetch_that_times_out_stops_after_its_batch_and_holds_nothing(backends):
    """SGLang's controller marks a prefetch terminated when its deadline passes; the transfer
    stops before its next batch. What was loaded stays; nothing stays pinned in the store."""
    pool = host_pool("mha", "page_first", device_tokens=1024)
    backend = backends(pool, "mha", {"dram": {"capacity_blocks": 512}})
    controller = make_controller(backend, pool, zero_copy=True)
    n, ps = 256, pool.page_size
    names = keys(n)
    backup = StorageOperation(indices(list(range(n)), ps), [], hash_value=names)
    controller._page_backup(backup)
    assert backup.completed_tokens == n * ps
    prefetch = PrefetchOperation("req-2", [])
    target = list(range(n, 2 * n))
    prefetch.hash_value, prefetch.host_indices = names, indices(target, ps)
    untouched = page_bytes(pool, target[200])
    first_batch = backend.batch_get_v1

    def deadline_after_the_first_batch(*args, **kwargs):
        got = first_batch(*args, **kwargs)
        prefetch.mark_terminate()  # what SGLang's timeout check does meanwhile
        return got

    backend.batch_get_v1 = deadline_after_the_first_batch
    assert controller._page_transfer(prefetch) == 128
    assert page_bytes(pool, target[200]) == untouched
    assert page_bytes(pool, target[5]) == page_bytes(pool, 5)
    stats = backend.stats()["store"]
    assert stats["open_handles"] == 0 and stats["loaded_blocks"] == 128
