"""TpuSyncHiCacheStorage against SGLang 0.5.23's real host pools and storage factory on CPU:
byte-exact round trips through the zero-copy (v1) and the generic paths in every host layout,
MHA and MLA; prefix semantics of batch_exists; damaged pages; bad configurations."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.sglang.conftest import CASES, Case, host_pool, indices, keys, page_bytes, randomize
from tpusync._src.testing.file_fuzz import damage_disk_block
from tpusync._src.tiers.dram import pool_path, sessions_path
from tpusync.errors import InvalidArgumentError
from tpusync.kv import KVCacheStore

IDS = [f"{c.kind}-{c.layout}" for c in CASES]
FLAT_CASES = [c for c in CASES if c.layout != "page_unified"]  # SGLang has no flat page there


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_v1_pages_round_trip_byte_exact(backends, case: Case):
    pool = host_pool(case.kind, case.layout)
    backend = backends(pool, case.kind)
    assert isinstance(backend.store, KVCacheStore)
    assert set(backend.store.dram._mover._kept.plans) == {True, False}  # planned at registration
    source = [3, 7, 1, 12, 5]
    target = [20, 21, 30, 9, 40]
    names = keys(len(source))
    expected = [page_bytes(pool, p) for p in source]
    assert backend.batch_set_v1(names, indices(source, pool.page_size)) == [True] * 5
    before = [page_bytes(pool, p) for p in target]
    assert all(b != e for b, e in zip(before, expected, strict=True))
    assert backend.batch_get_v1(names, indices(target, pool.page_size)) == [True] * 5
    assert [page_bytes(pool, p) for p in target] == expected
    assert backend.stats()["store"]["loaded_blocks"] == 5


@pytest.mark.parametrize("case", FLAT_CASES, ids=[f"{c.kind}-{c.layout}" for c in FLAT_CASES])
def test_generic_pages_round_trip_and_match_the_v1_pages(backends, case: Case):
    pool = host_pool(case.kind, case.layout)
    backend = backends(pool, case.kind)
    ps = pool.page_size
    names = keys(3)
    values = [pool.get_data_page(p * ps, flat=True) for p in (2, 4, 6)]
    expected = [page_bytes(pool, p) for p in (2, 4, 6)]
    assert backend.batch_set(names, values)
    # the generic path's flat pages are the v1 path's pages: read them back into the pool
    assert backend.batch_get_v1(names, indices([10, 11, 12], ps)) == [True] * 3
    assert [page_bytes(pool, p) for p in (10, 11, 12)] == expected
    # and through the generic path, into SGLang's dummy pages, then set into the pool
    targets = [pool.get_dummy_flat_data_page() for _ in names]
    got = backend.batch_get(names, targets)
    for page, flat in zip((13, 14, 15), got, strict=True):
        assert flat is not None
        pool.set_from_flat_data_page(page * ps, flat)
    assert [page_bytes(pool, p) for p in (13, 14, 15)] == expected
    # single keys, and a value v1 stored read through the generic path
    assert backend.set(names[0], values[0]) and backend.exists(names[0])
    other = keys(1)
    assert backend.batch_set_v1(other, indices([1], ps)) == [True]
    flat = backend.get(other[0])
    assert flat.contiguous().view(torch.uint8).numpy().tobytes() == page_bytes(pool, 1)
    assert backend.get(keys(1)[0]) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])  # fmt: skip
def test_every_kv_dtype_round_trips(backends, dtype):
    pool = host_pool("mha", "page_first", dtype=dtype)
    backend = backends(pool, "mha")
    names = keys(4)
    expected = [page_bytes(pool, p) for p in range(4)]
    assert backend.batch_set_v1(names, indices(list(range(4)), 4)) == [True] * 4
    assert backend.batch_get_v1(names, indices([8, 9, 10, 11], 4)) == [True] * 4
    assert [page_bytes(pool, p) for p in (8, 9, 10, 11)] == expected


def test_batch_exists_counts_the_leading_pages_held(backends):
    pool = host_pool("mha", "page_first")
    backend = backends(pool, "mha")
    held = keys(4)
    assert backend.batch_set_v1(held, indices([0, 1, 2, 3], 4)) == [True] * 4
    missing = keys(1)
    assert backend.batch_exists(held) == 4
    assert backend.batch_exists([*held[:2], *missing, *held[2:]]) == 2
    assert backend.batch_exists([*missing, *held]) == 0
    assert backend.batch_exists([]) == 0
    # a get past a missing page loads only the leading run, and says so page by page
    before = page_bytes(pool, 22)
    got = backend.batch_get_v1([*held[:2], *missing, held[2]], indices([20, 21, 22, 23], 4))
    assert got == [True, True, False, False]
    assert page_bytes(pool, 22) == before
    stats = backend.stats()
    assert stats["store"]["lookups"] >= 4


def test_pages_stored_again_are_skipped_and_count_as_stored(backends):
    pool = host_pool("mha", "page_head")
    backend = backends(pool, "mha")
    names = keys(3)
    assert backend.batch_set_v1(names, indices([0, 1, 2], 4)) == [True] * 3
    assert backend.batch_set_v1(names, indices([5, 6, 7], 4)) == [True] * 3
    assert backend.stats()["store"]["saved_blocks"] == 3


def test_a_damaged_page_on_disk_is_a_miss_never_a_wrong_byte(backends, tmp_path):
    disk = tmp_path / "disk"
    extra = {"dram": {"capacity_blocks": 8},
             "disk": {"directory": str(disk), "capacity_blocks": 64, "create": True}}  # fmt: skip
    pool = host_pool("mha", "layer_first")
    backend = backends(pool, "mha", extra)
    names = keys(6)
    expected = [page_bytes(pool, p) for p in range(6)]
    assert backend.batch_set_v1(names, indices(list(range(6)), 4)) == [True] * 6
    assert backend.store.flush(30)
    backend.close()
    # a new engine: DRAM empty, the pages on disk, one of them damaged
    damage_disk_block(disk)
    fresh = host_pool("mha", "layer_first")
    second = backends(fresh, "mha", extra)
    assert second.batch_exists(names) == 6  # the index holds them; the bytes are checked on load
    got = second.batch_get_v1(names, indices([30, 31, 32, 33, 34, 35], 4))
    n = got.index(False)
    assert 0 < n < 6 and got == [True] * n + [False] * (6 - n)
    assert [page_bytes(fresh, p) for p in range(30, 30 + n)] == expected[:n]
    assert second.stats()["store"]["load_misses"] >= 1


@pytest.mark.parametrize(
    ("extra", "fields", "match"),
    [
        ({"dram_blocks": 4}, {}, r"dram_blocks: unknown key"),
        ({"dram": {"capacity": 4}}, {}, r"dram\.capacity: unknown key"),
        ({"block_size": 16}, {}, r"block_size: set by SGLang's --page-size"),
        ({"shard_rank": 1}, {}, r"shard_rank: set by SGLang's ranks"),
        ({"model_id": "other"}, {}, r"model_id: 'other' contradicts SGLang's model_name"),
        ({"disk": {"directory": 7, "capacity_blocks": 1}}, {}, r"disk"),
        ({}, {"model_name": None}, r"model_id: SGLang gave no model_name"),
        ({}, {"should_split_heads": True}, r"should_split_heads"),
        ({"secret_file": "/nonexistent/secret"}, {}, r"secret_file: cannot read"),
    ],
)
def test_a_bad_configuration_is_refused_when_sglang_makes_the_backend(extra, fields, match):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from tests.sglang.conftest import storage_config

    pool = host_pool("mha", "page_first")
    with pytest.raises(InvalidArgumentError, match=match):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config("mha", "page_first", extra, **fields), pool
        )


def test_a_layout_or_pool_it_does_not_know_is_refused(backends):
    pool = host_pool("mha", "page_first")
    pool.layout = "page_first_kv_split"
    with pytest.raises(InvalidArgumentError, match=r"layout 'page_first_kv_split' is not"):
        backends(pool, "mha")
    backend = backends(host_pool("mha", "page_first"), "mha")
    with pytest.raises(InvalidArgumentError, match=r"'mamba' pools of hybrid models"):
        backend.register_mem_host_pool_v2(pool, "mamba")
    with pytest.raises(InvalidArgumentError, match=r"hybrid \(v2\) pools"):
        backend.batch_get_v2([])
    with pytest.raises(
        InvalidArgumentError, match=r"host_indices: each page must be 4 slots in a row"
    ):
        backend.batch_set_v1(keys(1), torch.arange(1, 5))
    with pytest.raises(InvalidArgumentError, match=r"values\[0\]: a flat page"):
        backend.batch_set(keys(1), [torch.zeros(3, dtype=torch.bfloat16)])
    assert backend.stats()["store"]["saves"] == 0


def test_mla_pages_are_keyed_without_the_tensor_parallel_rank(backends, tmp_path):
    """MLA pages are the same on every rank: with a tier the ranks share (here a shared FS),
    only the writer rank (SGLang's tp_rank == dcp_rank) stores, and rank 1 finds its pages."""
    extra = {"shared_fs": {"directory": str(tmp_path / "shared"), "create": True}}
    writer_pool = host_pool("mla", "page_first")
    writer = backends(writer_pool, "mla", extra, tp_size=2, tp_rank=0)
    reader_pool = host_pool("mla", "page_first")
    reader = backends(reader_pool, "mla", extra, tp_size=2, tp_rank=1)
    assert writer.store.namespace == reader.store.namespace
    assert writer.settings.writes and not reader.settings.writes
    names = keys(3)
    assert reader.batch_set_v1(names, indices([0, 1, 2], 4)) == [True] * 3
    assert reader.stats()["store"]["saves"] == 0  # not the writer: nothing stored
    expected = [page_bytes(writer_pool, p) for p in (5, 6, 7)]
    assert writer.batch_set_v1(names, indices([5, 6, 7], 4)) == [True] * 3
    assert writer.store.flush(30)  # written back to the shared FS
    assert reader.batch_exists(names) == 3
    assert reader.batch_get_v1(names, indices([10, 11, 12], 4)) == [True] * 3
    assert [page_bytes(reader_pool, p) for p in (10, 11, 12)] == expected
    mha = [backends(host_pool("mha", "page_first"), "mha", tp_size=2, tp_rank=r) for r in (0, 1)]
    assert mha[0].store.namespace != mha[1].store.namespace


def test_randomize_changes_a_pools_pages():
    """What the round trips rely on: randomize() gives a page new bytes, so a page read back
    equal to what was stored was really loaded."""
    pool = host_pool("mha", "page_first")
    first = page_bytes(pool, 0)
    randomize(pool)
    assert page_bytes(pool, 0) != first


def test_pools_keeping_part_of_a_page_elsewhere_and_dcp_are_refused(backends):
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    class ScalesElsewhere(MHATokenToKVPoolHost):  # as SGLang's MXFP8 pool keeps its scales
        pass

    pool = host_pool("mha", "page_first")
    pool.__class__ = ScalesElsewhere
    with pytest.raises(InvalidArgumentError, match=r"ScalesElsewhere is not supported"):
        backends(pool, "mha")
    mla = host_pool("mla", "page_first")
    with pytest.raises(InvalidArgumentError, match=r"dcp_size: .*decode context parallel"):
        backends(mla, "mla", tp_size=2, tp_rank=0, dcp_size=2, dcp_rank=0, logical_page_size=8)
    backend = backends(host_pool("mha", "page_first"), "mha")
    scattered = torch.tensor([0, 1, 3, 2])  # one page's slots out of order
    with pytest.raises(InvalidArgumentError, match=r"4 slots in a row"):
        backend.batch_get_v1(keys(1), scattered)


def test_each_rank_opens_its_own_named_dram_and_disk_directory(backends, shm_names, tmp_path):
    """Every rank of an engine reads the same extra config; a named DRAM pool and a disk
    directory have one owner, so each rank gets its own (named after its ranks)."""
    name = shm_names()
    extra = {"dram": {"capacity_blocks": 8, "name": name},
             "disk": {"directory": str(tmp_path), "capacity_blocks": 16}}  # fmt: skip
    try:
        ranks = [backends(host_pool("mha", "page_first"), "mha", extra, tp_size=2, tp_rank=r)
                 for r in (0, 1)]  # fmt: skip
        for rank, backend in enumerate(ranks):
            assert backend.store.config.dram.name == f"{name}-tp{rank}"
            assert Path(backend.store.config.tiers[0].directory) == tmp_path / f"tp{rank}"
            assert backend.batch_set_v1(keys(2), indices([0, 1], 4)) == [True, True]
            backend.close()
    finally:
        for rank in (0, 1):
            pool_path(f"{name}-tp{rank}").unlink(missing_ok=True)
            shutil.rmtree(sessions_path(f"{name}-tp{rank}"), ignore_errors=True)


def test_mla_ranks_without_a_shared_tier_each_store_their_copy(backends):
    pools = [host_pool("mla", "layer_first") for _ in range(2)]
    ranks = [backends(p, "mla", tp_size=2, tp_rank=r) for r, p in enumerate(pools)]
    assert all(b.settings.writes for b in ranks)
    names = keys(2)
    assert ranks[1].batch_set_v1(names, indices([0, 1], 4)) == [True, True]
    assert ranks[1].batch_exists(names) == 2


@pytest.fixture(scope="module")
def sglang_page_keys(tmp_path_factory):
    """SGLang's own page keys (``get_hash_str``: its C++ SHA-256 chain, built on first use
    with the compiler and libssl that .ci/run installs), its build in a temporary directory."""
    import os

    build = tmp_path_factory.mktemp("torch-extensions")
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(build)
    try:
        from sglang.srt.mem_cache.utils import get_hash_str

        yield lambda tokens, page_size: get_hash_str(tokens, None, page_size=page_size)
    finally:
        if before is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before
        shutil.rmtree(build, ignore_errors=True)


def test_sglangs_own_page_keys_find_a_shared_prefix_and_nothing_past_it(backends, sglang_page_keys):
    """Keys from SGLang's own hashing of token ids: a second prompt sharing the first three
    pages of a stored one finds exactly those three, and loads them byte for byte."""
    rng = np.random.default_rng()
    first = rng.integers(0, 150_000, 6 * 4).tolist()
    second = first[: 3 * 4] + rng.integers(0, 150_000, 3 * 4).tolist()
    first_keys, second_keys = sglang_page_keys(first, 4), sglang_page_keys(second, 4)
    assert len(first_keys) == 6 and first_keys[:3] == second_keys[:3]
    assert first_keys[3:] != second_keys[3:]
    pool = host_pool("mha", "page_first_direct")
    backend = backends(pool, "mha")
    expected = [page_bytes(pool, p) for p in range(6)]
    assert backend.batch_set_v1(first_keys, indices(list(range(6)), 4)) == [True] * 6
    assert backend.batch_exists(second_keys) == 3
    got = backend.batch_get_v1(second_keys, indices(list(range(10, 16)), 4))
    assert got == [True] * 3 + [False] * 3
    assert [page_bytes(pool, p) for p in range(10, 13)] == expected[:3]


def test_kv_events_of_the_tiers_decode_with_sglangs_own_decoder(backends, tmp_path):
    """``kv_events``: the backend's tiers publish SGLang's KV events on a ZMQ socket, each page
    named as SGLang names it (``hash_str_to_int64`` of its key), parents chained from the
    prefix SGLang passes; SGLang's typed decoder accepts every batch."""
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    endpoint = f"ipc://{tmp_path}/events"
    pool = host_pool("mha", "page_first")
    extra = {
        "kv_events": {"endpoint": endpoint, "topic": "kv@pod@tiny"},
        "dram": {"capacity_blocks": 4},  # the second call evicts the first's pages
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64, "create": True},
    }
    backend = backends(pool, "mha", extra)
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    subscriber.connect(endpoint)
    frames: list[list[bytes]] = []
    try:
        for _ in range(200):  # a subscription takes a moment to reach the publisher
            backend.batch_set_v1(keys(1), indices([30], 4))
            if subscriber.poll(50):
                break
        else:
            raise AssertionError("no KV event reached the subscriber")
        while subscriber.poll(200):
            subscriber.recv_multipart()  # the warm-up's
        prefix, first, second = keys(2), keys(4), keys(4)
        info = HiCacheStorageExtraInfo(prefix_keys=prefix)
        assert backend.batch_set_v1(first, indices([0, 1, 2, 3], 4), info) == [True] * 4
        assert backend.batch_set_v1(second, indices([4, 5, 6, 7], 4)) == [True] * 4
        assert backend.store.flush(timeout=30)
        while subscriber.poll(1000):
            frames.append(subscriber.recv_multipart())
    finally:
        subscriber.close(linger=0)
        context.term()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = [decoder.decode(payload) for _topic, _seq, payload in frames]  # every one decodes
    assert {topic for topic, _, _ in frames} == {b"kv@pod@tiny"}
    sequences = [int.from_bytes(seq, "big") for _, seq, _ in frames]
    assert sequences == sorted(sequences)
    events = [e for b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    named = [hash_str_to_int64(k) for k in first]

    def on(medium: str) -> list[tuple[int, int | None]]:
        return [(e.block_hashes[0], e.parent_block_hash) for e in stored if e.medium == medium]

    chain = list(zip(named, [hash_str_to_int64(prefix[-1]), *named[:-1]], strict=True))
    assert [p for p in on("CPU_PINNED") if p[0] in named] == chain
    assert [p for p in on("DISK") if p[0] in named] == chain
    assert all(e.token_ids == [] and e.block_size == 4 for e in stored)
    evicted = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes
               if e.medium == "CPU_PINNED"}  # fmt: skip
    assert set(named) <= evicted  # from DRAM; still on disk


def test_kv_events_settings_are_checked(backends):
    pool = host_pool("mha", "page_first")
    for value, match in [
        ({"endpoint": "udp://x"}, "kv_events.endpoint: expected a ZMQ endpoint"),
        ({"endpoint": "ipc:///tmp/x", "port": 1}, "kv_events.port: unknown key"),
        ("tcp://127.0.0.1:1", "kv_events: expected an object"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            backends(pool, "mha", {"kv_events": value})
