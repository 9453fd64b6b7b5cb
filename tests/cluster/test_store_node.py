"""Store nodes: a process lending its DRAM to peers as a writable lower tier.

Real sockets on loopback, real HostPools of random bits, a real `tpusync serve` child process
(stopped by pid); the KV-level test runs the toy model on both sides and compares bit for bit.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kv_child
import numpy as np
import pytest
from test_cluster_dataplane import LAYOUT, SECRET, assert_clean, fill, key_for, payload

from tpusync._src.cluster._handshake import _send_frame
from tpusync._src.cluster.dataplane import wire
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    MemoryRegistry,
    RegistryPool,
    RemoteRegistry,
    StoreNode,
    StoreNodePool,
)
from tpusync.errors import (
    BlocksMissingError,
    InvalidArgumentError,
    PeerUnavailableError,
    RemoteOperationUnsupportedError,
)
from tpusync.tiers import ArrayLayout, HostPool, LowerTier, PoolLayout

MiB = 1 << 20
# 128 KiB slots: a 1 MiB node holds 8 of them
BIG = PoolLayout("store-node-big", (ArrayLayout("k", "uint8", (128 * 1024,), 0, 1),))


@pytest.fixture
def source(rng: np.random.Generator, arrays: Any) -> Iterator[HostPool]:
    with HostPool(LAYOUT, 32) as pool:
        fill(pool, [key_for(i) for i in range(24)], rng, arrays)
        yield pool


@pytest.fixture
def node() -> Iterator[StoreNode]:
    with StoreNode(16 * MiB, secret=SECRET) as n:
        yield n


def tier_for(node: StoreNode, layout: PoolLayout = LAYOUT, **kwargs: Any) -> StoreNodePool:
    kwargs.setdefault("timeout_s", 5.0)
    return StoreNodePool(node.address, layout=layout, secret=SECRET, **kwargs)


def test_put_then_get_is_bit_exact(node: StoreNode, source: HostPool) -> None:
    keys = [key_for(i) for i in range(24)]
    with tier_for(node, connections=3) as tier, HostPool(LAYOUT, 32) as target:
        assert isinstance(tier, LowerTier)
        assert tier.put(keys[:10], source) == 10
        assert tier.put(keys, source) == 14  # the first ten were there already
        assert tier.contains([*keys, key_for(99)]) == [True] * 24 + [False]
        assert sorted(tier.keys()) == sorted(keys)
        assert tier.used == 24
        tier.get(keys, target)
        for key in keys:
            assert payload(target, key) == payload(source, key)
        assert tier.delete(keys[:4]) == 4
        assert tier.contains(keys[:5]) == [False] * 4 + [True]
        with HostPool(LAYOUT, 8) as fresh, pytest.raises(BlocksMissingError) as missing:
            tier.get(keys[:5], fresh)
        assert missing.value.loaded == [False] * 4 + [True]
    (pool,) = node.server.pools
    assert_clean(pool, 20)


def test_put_of_keys_the_source_lacks_raises_before_sending(
    node: StoreNode, source: HostPool
) -> None:
    with tier_for(node) as tier:
        with pytest.raises(BlocksMissingError) as missing:
            tier.put([key_for(0), key_for(77)], source)
        assert missing.value.loaded == [True, False]
        assert tier.used == 0


def test_a_corrupt_source_block_is_refused(node: StoreNode, source: HostPool) -> None:
    """The source's record says one checksum, its bytes another: the node verifies the bytes
    it received and does not store the block."""
    bad = key_for(3)
    with source.slot_memory(source.slot_of(bad)) as memory:
        memory[100] ^= 0x40
    with tier_for(node) as tier:
        assert tier.put([key_for(2), bad, key_for(4)], source) == 2
        assert tier.contains([key_for(2), bad, key_for(4)]) == [True, False, True]
    (pool,) = node.server.pools
    assert pool.stats.as_dict()["checksum_failures"] == 1
    assert_clean(pool, 2)


def put_frames(
    conn: Any, keys: list[bytes], source: HostPool, pinned: Any, declared: list[int] | None = None
) -> tuple[int, list[bytes]]:
    """Starts a put of ``keys`` by hand (both accepted) and returns its request id and each
    block's frame, the header declaring ``declared[i]`` (default: the recorded checksum)."""
    rid, answer = conn.send_put(keys, pinned.checksums.tolist())
    assert answer["accept"] == [True] * len(keys)
    size = LAYOUT.payload_bytes
    frames = []
    sums = pinned.checksums.tolist() if declared is None else declared
    for key, slot, checksum in zip(keys, pinned.slots.tolist(), sums, strict=True):
        header = wire.encode_header(wire.BLOCK, rid, key, LAYOUT.fingerprint, size, checksum)
        with source.slot_memory(slot) as memory:
            frames.append(header + bytes(memory[:size]))
    return rid, frames


@pytest.mark.parametrize("cut_at", [0, 50, wire.HEADER_SIZE + 10])
def test_a_put_cut_mid_block_commits_nothing_in_flight(
    node: StoreNode, source: HostPool, cut_at: int
) -> None:
    """A client sends one whole block, then part of the next, then disconnects: the node keeps
    only the whole, verified block and leaks no slot."""
    client = BlockClient(node.address, secret=SECRET, layout=LAYOUT, timeout_s=5.0)
    keys = [key_for(0), key_for(1)]
    pinned = source.pin(keys)
    try:
        conn = client._conns[0]
        _, frames = put_frames(conn, keys, source, pinned)
        assert conn.sock is not None
        conn.sock.sendall(frames[0] + frames[1][:cut_at])
        conn.drop()
    finally:
        source.unpin(pinned)
        client.close()
    (pool,) = node.server.pools
    deadline = time.monotonic() + 5
    while pool.free != pool.capacity and time.monotonic() < deadline:
        time.sleep(0.01)  # the server's thread sees the cut and aborts the reservation
    assert_clean(pool, 0)
    with tier_for(node) as tier:
        # the first block was complete but its put never ended: nothing of it is committed
        assert tier.contains(keys) == [False, False]


def test_a_frame_that_contradicts_its_put_stores_nothing_of_it(
    node: StoreNode, source: HostPool
) -> None:
    """Block 0's frame carries another checksum than the put declared (the node's native
    receiver stops at it and reads it a frame at a time): that block is not stored, the put
    goes on, and block 1 is."""
    client = BlockClient(node.address, secret=SECRET, layout=LAYOUT, timeout_s=5.0)
    keys = [key_for(0), key_for(1)]
    pinned = source.pin(keys)
    try:
        conn = client._conns[0]
        recorded = pinned.checksums.tolist()
        rid, frames = put_frames(conn, keys, source, pinned, [recorded[0] ^ 1, recorded[1]])
        assert conn.sock is not None
        conn.sock.sendall(b"".join(frames))
        assert conn.finish_put(rid, LAYOUT.fingerprint)["stored"] == [False, True]
    finally:
        source.unpin(pinned)
        client.close()
    with tier_for(node) as tier:
        assert tier.contains(keys) == [False, True]
    (pool,) = node.server.pools
    assert_clean(pool, 1)


def test_garbage_after_a_put_closes_only_that_connection(
    node: StoreNode, source: HostPool, rng: np.random.Generator
) -> None:
    client = BlockClient(node.address, secret=SECRET, layout=LAYOUT, timeout_s=5.0)
    try:
        conn = client._conns[0]
        pinned = source.pin([key_for(5)])
        conn.send_put([key_for(5)], pinned.checksums.tolist())
        source.unpin(pinned)
        assert conn.sock is not None
        conn.sock.sendall(rng.integers(0, 256, 500, dtype=np.uint8).tobytes())
        with pytest.raises((EOFError, ConnectionError, OSError)):
            conn.sock.settimeout(5)
            if conn.sock.recv(1) == b"":
                raise EOFError
    finally:
        client.close()
    with tier_for(node) as tier:
        assert tier.put([key_for(5)], source) == 1
    (pool,) = node.server.pools
    assert_clean(pool, 1)


def test_bad_put_requests_are_refused_and_change_nothing(node: StoreNode) -> None:
    client = BlockClient(node.address, secret=SECRET, layout=LAYOUT, timeout_s=5.0)
    try:
        conn = client._conns[0]
        for params, match in [
            ({"keys": ["00ff"], "checksums": []}, "checksums"),
            ({"keys": ["00ff"], "checksums": [-1]}, "checksums"),
            ({"keys": ["00ff", "00ff"], "checksums": [1, 1]}, "at most once"),
            ({"keys": ["zz"], "checksums": [1]}, "hex"),
        ]:
            assert conn.sock is not None
            body = {"id": 7, "method": "put", "params": params}
            _send_frame(conn.sock, json.dumps(body).encode())
            with pytest.raises(InvalidArgumentError, match=match):
                conn._answer(7, "put")
    finally:
        client.close()
    (pool,) = node.server.pools
    assert_clean(pool, 0)


def test_the_node_evicts_its_least_recently_used_blocks(rng: np.random.Generator) -> None:
    """8 slots; 8 blocks stored, 2 of them read again, 3 more pushed: the 3 oldest unread go."""
    with (
        StoreNode(1 * MiB, secret=SECRET) as node,
        HostPool(BIG, 16) as source,
        HostPool(BIG, 16) as target,
        tier_for(node, BIG) as tier,
    ):
        keys = [key_for(i) for i in range(11)]
        reservation = source.reserve(keys)
        for slot in reservation.slots.tolist():
            with source.slot_memory(slot) as memory:
                memory[: BIG.payload_bytes] = rng.bytes(BIG.payload_bytes)
        source.commit(reservation, source.hash_slots(reservation.slots))
        assert tier.capacity == 8
        assert tier.put(keys[:8], source) == 8
        tier.get([keys[0], keys[1]], target)  # now the most recently used
        assert tier.put(keys[8:], source) == 3
        assert (
            tier.contains(keys) == [True, True, False, False, False, True, True, True] + [True] * 3
        )
        assert tier.used == 8


def _big_source(pool: HostPool, keys: list[bytes], rng: np.random.Generator) -> None:
    reservation = pool.reserve(keys)
    for slot in reservation.slots.tolist():
        with pool.slot_memory(slot) as memory:
            memory[: BIG.payload_bytes] = rng.bytes(BIG.payload_bytes)
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def test_a_node_with_a_disk_demotes_instead_of_dropping(
    rng: np.random.Generator, tmp_path: Path
) -> None:
    """8 DRAM slots and 16 on disk: 20 pushed blocks all stay (DRAM's oldest demoted to disk)
    and come back bit-exact (disk blocks moved up for the lease); 10 more push the oldest off
    the node, and the registry is told; a restarted node finds its disk blocks again."""
    keys = [key_for(i) for i in range(30)]
    registry = MemoryRegistry()
    with HostPool(BIG, 32) as source:
        _big_source(source, keys, rng)
        with (
            StoreNode(
                1 * MiB, secret=SECRET, disk_dir=tmp_path, disk_bytes=2 * MiB, registry=registry
            ) as node,
            tier_for(node, BIG) as tier,
            HostPool(BIG, 32) as target,
        ):
            assert tier.capacity == 24
            assert tier.put(keys[:20], source) == 20
            assert tier.contains(keys[:20]) == [True] * 20 and tier.used == 20
            (pool,) = node.server.pools
            assert pool.used == 8  # the rest went down to disk
            tier.get(keys[:20], target)
            for key in keys[:20]:
                assert payload(target, key) == payload(source, key)
            assert tier.put(keys[20:], source) == 10
            assert tier.used == 24
            node.flush()
            held = [bool(h) for h in registry.holders(keys)]
            assert held == tier.contains(keys)
            assert sum(held) == 24
            kept = [k for k, h in zip(keys, held, strict=True) if h]
        with (
            StoreNode(1 * MiB, secret=SECRET, disk_dir=tmp_path, disk_bytes=2 * MiB) as node,
            tier_for(node, BIG) as tier,
            HostPool(BIG, 32) as target,
        ):
            on_disk = [k for k, h in zip(kept, tier.contains(kept), strict=True) if h]
            assert len(on_disk) == 16  # DRAM was anonymous: its 8 are gone
            tier.get(on_disk, target)
            for key in on_disk:
                assert payload(target, key) == payload(source, key)


def test_layouts_share_the_node_up_to_max_layouts(source: HostPool) -> None:
    with StoreNode(8 * MiB, secret=SECRET, max_layouts=2) as node:
        with tier_for(node) as a, tier_for(node, BIG) as b:
            assert a.capacity == 4 * MiB // LAYOUT.slot_bytes
            assert b.capacity == 32
        other = PoolLayout("third", (ArrayLayout("x", "float32", (64,), 0, 1),))
        with pytest.raises(InvalidArgumentError, match="no room for another"):
            tier_for(node, other)
        assert len(node.server.pools) == 2


def test_clients_that_name_no_layout_or_a_plain_server(source: HostPool) -> None:
    with StoreNode(4 * MiB, secret=SECRET) as node:
        with pytest.raises(InvalidArgumentError, match="serves the layout its client names"):
            BlockClient(node.address, secret=SECRET, timeout_s=5.0)
        with pytest.raises(InvalidArgumentError, match="layout"):
            BlockClient(node.address, secret=SECRET, layout="big")  # type: ignore[arg-type]
    with BlockServer(source, secret=SECRET) as server:
        with pytest.raises(InvalidArgumentError, match="not a store node"):
            StoreNodePool(server.address, layout=LAYOUT, secret=SECRET)
        with (
            BlockClient(server.address, secret=SECRET, layout=LAYOUT) as client,
            pytest.raises(RemoteOperationUnsupportedError, match="store node"),
        ):
            client.push([key_for(0)], source)
    with pytest.raises(PeerUnavailableError):
        StoreNodePool(node.address, layout=LAYOUT, secret=SECRET)  # closed


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dram_bytes": 100}, "dram_bytes"),
        ({"dram_bytes": 4 * MiB, "max_layouts": 0}, "max_layouts"),
        ({"dram_bytes": 4 * MiB, "name": "a/b"}, "name"),
        ({"dram_bytes": 4 * MiB, "secret": b"short"}, "secret"),
        ({"dram_bytes": 4 * MiB, "registry": object()}, "registry"),
        ({"dram_bytes": 4 * MiB, "registry": MemoryRegistry(), "registry_port": 0}, "not both"),
    ],
)
def test_bad_node_arguments(kwargs: dict[str, Any], match: str) -> None:
    kwargs.setdefault("secret", SECRET)
    with pytest.raises(InvalidArgumentError, match=match):
        StoreNode(**kwargs)


def test_the_node_publishes_what_it_holds(source: HostPool) -> None:
    """With an embedded registry: a put is published under the node's lease, an eviction or
    delete withdrawn, and a RegistryPool on another node pulls the blocks from the node."""
    with StoreNode(16 * MiB, secret=SECRET, registry_port=0, ttl_s=5) as node:
        assert node.registry_address is not None
        keys = [key_for(i) for i in range(6)]
        with tier_for(node) as tier:
            tier.put(keys, source)
            tier.delete(keys[:1])
        node.flush()
        with RemoteRegistry(node.registry_address, secret=SECRET) as registry:
            assert [n.addresses for n in registry.nodes()] == [(node.address,)]
            held = [bool(h) for h in registry.holders(keys)]
            assert held == [False] + [True] * 5
            with (
                RegistryPool(registry, LAYOUT, secret=SECRET) as cluster,
                HostPool(LAYOUT, 8) as target,
            ):
                cluster.get(keys[1:], target)
                for key in keys[1:]:
                    assert payload(target, key) == payload(source, key)
    # the node unregistered on close
    assert node.registry is not None and node.registry.nodes() == []


def test_a_named_node_keeps_its_blocks_across_a_restart(source: HostPool, shm_dir: Path) -> None:
    name = f"node-{secrets.token_hex(4)}"
    keys = [key_for(i) for i in range(5)]
    registry = MemoryRegistry()
    with (
        StoreNode(4 * MiB, secret=SECRET, name=name, shm_dir=str(shm_dir)) as node,
        tier_for(node) as tier,
    ):
        assert tier.put(keys, source) == 5
    with StoreNode(
        4 * MiB, secret=SECRET, name=name, shm_dir=str(shm_dir), registry=registry
    ) as node:
        node.flush()
        assert all(registry.holders(keys))  # re-published at start
        with tier_for(node) as tier, HostPool(LAYOUT, 8) as target:
            assert tier.contains(keys) == [True] * 5
            tier.get(keys, target)
            for key in keys:
                assert payload(target, key) == payload(source, key)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    """A private directory standing in for /dev/shm (same code path, no leftovers)."""
    return tmp_path


# -- the KV store over a store node, and `tpusync serve` -------------------------------------


def test_tpusync_serve_lends_dram_to_a_kv_store(tmp_path: Path, rng: np.random.Generator) -> None:
    """A real `tpusync serve` child; a prefill store writes its KV through to it; a second
    store with empty DRAM (another engine) loads the prefix from the node and its tokens and
    logits equal the cold run's."""
    from tpusync._src.testing.engine import ToyEngine
    from tpusync._src.testing.model import ModelConfig, init_params
    from tpusync._src.testing.processes import start_store_node, stop_process

    cfg = ModelConfig(**kv_child.MODEL)
    params = init_params(cfg)
    secret = secrets.token_bytes(32)
    proc, ready = start_store_node(tmp_path, secret, 64 * MiB, quiet=False)
    try:
        spec = {
            "model_id": "toy-node",
            "dram": {"capacity_blocks": 32},
            "node": {"address": ready["address"], "secret_hex": secret.hex()},
        }
        prompt = rng.integers(0, cfg.vocab_size, 70).astype(np.int32)
        boundary = 64
        config = kv_child.store_config(spec, cfg)
        prefill = ToyEngine(cfg, config, params=params)
        try:
            cold = prefill.generate(prompt, 3, use_cache=False, save=True, boundary=boundary)
            prefill.wait_saves()
            assert prefill.store is not None and prefill.store.flush(timeout=10)
        finally:
            prefill.close()  # and the node tier its store opened
        config = kv_child.store_config(spec, cfg)
        decode = ToyEngine(cfg, config, params=params)
        try:
            warm = decode.generate(prompt, 3, save=False)
        finally:
            decode.close()
        with RemoteRegistry(ready["registry"], secret=secret) as registry:
            assert [n.addresses for n in registry.nodes()] == [(ready["address"],)]
    finally:
        assert stop_process(proc) == 0  # SIGTERM: a clean shutdown
    assert warm.lookup_tiers == ("node",) * 4
    assert warm.cached_tokens == boundary
    assert warm.tokens.tolist() == cold.tokens.tolist()
    assert kv_child.logits_hex(warm.prefill_logits) == kv_child.logits_hex(cold.prefill_logits)


def test_a_store_opens_without_its_unreachable_node_and_uses_it_once_it_answers(
    rng: np.random.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    """A store node that is down while an engine starts (restarting, say) no longer fails the
    start: the store opens with the node's tier unreached (a miss, no wait), keeps trying in
    the background, and writes through to the node and reads from it once it answers."""
    from tpusync._src.cluster.reconnecting_tier import ReconnectingTier
    from tpusync._src.memory.device_pool import DevicePool
    from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig

    with StoreNode(4 * MiB, secret=SECRET) as probe:
        address = probe.address  # a port just freed: nothing listens on it now
    port = int(address.rpartition(":")[2])
    import jax.numpy as jnp

    from tpusync.cluster import StoreNodeTier

    config = KVStoreConfig(
        model_id="degraded-start",
        block_size=8,
        dram=DramTier(8, populate=False),
        tiers=(StoreNodeTier(address, secret=SECRET, timeout_s=2.0, name="node"),),
    )
    pool = DevicePool(jnp.asarray(rng.standard_normal((16, 8, 4)), jnp.float32))
    tokens = rng.integers(0, 1000, 32).tolist()
    with caplog.at_level(logging.WARNING, "tpusync.cluster"):
        store = KVCacheStore(config, [pool])
    try:
        assert "cannot be reached" in caplog.text and "keeps trying" in caplog.text
        tier = store._stack.tiers[1]  # reaches into the stack: the node's tier, unreached
        assert isinstance(tier, ReconnectingTier) and not tier.connected
        with store.lookup(tokens) as hit:
            assert hit.num_blocks == 0  # a miss, answered at once
        store.save(tokens, [0, 1, 2, 3])  # into DRAM; the node's copy is skipped
        with StoreNode(4 * MiB, secret=SECRET, port=port) as node:
            assert tier.wait_connected(timeout=60)
            # the store rested the tier after the failed write-through (1 s, doubling): saves
            # reach the node once that rest is over
            deadline = time.monotonic() + 60
            while not sum(p.used for p in node.server.pools):
                assert time.monotonic() < deadline, "no save reached the node"
                later = rng.integers(0, 1000, 32).tolist()
                store.save(later, [4, 5, 6, 7])
                assert store.flush(timeout=30)
                time.sleep(0.2)
            with KVCacheStore(config, [pool]) as other, other.lookup(later) as hit:
                assert hit.tiers == ("node",) * 4  # another engine's store reads them there
    finally:
        store.close()


@pytest.mark.parametrize(
    "text, expected",
    [("64MiB", 64 * MiB), ("1g", 1 << 30), ("1.5GiB", 3 << 29), ("4096", 4096), ("2 kB", 2048)],
)
def test_sizes_parse(text: str, expected: int) -> None:
    from tpusync._src.serve import parse_size

    assert parse_size(text) == expected


def test_secret_files_hold_hex_or_raw_bytes(tmp_path: Path) -> None:
    from tpusync._src.serve import read_secret

    (tmp_path / "hex").write_text("ab" * 32 + "\n")
    (tmp_path / "raw").write_bytes(b"\x00\xffraw secret bytes!")
    for name in ("hex", "raw"):
        (tmp_path / name).chmod(0o600)
    assert read_secret(str(tmp_path / "hex")) == b"\xab" * 32
    assert read_secret(str(tmp_path / "raw")) == b"\x00\xffraw secret bytes!"
    with pytest.raises(InvalidArgumentError, match="--secret-file"):
        read_secret(str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dram", "lots"], "--dram: expected a size"),
        (["--dram", "64MiB", "--host", "0.0.0.0"], "--tls-cert and --tls-key, or pass --insecure"),
        (["--dram", "64MiB", "--registry", "http://x"], "--registry: expected"),
        (["--dram", "64MiB", "--tls-cert", "c.pem"], "--tls-cert, --tls-key"),
        (["--dram", "64MiB", "--disk", "/tmp", "--disk-size", "0"], "--disk-size: expected"),
        (["--dram", "64MiB", "--lease-max", "0"], "--lease-max: expected seconds"),
        (["--dram", "64MiB", "--lease-max", "5"], "--lease-max: expected at least"),
    ],
)
def test_serve_refuses_bad_arguments_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from tpusync._src.serve import main

    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    root_handlers = list(logging.getLogger().handlers)
    assert main([*args, "--secret-file", str(secret)]) == 2  # argparse's code for bad usage
    assert message in capsys.readouterr().err
    # a refused start changes nothing process-wide (this runs inside the test session)
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert logging.getLogger().handlers == root_handlers
