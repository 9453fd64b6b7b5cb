"""Loads that skip DRAM: a hit only a store node, the cluster's peers or the disk tier holds
lands straight in the engine's CPU tensors (``kv._direct``), bit-exact, each block checked
where it landed; a block that fails there is never reported loaded; a hit partly in DRAM goes
through DRAM as before."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from engines import tier_asked

from tpusync import TorchPool
from tpusync._src.cluster import serving
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync.cluster import MemoryRegistry, RegistryTier, StoreNode, StoreNodeTier
from tpusync.kv import DiskTier, DramTier, KVCacheStore, KVStoreConfig
from tpusync.tiers import Scatter

BLOCK = 16
LAYERS = 3
SECRET = os.urandom(32)
TIMEOUT = 30.0


def _kv(blocks: int, dtype: torch.dtype, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes (never zeros) as ``LAYERS`` vLLM-shaped tensors of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (LAYERS, blocks, *shape), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def _pools(kv: torch.Tensor) -> list[TorchPool]:
    return [TorchPool(kv[i], name=f"layer{i}") for i in range(kv.shape[0])]


def _store(
    pools: list[TorchPool],
    *tiers: object,
    dram: int = 64,
    block_axis: int = 0,
    shm_dir: str | None = None,
) -> KVCacheStore:
    """A store over ``pools``; ``shm_dir``: its DRAM a named pool there."""
    named = {"name": "producer", "shm_dir": shm_dir} if shm_dir else {}
    config = KVStoreConfig(
        "direct", BLOCK, DramTier(dram, **named), secret=SECRET, tiers=tiers,
        block_axis=block_axis, token_axis=block_axis + 2,
    )  # fmt: skip
    return KVCacheStore(config, pools)


@pytest.fixture(params=["tcp", "pool file"])
def node(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreNode]:
    """A store node; "pool file": its DRAM is a named pool, which a consumer on this host
    reads directly instead of over TCP (``cluster/dataplane/local_reads.py``)."""
    named = {"name": "direct", "shm_dir": str(tmp_path)} if request.param == "pool file" else {}
    with StoreNode(64 << 20, secret=SECRET, **named) as node:
        yield node


def _file_blocks(store: KVCacheStore) -> int:
    return store._stack.tiers[1].client.local_blocks


def _saved(store: KVCacheStore, n: int) -> list[bytes]:
    hashes = [os.urandom(32) for _ in range(n)]
    store.save_engine_blocks_async(hashes, list(range(n))).result()
    assert store.flush(TIMEOUT)
    return hashes


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.bfloat16, (2, BLOCK, 64)), (torch.float8_e4m3fn, (4, BLOCK, 32)),
     (torch.float32, (1, BLOCK, 8))],
)  # fmt: skip
def test_a_store_node_hit_lands_in_the_tensors_bit_exact(node, dtype, shape) -> None:
    source, target = _kv(12, dtype, 1, shape), _kv(12, dtype, 2, shape)
    before = target.clone()
    ids = [7, 2, 9, 0, 11, 4]
    with _store(_pools(source), StoreNodeTier(node.address)) as producer:
        hashes = _saved(producer, 6)
    with _store(_pools(target), StoreNodeTier(node.address)) as consumer:
        result = consumer.lookup_engine_blocks(hashes)
        assert result.num_blocks == 6
        done = consumer.load(result, ids)
        stats = consumer.stats()
        assert consumer.dram.used == 0  # nothing staged in DRAM
        assert _file_blocks(consumer) == (6 if node.server.name else 0)
    assert done.loaded_blocks == 6 and done.promoted_blocks == 0
    assert stats["store"]["direct_loads"] == 6 and stats["store"]["promotions"] == 0
    for i, block in enumerate(ids):
        assert _same(target[:, block], source[:, i])
    untouched = [b for b in range(12) if b not in ids]
    assert _same(target[:, untouched], before[:, untouched])


def test_a_block_axis_after_others_lands_piece_by_piece(node) -> None:
    """vLLM's GPU-style layout ``[2, blocks, heads, block_size, dim]`` (block axis 1): two
    pieces a block, one from each half."""
    source = _kv(2, torch.bfloat16, 3, (4, 2, BLOCK, 32))  # [layer, 2, 4 blocks, 2, BLOCK, 16]
    target = _kv(2, torch.bfloat16, 4, (4, 2, BLOCK, 32))
    with _store(_pools(source), StoreNodeTier(node.address), block_axis=1) as producer:
        hashes = _saved(producer, 3)
    with _store(_pools(target), StoreNodeTier(node.address), block_axis=1) as consumer:
        done = consumer.load(consumer.lookup_engine_blocks(hashes), [3, 1, 0])
        assert consumer.stats()["store"]["direct_loads"] == 3
    assert done.loaded_blocks == 3
    for i, block in enumerate([3, 1, 0]):
        assert _same(target[:, :, block], source[:, :, i])


def _lookup_all(store: KVCacheStore, hashes: list[bytes]) -> object:
    """The lookup once every block is listed (a peer lists its blocks in the background)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        result = store.lookup_engine_blocks(hashes)
        if result.num_blocks == len(hashes) or time.monotonic() > deadline:
            return result
        store.release(result)
        time.sleep(0.02)


@pytest.mark.parametrize("named", [False, True])
def test_a_damaged_block_is_never_reported_loaded(tmp_path, caplog, named: bool) -> None:
    """A peer whose DRAM holds a damaged block (bytes changed after its checksum was taken):
    the consumer's load stops before that block, and every block it reports loaded is the
    producer's, byte for byte; also when the peer's DRAM is a named pool the consumer reads
    from its file."""
    registry = MemoryRegistry()
    shape = (2, BLOCK, 32)
    source, target = _kv(8, torch.bfloat16, 5, shape), _kv(8, torch.bfloat16, 6, shape)
    with _store(_pools(source), shm_dir=str(tmp_path) if named else None) as producer:
        serving.serve(producer, registry, "producer", secret=SECRET, ttl_s=30)
        hashes = _saved(producer, 6)
        damaged = producer.dram.slot_of(producer._engine_blocks._keys(hashes, None)[3])
        with producer.dram.slot_memory(damaged) as memory:
            memory[100] ^= 0xFF
        with _store(_pools(target), RegistryTier(registry, exclude="consumer")) as consumer:
            result = _lookup_all(consumer, hashes)
            assert result.num_blocks == 6
            done = consumer.load(result, [0, 1, 2, 3, 4, 5])
            stats = consumer.stats()["store"]
    assert done.loaded_blocks == 3
    assert stats["direct_loads"] == 3  # the blocks used, not every one that arrived
    # a named pool was read from its file (where the damaged block failed)
    assert any("pool file: 1 blocks failed" in r.getMessage() for r in caplog.records) == named
    for block in range(3):
        assert _same(target[:, block], source[:, block])


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.bfloat16, (2, BLOCK, 64)), (torch.float8_e5m2, (4, BLOCK, 32)),
     (torch.int8, (1, BLOCK, 8))],
)  # fmt: skip
def test_a_disk_hit_lands_in_the_tensors_and_a_damaged_block_ends_it(
    tmp_path, dtype, shape
) -> None:
    """A hit only the disk tier holds is read straight into the tensors (not staged in DRAM),
    bit-exact; a block damaged in its slab file is never reported loaded: the load stops before
    it, and it is dropped from the disk."""
    disk = DiskTier(tmp_path / "disk", 32, create=True)
    source, target = _kv(10, dtype, 13, shape), _kv(10, dtype, 14, shape)
    with _store(_pools(source), disk) as producer:
        hashes = _saved(producer, 8)
        keys = producer._engine_blocks._keys(hashes, None)
    with _store(_pools(target), disk) as consumer:
        pool = consumer._stack.tiers[1]
        fd, offset = pool._locate(pool._index[keys[5]])
        with open(os.readlink(f"/proc/self/fd/{fd}"), "r+b") as slab:  # not O_DIRECT
            slab.seek(offset + 7)
            byte = slab.read(1)[0]
            slab.seek(offset + 7)
            slab.write(bytes([byte ^ 0x20]))
        ids = [9, 0, 8, 1, 7, 2, 6, 3]
        done = consumer.load(consumer.lookup_engine_blocks(hashes), ids)
        stats = consumer.stats()
        assert consumer.dram.contains(keys[:5]) == [False] * 5  # landed, not staged
        assert pool.contains([keys[5]]) == [False]
    # the rest went through DRAM (blocks 6 and 7 promoted there), and stops at the lost one
    assert done.loaded_blocks == 5
    assert stats["store"]["direct_loads"] == 5
    assert stats["tiers"]["disk"]["checksum_failures"] == 1
    for i, block in enumerate(ids[:5]):
        assert _same(target[:, block], source[:, i])


def test_blocks_spaced_apart_in_the_tensor_land_at_their_stride(node) -> None:
    """A pool that is a view of every other block of a larger tensor: each block lands at the
    view's own block stride, and the blocks between stay untouched."""
    shape = (2, BLOCK, 32)
    wide = _kv(12, torch.bfloat16, 7, shape)
    before = wide.clone()
    source = _kv(6, torch.bfloat16, 8, shape)
    target = wide[:, ::2]  # [layer, 6 blocks, ...] with twice the block stride
    assert not target.is_contiguous()
    with _store(_pools(source), StoreNodeTier(node.address)) as producer:
        hashes = _saved(producer, 4)
    with _store(_pools(target), StoreNodeTier(node.address)) as consumer:
        done = consumer.load(consumer.lookup_engine_blocks(hashes), [5, 4, 3, 2])
        assert consumer.stats()["store"]["direct_loads"] == 4
    assert done.loaded_blocks == 4
    for i, block in enumerate([5, 4, 3, 2]):
        assert _same(target[:, block], source[:, i])
    assert _same(wide[:, 1::2], before[:, 1::2])


def test_a_hit_partly_in_dram_goes_through_dram(node) -> None:
    shape = (1, BLOCK, 16)
    source, target = _kv(8, torch.float16, 9, shape), _kv(8, torch.float16, 10, shape)
    with _store(_pools(source), StoreNodeTier(node.address)) as producer:
        hashes = _saved(producer, 4)
    with _store(_pools(target), StoreNodeTier(node.address)) as consumer:
        first = consumer.load(consumer.lookup_engine_blocks(hashes[:2]), [6, 7])
        assert first.loaded_blocks == 2 and consumer.dram.used == 0
        consumer._run_prefetch(consumer._engine_blocks._keys(hashes[:2], None))  # now in its DRAM
        assert consumer.dram.used == 2
        done = consumer.load(consumer.lookup_engine_blocks(hashes), [0, 1, 2, 3])
        stats = consumer.stats()["store"]
    assert done.loaded_blocks == 4 and done.promoted_blocks == 2
    assert stats["direct_loads"] == 2 and stats["promotions"] == 2 + 2  # prefetch, load
    for i in range(4):
        assert _same(target[:, i], source[:, i])


def test_a_stalled_peer_never_stalls_the_engines_other_transfers(tmp_path) -> None:
    """While a direct load waits on a store node that stopped answering (SIGSTOP), a DRAM hit
    loads into other blocks of the same tensors at once: the tensors' locks are not held while
    the node is awaited. The stalled load then fails within its timeout, nothing loaded."""
    node, ready = start_store_node(tmp_path, SECRET, 64 << 20)
    try:
        shape = (2, BLOCK, 32)
        source, target = _kv(8, torch.bfloat16, 11, shape), _kv(8, torch.bfloat16, 12, shape)
        tier = StoreNodeTier(ready["address"], timeout_s=3.0)
        with _store(_pools(source), tier) as producer:
            hashes = _saved(producer, 4)
        with _store(_pools(target), tier) as consumer:
            local = _saved(consumer, 2)  # blocks 0 and 1, in its DRAM
            remote = consumer.lookup_engine_blocks(hashes)
            in_dram = consumer.lookup_engine_blocks(local)
            assert remote.num_blocks == 4 and in_dram.num_blocks == 2
            # the node stops as the load, its places in the tensors read, asks it for the
            # blocks (after the lookup that found them there)
            asked = tier_asked(
                consumer, ("get_scattered",), then=lambda: os.kill(node.pid, signal.SIGSTOP)
            )
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                load = pool.submit(consumer.load, remote, [2, 3, 4, 5])
                assert asked.wait(timeout=10)  # the load waits on the stopped node
                assert not load.done()
                started = time.monotonic()
                assert consumer.load(in_dram, [6, 7]).loaded_blocks == 2
                assert time.monotonic() - started < 1.5 and not load.done()
                assert load.result(timeout=30).loaded_blocks == 0
        assert _same(target[:, 6:8], target[:, 0:2])
    finally:
        os.kill(node.pid, signal.SIGCONT)
        stop_process(node)


def test_scatter_select_keeps_each_blocks_runs() -> None:
    scatter = Scatter(
        np.array([0, 2, 3, 6]), np.array([0, 5, 0, 0, 1, 2]), np.array([10, 20, 30, 40, 50, 60])
    ).checked(3, 8)
    part = scatter.select([2, 0])
    assert part.first.tolist() == [0, 3, 5]
    assert part.offsets.tolist() == [0, 1, 2, 0, 5]
    assert part.targets.tolist() == [40, 50, 60, 10, 20]
