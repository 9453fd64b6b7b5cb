"""Pulls from a block server on this host read its named /dev/shm pool file directly
(tpusync._src.cluster.dataplane.local_reads): real pools, servers and sockets, random bits. The
bytes land exactly where a TCP pull puts them; a damaged slot is a miss; a server that
advertises a file this process must not read, or slots outside it, is pulled from over TCP;
a restarted server's new file is mapped again."""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_pull_scattered import KEYS, LAYOUT, SECRET, SIZE, Places, payload

from tpusync import options
from tpusync._src.cluster.dataplane import local_reads
from tpusync._src.cluster.dataplane.local_reads import PoolFileReader, block_regions, boot_id
from tpusync._src.tiers.scatter import Scatter
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    MemoryRegistry,
    NodeInfo,
    RegistryPool,
    RegistryTier,
    StoreNode,
    StoreNodePool,
)
from tpusync.errors import InvalidArgumentError, PeerUnavailableError
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout


def fill(pool: HostPool, keys: list[bytes], rng: np.random.Generator) -> None:
    reservation = pool.reserve(keys)
    for slot in reservation.slots.tolist():
        with pool.slot_memory(slot) as memory:
            memory[:SIZE] = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    pool.commit(reservation, pool.hash_slots(reservation.slots))


@pytest.fixture
def named(tmp_path: Path, rng: np.random.Generator) -> Iterator[HostPool]:
    """A named pool (in a directory of the test's: /dev/shm by default) holding random blocks
    under KEYS, in random slots."""
    with HostPool(LAYOUT, 3 * len(KEYS), name="served", shm_dir=tmp_path) as pool:
        fill(pool, [b"filler-%d" % i for i in range(len(KEYS))], rng)  # KEYS not in slots 0..
        pool.delete([b"filler-%d" % i for i in range(0, len(KEYS), 2)])
        fill(pool, KEYS, rng)
        yield pool


def test_a_pull_from_a_named_pool_on_this_host_reads_its_file(
    named: HostPool, rng: np.random.Generator
) -> None:
    with (
        BlockServer(named, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as local,
        BlockClient(server.address, secret=SECRET, same_host=False) as tcp,
    ):
        for _ in range(3):
            places, again = Places(rng, len(KEYS)), None
            assert local.pull_scattered(KEYS, LAYOUT, places.scatter) == [True] * len(KEYS)
            want = places.expected({i: payload(named, k) for i, k in enumerate(KEYS)})
            assert np.array_equal(places.arena, want)  # and nothing outside the runs moved
            again = Places(rng, len(KEYS))
            assert tcp.pull_scattered(KEYS, LAYOUT, again.scatter) == [True] * len(KEYS)
        assert local.local_blocks == 3 * len(KEYS)
        assert tcp.local_blocks == 0


def test_a_pull_into_a_pool_reads_the_file_too(named: HostPool, rng: np.random.Generator) -> None:
    with (
        BlockServer(named, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
        HostPool(LAYOUT, len(KEYS) + 1) as target,
    ):
        result = client.pull_result([*KEYS, b"absent"], target)
        assert result.loaded == [True] * len(KEYS) + [False]
        assert result.local_blocks == len(KEYS) and result.bytes_received == 0
        for key in KEYS:
            assert np.array_equal(payload(target, key), payload(named, key))
        pinned = target.pin(KEYS)  # committed with the checksums the lease named
        assert np.array_equal(pinned.checksums, target.hash_slots(pinned.slots))
        target.unpin(pinned)


def test_the_file_is_mapped_before_the_first_pull(tmp_path: Path, rng: np.random.Generator) -> None:
    """A client maps the server's file at connection, and its pages in the background: the
    first pull then takes no page faults in this process (without that, one per 64 KiB at
    least: the kernel maps a file's pages in small batches)."""
    layout = PoolLayout("warm", (ArrayLayout("kv", "uint8", (1 << 20,), 0, 1),))
    keys = [b"block-%d" % i for i in range(48)]
    arena = rng.integers(0, 256, len(keys) << 20, dtype=np.uint8)  # its pages already written
    scatter = Scatter(
        np.arange(len(keys) + 1),
        np.zeros(len(keys), dtype=np.int64),
        arena.ctypes.data + (np.arange(len(keys), dtype=np.uint64) << np.uint64(20)),
    )
    with (
        HostPool(layout, 64, name="warm", shm_dir=tmp_path) as pool,
        BlockServer(pool, secret=SECRET) as server,
    ):
        for key in keys:
            reservation = pool.reserve([key])
            with pool.slot_memory(int(reservation.slots[0])) as memory:
                memory[: 1 << 20] = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
            pool.commit(reservation, pool.hash_slots(reservation.slots))
        with BlockClient(server.address, secret=SECRET) as client:
            reader = client.pool_file
            assert reader is not None and reader._warming is not None
            reader._warming.join(timeout=20)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            assert client.pull_scattered(keys, layout, scatter) == [True] * len(keys)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            assert client.local_blocks == len(keys)
        for i, key in enumerate(keys):
            assert np.array_equal(arena[i << 20 : (i + 1) << 20], payload(pool, key))
    assert faults < (len(keys) << 20) // (64 << 10) // 4


def test_each_reason_to_fall_back_is_logged_once(
    tmp_path: Path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tpusync-gone.pool"
    advert = {"path": str(path), "boot_id": boot_id(), "uid": os.geteuid(), "dev": 1, "ino": 2}
    reader = PoolFileReader(advert, LAYOUT.fingerprint)
    places = Places(rng, 1)
    slots, sums = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.uint64)
    with caplog.at_level("WARNING", logger="tpusync._src.cluster.dataplane.local_reads"):
        for _ in range(2):
            assert reader.land(LAYOUT, slots, sums, places.scatter) is None  # no such file
        path.write_bytes(b"x" * 4096)
        path.chmod(0o600)
        for _ in range(2):
            assert reader.land(LAYOUT, slots, sums, places.scatter) is None  # not the server's
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert "cannot open it" in said[0] and "not the server's" in said[1]
    reader.close()


@pytest.mark.parametrize("window_blocks", [0, 4], ids=["one copy", "windows of 4"])
def test_a_damaged_slot_is_a_miss(
    named: HostPool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, window_blocks: int
) -> None:
    if window_blocks:  # the victim in the second window
        monkeypatch.setattr(local_reads, "LAND_WINDOW_BYTES", window_blocks * SIZE)
    victim = KEYS[5]
    slot = named.slot_of(victim)
    assert slot is not None
    with named.slot_memory(slot) as memory:
        memory[SIZE // 3] ^= 0x10  # the record keeps the old checksum
    places = Places(rng, len(KEYS))
    with (
        BlockServer(named, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
    ):
        loaded, corrupt = client.pull_scattered_counted(KEYS, LAYOUT, places.scatter)
    assert loaded == [k != victim for k in KEYS] and corrupt == 1
    good = {i: payload(named, k) for i, k in enumerate(KEYS) if k != victim}
    want = places.expected(good)
    for i in good:
        for r in range(places.first[i], places.first[i + 1]):
            span = slice(places.place[r], places.place[r] + places.lengths[r])
            assert np.array_equal(places.arena[span], want[span])


class Advertising(BlockServer):
    """A server whose hello advertises ``local`` (or whose leases name ``slots``) as told."""

    local: Any = None
    slots: Callable[[list[int]], Any] | None = None

    def _hello(self, params: dict[str, Any], served: Any) -> tuple[dict[str, Any], Any]:
        answer, served = super()._hello(params, served)
        if self.local is not None:
            answer["local"] = self.local(answer.get("local"))
        return answer, served

    def _acquire(self, served: Any, params: dict[str, Any]) -> dict[str, Any]:
        answer = super()._acquire(served, params)
        if self.slots is not None and "slots" in answer:
            answer["slots"] = self.slots(answer["slots"])
        return answer


def other_layout_pool(tmp_path: Path) -> Path:
    other = PoolLayout("other", (ArrayLayout("w", "float32", (SIZE // 4,), 0, 1),))
    with HostPool(other, 4, name="other", shm_dir=tmp_path) as pool:
        path = pool.path
    assert path is not None
    return path


@pytest.mark.parametrize(
    "lie",
    [
        "not a pool",
        "not a pool's name",
        "symlink",
        "fifo",
        "other layout",
        "another file of that name",
        "nul in the path",
        "other boot",
        "other uid",
        "relative",
        "not a dict",
        "slots out of range",
        "slots malformed",
    ],
)
def test_a_file_or_slots_this_process_must_not_read_go_over_tcp(
    named: HostPool, rng: np.random.Generator, tmp_path: Path, lie: str
) -> None:
    server = Advertising(named, secret=SECRET)
    real = str(named.path)

    def file(path: Path) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """The advert naming ``path``, with its own device and inode (no link followed)."""
        info = os.lstat(path)
        return lambda a: {**a, "path": str(path), "dev": info.st_dev, "ino": info.st_ino}

    junk = tmp_path / "tpusync-junk.pool"
    junk.write_bytes(rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    if lie == "not a pool":
        server.local = file(junk)
    elif lie == "not a pool's name":
        os.link(real, tmp_path / "secrets.txt")  # the very pool, under another name
        server.local = file(tmp_path / "secrets.txt")
    elif lie == "symlink":
        (tmp_path / "tpusync-link.pool").symlink_to(real)
        server.local = file(tmp_path / "tpusync-link.pool")
    elif lie == "fifo":
        os.mkfifo(tmp_path / "tpusync-fifo.pool", 0o600)
        server.local = file(tmp_path / "tpusync-fifo.pool")
    elif lie == "other layout":
        server.local = file(other_layout_pool(tmp_path))
    elif lie == "another file of that name":  # e.g. a container's own /dev/shm
        server.local = lambda a: {**a, "ino": a["ino"] + 1}
    elif lie == "nul in the path":
        server.local = lambda a: {**a, "path": real + "\x00x"}
    elif lie == "other boot":
        server.local = lambda a: {**a, "boot_id": "another-boot"}
    elif lie == "other uid":
        server.local = lambda a: {**a, "uid": os.geteuid() + 1}
    elif lie == "relative":
        server.local = lambda a: {**a, "path": os.path.relpath(real)}
    elif lie == "not a dict":
        server.local = lambda a: [real]
    elif lie == "slots out of range":
        server.slots = lambda s: [named.capacity + 7] * len(s)
    else:
        server.slots = lambda s: ["0"] * len(s)
    places = Places(rng, len(KEYS))
    with server, BlockClient(server.address, secret=SECRET) as client:
        assert client.pull_scattered(KEYS, LAYOUT, places.scatter) == [True] * len(KEYS)
        assert client.local_blocks == 0
    want = places.expected({i: payload(named, k) for i, k in enumerate(KEYS)})
    assert np.array_equal(places.arena, want)


@pytest.mark.parametrize(("threads", "window_blocks"), [(1, 0), (3, 0), (5, 0), (8, 0), (3, 2)])
def test_the_copy_split_over_threads_lands_every_byte(
    named: HostPool,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    threads: int,
    window_blocks: int,
) -> None:
    """Seven blocks over 1 to 8 copy threads (uneven shares, and more threads than blocks),
    in one copy or in windows of 2 blocks (2, 2, 2 and 1)."""
    if window_blocks:
        monkeypatch.setattr(local_reads, "LAND_WINDOW_BYTES", window_blocks * SIZE)
    keys = KEYS[:7]
    with (
        options.overridden(copy_threads=threads),
        BlockServer(named, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
    ):
        places = Places(rng, len(keys))
        assert client.pull_scattered(keys, LAYOUT, places.scatter) == [True] * len(keys)
        assert client.local_blocks == len(keys)
    want = places.expected({i: payload(named, k) for i, k in enumerate(keys)})
    assert np.array_equal(places.arena, want)


def test_a_lease_that_lapsed_keeps_nothing(named: HostPool, rng: np.random.Generator) -> None:
    """The release answers False (the lease was not held the whole time): the blocks copied
    from the file are all discarded, as over TCP."""

    class Lapsing(BlockServer):
        def _handlers(self, served: Any) -> dict[str, Callable[[dict[str, Any]], Any]]:
            return {**super()._handlers(served), "release": lambda p: False}

    places = Places(rng, len(KEYS))
    with (
        Lapsing(named, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
        HostPool(LAYOUT, len(KEYS)) as target,
    ):
        assert client.pull_scattered(KEYS, LAYOUT, places.scatter) == [False] * len(KEYS)
        result = client.pull_result(KEYS, target)
        assert result.loaded == [False] * len(KEYS) and not result.released
        assert client.local_blocks == 0 and result.local_blocks == 0
        assert target.contains(KEYS) == [False] * len(KEYS)  # nothing committed


def test_a_closed_reader_reads_nothing(named: HostPool, rng: np.random.Generator) -> None:
    with BlockServer(named, secret=SECRET) as server:
        client = BlockClient(server.address, secret=SECRET)
        places = Places(rng, len(KEYS))
        assert client.pull_scattered(KEYS, LAYOUT, places.scatter) == [True] * len(KEYS)
        reader = client.pool_file
        assert reader is not None
        client.close()
        pinned = named.pin(KEYS)
        named.unpin(pinned)
        assert reader.land(LAYOUT, pinned.slots, pinned.checksums, places.scatter) is None
        with pytest.raises(InvalidArgumentError, match="closed"):
            client.pull_scattered(KEYS, LAYOUT, places.scatter)


def test_closing_the_client_cuts_a_copy_from_the_file_short(
    named: HostPool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy from the file looks between windows whether its reader is being closed: closed
    during the first window (of one block here), the pull stops after it, as a TCP pull of a
    closed client fails, and the file is unmapped."""
    monkeypatch.setattr(local_reads, "LAND_WINDOW_BYTES", SIZE)
    windows: list[int] = []
    closers: list[threading.Thread] = []
    with BlockServer(named, secret=SECRET) as server:
        client = BlockClient(server.address, secret=SECRET)
        reader = client.pool_file
        assert reader is not None
        original = reader._copy

        def close_during_the_first(regions: Any, blocks: int, pieces: int) -> Any:
            windows.append(blocks)
            if len(windows) == 1:
                closers.append(threading.Thread(target=client.close))
                closers[0].start()
                assert reader._closing.wait(10)  # close() now waits for this copy
            return original(regions, blocks, pieces)

        reader._copy = close_during_the_first  # type: ignore[method-assign]
        places = Places(rng, len(KEYS))
        try:
            with pytest.raises(PeerUnavailableError, match="closed during the copy"):
                client.pull_scattered(KEYS, LAYOUT, places.scatter)
        finally:
            for closer in closers:
                closer.join(10)
        assert windows == [1]
        assert reader._mapped is None and not closers[0].is_alive()


def test_lying_slots_inside_the_file_are_misses(named: HostPool, rng: np.random.Generator) -> None:
    """Slots that exist but hold other blocks: the bytes fail the lease's checksums."""
    server = Advertising(named, secret=SECRET)
    server.slots = lambda s: [s[0]] * len(s)
    places = Places(rng, len(KEYS))
    with server, BlockClient(server.address, secret=SECRET) as client:
        loaded, corrupt = client.pull_scattered_counted(KEYS, LAYOUT, places.scatter)
    assert loaded == [True] + [False] * (len(KEYS) - 1) and corrupt == len(KEYS) - 1


def test_a_named_store_node_is_read_from_its_file_also_after_a_restart(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A store node with a name keeps its DRAM in a pool file (/dev/shm by default): a
    consumer on this host reads its blocks from there, and from the new file of the node
    restarted on the same port."""
    node = StoreNode(64 << 20, secret=SECRET, name="node", shm_dir=str(tmp_path))
    port = int(node.address.rsplit(":", 1)[1])
    with HostPool(LAYOUT, len(KEYS)) as source:
        fill(source, KEYS, rng)
        try:
            for restarted in (False, True):
                if restarted:
                    node.close()
                    for path in tmp_path.glob("tpusync-node-*.pool"):
                        path.unlink()  # the next node makes a new file
                    node = StoreNode(
                        64 << 20, secret=SECRET, name="node", shm_dir=str(tmp_path), port=port
                    )
                with StoreNodePool(node.address, layout=LAYOUT, secret=SECRET) as tier:
                    assert tier.put(KEYS, source) == len(KEYS)
                    places = Places(rng, len(KEYS))
                    assert tier.get_scattered(KEYS, places.scatter) == [True] * len(KEYS)
                    assert tier.client.local_blocks == len(KEYS)
                want = places.expected({i: payload(source, k) for i, k in enumerate(KEYS)})
                assert np.array_equal(places.arena, want)
        finally:
            node.close()


@pytest.mark.parametrize("same_host", [True, False], ids=["file", "tcp"])
def test_a_registry_pool_reads_a_peer_on_this_host_from_its_file(
    named: HostPool, rng: np.random.Generator, same_host: bool
) -> None:
    registry = MemoryRegistry()
    with BlockServer(named, secret=SECRET) as server:
        registry.register(NodeInfo("peer", addresses=(server.address,)), ttl_s=60)
        registry.publish("peer", KEYS, "dram")
        places = Places(rng, len(KEYS))
        with RegistryPool(registry, LAYOUT, secret=SECRET, same_host=same_host) as cluster:
            assert cluster.get_scattered(KEYS, places.scatter) == [True] * len(KEYS)
            read = cluster.local_blocks
        assert cluster.local_blocks == read  # kept after its clients closed
        assert np.array_equal(
            places.arena, places.expected({i: payload(named, k) for i, k in enumerate(KEYS)})
        )
        assert read == (len(KEYS) if same_host else 0)
    with pytest.raises(InvalidArgumentError, match="same_host"):
        RegistryTier(registry, same_host="no")  # type: ignore[arg-type]


def test_same_host_must_be_a_bool(named: HostPool) -> None:
    with (
        BlockServer(named, secret=SECRET) as server,
        pytest.raises(InvalidArgumentError, match="same_host"),
    ):
        BlockClient(server.address, secret=SECRET, same_host="yes")  # type: ignore[arg-type]


def test_regions_follow_pieces_and_runs(rng: np.random.Generator) -> None:
    """Each piece of each block is one stream of regions in payload order, split where a run
    starts; a run landing nowhere is hashed from the source only."""
    n = 5
    places = Places(rng, n)
    addresses = np.arange(n, dtype=np.int64) * 100_000 + 1_000_000
    sources, targets, lengths, ends = block_regions(LAYOUT, places.scatter, addresses)
    offsets, piece_lengths = LAYOUT.piece_table
    assert len(ends) == n * len(offsets) and ends[-1] == len(sources)
    starts = np.concatenate(([0], ends[:-1]))
    for g, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        block, piece = divmod(g, len(offsets))
        first = addresses[block] + offsets[piece]
        assert int(sources[a]) == first and int(lengths[a:b].sum()) == piece_lengths[piece]
        assert np.array_equal(sources[a + 1 : b], (sources[a:b] + lengths[a:b])[:-1])
    scatter = Scatter(np.arange(n + 1), np.zeros(n, np.int64), np.zeros(n, np.uint64))
    _, targets, _, _ = block_regions(LAYOUT, scatter, addresses)
    assert not targets.any()
