"""Weight sync in one process over real sockets and a real /dev/shm pool: Publisher (8x1) ->
Subscriber (2x4, 4x2, 1x8), bit for bit, through the same-host path and the data plane; the
streaming checksum; damaged chunks (in the pool, in flight); held versions; deadlines; in-place
pulls; the KV store's weight version following a commit; bad input refused before any chunk
moves. The multi-process cases are in test_weights_processes.py."""

from __future__ import annotations

import contextlib
import itertools
import re
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tools import self_signed_tls

from tpusync import DevicePool
from tpusync._native import core as _core
from tpusync._src.cluster.dataplane.local_reads import PoolFileReader, block_regions
from tpusync._src.testing.weights_procs import leaf_bytes, np_dtype, tree_spec
from tpusync._src.tiers.blocks import slot_checksums
from tpusync._src.weights._stream import Rows, scatter_runs
from tpusync._src.weights.manifest import Manifest, announcement_key, chunk_key, chunk_layout
from tpusync.cluster import BlockClient, MemoryRegistry
from tpusync.errors import (
    AuthenticationError,
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    TierFullError,
    VersionUnavailableError,
    WeightSyncError,
)
from tpusync.kv import DramTier, KVStoreConfig
from tpusync.tiers import Scatter
from tpusync.weights import (
    Publisher,
    Subscriber,
    TlsOptions,
    WeightsClientOptions,
    WeightsPoolOptions,
    WeightsServerOptions,
)

SECRET = secrets.token_bytes(32)
CHUNK = 1 << 16
POOL = WeightsPoolOptions(chunk_bytes=CHUNK, keep=2)
NETWORK = WeightsClientOptions(same_host=False)


def _mesh(shape: tuple[int, int]) -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("x", "y"))


def _spec(shape: tuple[int, ...], mesh: tuple[int, int]) -> P:
    if mesh == (1, 8):
        return P()
    return P("x", "y") if len(shape) == 2 else P("x")


def _params(version: int, leaves: int = 24, mesh: tuple[int, int] = (8, 1)) -> dict[str, Any]:
    m = _mesh(mesh)
    out = {}
    for i, (path, shape, dtype) in enumerate(tree_spec(leaves)):
        raw = np.frombuffer(leaf_bytes(7, version, i, shape, dtype), np_dtype(dtype))
        out[path] = jax.device_put(raw.reshape(shape), NamedSharding(m, _spec(shape, mesh)))
    return out


def _target(mesh: tuple[int, int], leaves: int = 24) -> dict[str, Any]:
    m = _mesh(mesh)
    return {
        path: jax.ShapeDtypeStruct(
            shape, np_dtype(dtype), sharding=NamedSharding(m, _spec(shape, mesh))
        )
        for path, shape, dtype in tree_spec(leaves)
    }


def _same_bits(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k


@pytest.fixture
def publisher(shm_names: Any) -> Iterator[Publisher]:
    with Publisher(shm_names(), secret=SECRET, pool=POOL) as pub:
        yield pub


@given(
    data=st.binary(min_size=1, max_size=200_000),
    cuts=st.lists(st.integers(0, 200_000), max_size=6),
    written=st.lists(st.booleans(), min_size=7, max_size=7),
)
@settings(max_examples=40, deadline=None)
def test_copy_sum64_streams_copies_and_hashes_what_it_wrote(data, cuts, written):
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    bounds = sorted({0, len(buf), *(c for c in cuts if c < len(buf))})
    spans = list(itertools.pairwise(bounds))
    out = np.zeros(len(buf), dtype=np.uint8)
    sources = np.array([buf.ctypes.data + a for a, _ in spans], dtype=np.uint64)
    targets = np.array(
        [out.ctypes.data + a if written[i] else 0 for i, (a, _) in enumerate(spans)],
        dtype=np.uint64,
    )
    lengths = np.array([b - a for a, b in spans], dtype=np.uint64)
    got = _core.copy_sum64_streams(sources, targets, lengths, np.array([len(spans)], np.int64))
    assert int(got[0]) == _core.sum64(data)
    for i, (a, b) in enumerate(spans):
        assert (out[a:b] == (buf[a:b] if written[i] else 0)).all()


@given(
    n_chunks=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 4 * 4096), max_size=20),
    taken=st.lists(st.booleans(), min_size=25, max_size=25),
)
@settings(max_examples=60, deadline=None)
def test_rows_of_part_of_a_chunk_land_and_the_whole_chunk_is_checked(n_chunks, cuts, taken):
    """Rows that cover only part of some chunks (a process that needs part of an array), copied
    from a pool file's chunks as a same-host pull does (the scatter the subscriber hands its
    client, the regions the client copies): the rows' bytes are copied, nothing else is, and
    each chunk's checksum is that of the whole chunk."""
    C = 4096
    stream = np.random.default_rng(len(cuts)).integers(0, 256, n_chunks * C, dtype=np.uint8)
    bounds = sorted({0, n_chunks * C, *(c for c in cuts if c < n_chunks * C)})
    bounds = sorted({*bounds, *range(0, n_chunks * C, C)})
    spans = [(a, b) for i, (a, b) in enumerate(itertools.pairwise(bounds)) if taken[i % 25]]
    out = np.zeros(len(stream), dtype=np.uint8)
    rows = Rows(
        np.array([a for a, _ in spans], dtype=np.int64),
        np.array([out.ctypes.data + a for a, _ in spans], dtype=np.int64),
        np.array([b - a for a, b in spans], dtype=np.int64),
    )
    if not len(rows):
        return
    chunks = np.unique(rows.offset // C)
    scatter = Scatter(*scatter_runs(rows, chunks, C))
    regions = block_regions(chunk_layout("t", C), scatter, stream.ctypes.data + chunks * C)
    got = slot_checksums(_core.copy_sum64_streams(*regions).reshape(len(chunks), -1))
    want = [_core.xxh64_rows(np.array([[_core.sum64(stream[c * C : (c + 1) * C])]], "<u8"))[0]
            for c in chunks.tolist()]  # fmt: skip
    assert got.tolist() == [int(w) for w in want]
    expect = np.zeros_like(out)
    for a, b in spans:
        expect[a:b] = stream[a:b]
    assert (out == expect).all()


@pytest.mark.parametrize("mesh", [(2, 4), (4, 2), (1, 8)])
@pytest.mark.parametrize("same_host", [True, False], ids=["shm", "network"])
def test_a_version_lands_bit_for_bit_in_another_mesh(publisher, mesh, same_host):
    params = _params(1)
    publisher.publish(params, 1)
    target = _target(mesh)
    client = WeightsClientOptions(same_host=same_host)
    with Subscriber(
        publisher.name, target, secret=SECRET, address=publisher.address, client=client
    ) as sub:
        report = sub.pull(1)
        assert (report.chunks_local > 0) == same_host
        assert (report.chunks_network > 0) != same_host
        assert report.chunks_retried == 0
        got = sub.commit()
        _same_bits(got, params)
        for k in target:
            assert got[k].sharding == target[k].sharding
        # references only (microseconds when idle; `tpusync bench weights` measures it): the
        # bound is a margin for a loaded machine, where one GIL switch costs 5 ms
        assert sub.last_commit_seconds < 0.1
        params2 = _params(2)
        publisher.publish(params2, 2)
        got2 = sub.update(2)
        _same_bits(got2, params2)
        _same_bits(got, params)  # the earlier version's arrays are untouched


def test_registry_finds_the_publisher_and_kept_versions(shm_names):
    registry = MemoryRegistry()
    with Publisher(shm_names(), secret=SECRET, registry=registry, pool=POOL) as pub:
        versions = {v: _params(v) for v in (1, 2, 3)}
        for v, params in versions.items():
            pub.publish(params, v)
        assert pub.versions == [2, 3]
        with Subscriber(pub.name, _target((2, 4)), secret=SECRET, registry=registry) as sub:
            with pytest.raises(VersionUnavailableError, match=r"not announced|not published"):
                sub.pull(1)  # dropped: keep=2
            _same_bits(sub.update(2), versions[2])  # a late joiner takes an older kept one
            _same_bits(sub.update(3), versions[3])
            with pytest.raises(InvalidArgumentError, match="not above the committed"):
                sub.pull(2)
            with pytest.raises(VersionUnavailableError):
                sub.pull(4)
            assert sub.version == 3
    assert registry.nodes() == []


def test_a_held_version_is_not_dropped(publisher):
    for v in (1, 2):
        publisher.publish(_params(v), v)
    with BlockClient(publisher.address, secret=SECRET) as client:
        with client.hold([announcement_key(publisher.name, 1)]) as held:
            assert held.present == [True]
            publisher.publish(_params(3), 3)  # 1 is beyond keep=2, but held
            assert publisher.versions == [2, 3]
            assert client.contains([announcement_key(publisher.name, 1)]) == [True]
            with Subscriber(publisher.name, _target((4, 2)), secret=SECRET,
                            address=publisher.address) as sub:  # fmt: skip
                _same_bits(sub.update(1), _params(1))
        publisher.publish(_params(4), 4)  # released: dropped now
        assert client.contains(
            [announcement_key(publisher.name, 1), chunk_key(publisher.name, 1, 0)]
        ) == [False, False]


def test_a_chunk_damaged_in_the_pool_fails_the_pull_and_keeps_the_committed_version(publisher):
    first = _params(1)
    publisher.publish(first, 1)
    sub = Subscriber(publisher.name, _target((2, 4)), secret=SECRET, address=publisher.address)
    with sub:
        committed = sub.update(1)
        publisher.publish(_params(2), 2)
        slot = publisher.pool.slot_of(chunk_key(publisher.name, 2, 1))
        with publisher.pool.slot_memory(slot) as memory:
            memory[100] ^= 0x01
        with pytest.raises(WeightSyncError, match=r"chunks \[1\]"):
            sub.pull(2)
        assert sub.version == 1
        _same_bits(sub.params, first)
        assert sub.params is committed
        with pytest.raises(InvalidArgumentError, match="nothing to commit"):
            sub.commit()


class _FlippingProxy:
    """Forwards TCP to ``target``; when armed, flips one byte of what the server sends once
    ``after`` more bytes went by (a block damaged in flight)."""

    def __init__(self, target: str, after: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.after = after
        self.armed = threading.Event()
        self.flipped = 0
        self.stall_at: int | None = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            self._socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                if down and self.stall_at is not None:
                    self.stall_at -= len(data)
                    while self.stall_at is not None and self.stall_at < 0:
                        time.sleep(0.05)  # held back: the receiver waits
                    if self.stall_at is None:
                        return  # released: this connection's stream is broken, drop it
                if down and self.armed.is_set():
                    with self._lock:
                        if self.after < len(data):
                            data = bytearray(data)
                            data[self.after] ^= 0x40
                            self.armed.clear()
                            self.flipped += 1
                        else:
                            self.after -= len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def stall_after(self, nbytes: int) -> None:
        """From ``nbytes`` on, what the server sends is held back (a stalled publisher)."""
        self.stall_at = nbytes

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            sock.close()


def test_a_chunk_damaged_in_flight_is_fetched_again(publisher):
    params = _params(1)
    publisher.publish(params, 1)
    proxy = _FlippingProxy(publisher.address, after=200_000)
    try:
        client = WeightsClientOptions(same_host=False, connections=1)
        with Subscriber(
            publisher.name, _target((2, 4)), secret=SECRET, address=proxy.address, client=client
        ) as sub:
            proxy.armed.set()
            report = sub.pull(1)
            assert proxy.flipped == 1
            assert report.chunks_retried >= 1
            # each chunk counted once, where it finally came from (every chunk: one process
            # holds all eight devices)
            assert report.chunks_local == 0
            assert report.chunks_network == publisher._chunks[1]
            _same_bits(sub.commit(), params)
    finally:
        proxy.close()


@pytest.mark.parametrize("stall_at", [2_000, 300_000], ids=["manifest", "chunks"])
def test_a_stalled_publisher_fails_the_pull_at_its_deadline(publisher, stall_at):
    publisher.publish(_params(1), 1)
    publisher.publish(_params(2), 2)
    proxy = _FlippingProxy(publisher.address, after=0)
    try:
        client = WeightsClientOptions(same_host=False, timeout_s=30.0)
        with Subscriber(
            publisher.name, _target((2, 4)), secret=SECRET, address=proxy.address, client=client
        ) as sub:
            committed = sub.update(1)
            proxy.stall_after(stall_at)
            start = time.monotonic()
            with pytest.raises(WeightSyncError, match="deadline"):
                sub.pull(2, deadline_s=1.5)
            assert time.monotonic() - start < 5  # not the 30 s socket timeout
            assert sub.version == 1 and sub.params is committed
            proxy.stall_at = None
            _same_bits(sub.update(2), _params(2))  # a new connection goes through
    finally:
        proxy.close()


def test_a_copy_from_the_publishers_file_stops_at_the_deadline(publisher, monkeypatch):
    """On the same host the chunks are copied from the publisher's pool file: the watchdog's
    closing the client cuts that copy short too (here one that would not end by itself)."""
    publisher.publish(_params(1), 1)
    original = PoolFileReader._copy

    def stalled(self: PoolFileReader, *args: Any) -> Any:
        self._closing.wait(30)  # until the reader is being closed
        return original(self, *args)

    monkeypatch.setattr(PoolFileReader, "_copy", stalled)
    with Subscriber(publisher.name, _target((2, 4)), secret=SECRET,
                    address=publisher.address) as sub:  # fmt: skip
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="deadline"):
            sub.pull(1, deadline_s=1.0)
        assert time.monotonic() - start < 5
        assert sub.version is None
        monkeypatch.setattr(PoolFileReader, "_copy", original)
        report = sub.pull(1)  # a new client, the file read again
        assert report.chunks_local > 0
        _same_bits(sub.commit(), _params(1))


def test_a_deadline_fails_the_pull_and_keeps_the_committed_version(publisher):
    publisher.publish(_params(1), 1)
    publisher.publish(_params(2), 2)
    with Subscriber(publisher.name, _target((2, 4)), secret=SECRET,
                    address=publisher.address) as sub:  # fmt: skip
        committed = sub.update(1)
        with pytest.raises(WeightSyncError, match="deadline"):
            sub.pull(2, deadline_s=1e-6)
        assert sub.version == 1 and sub.params is committed
        _same_bits(sub.update(2), _params(2))  # the next try goes through


def test_in_place_pulls_write_into_the_committed_arrays(publisher):
    publisher.publish(_params(1), 1)
    with Subscriber(publisher.name, _target((2, 4)), secret=SECRET, address=publisher.address,
                    in_place=True) as sub:  # fmt: skip
        first = sub.update(1)
        pointers = {k: first[k].addressable_shards[0].data.unsafe_buffer_pointer() for k in first}
        publisher.publish(_params(2), 2)
        second = sub.update(2)
        _same_bits(second, _params(2))
        assert pointers == {
            k: second[k].addressable_shards[0].data.unsafe_buffer_pointer() for k in second
        }
        publisher.publish(_params(3), 3)
        with pytest.raises(WeightSyncError):
            sub.pull(3, deadline_s=1e-6)
        # nothing was written before the deadline here, but an in-place failure is torn
        with pytest.raises(WeightSyncError, match="mix of versions"):
            _ = sub.params
        _same_bits(sub.update(3), _params(3))


def _blocks(store: Any, tokens: np.ndarray) -> int:
    with store.lookup(tokens) as found:
        return found.num_blocks


def test_commit_switches_the_kv_store_weight_version(publisher, stores, rng):
    kv = jax.device_put(rng.standard_normal((8, 16, 2, 4)).astype(np.float32), jax.devices()[0])
    config = KVStoreConfig("m", 16, DramTier(8, populate=False), weight_version="1")
    store = stores(config, [DevicePool(kv)])
    tokens = np.arange(64, dtype=np.int32)
    store.save(tokens, np.arange(4))
    assert _blocks(store, tokens) == 4
    publisher.publish(_params(2), 2)
    with Subscriber(publisher.name, _target((2, 4)), secret=SECRET, address=publisher.address,
                    kv_stores=[store]) as sub:  # fmt: skip
        sub.update(2)
    assert store.namespace.weight_version == "2"
    assert _blocks(store, tokens) == 0  # KV of the old weights is never served


def test_bad_targets_and_secrets_are_refused_before_any_chunk_moves(publisher):
    publisher.publish(_params(1), 1)
    cases: list[tuple[Any, type[Exception], str]] = []
    target = _target((2, 4))
    del target["layer003"]
    cases.append((target, InvalidArgumentError, "structure"))
    target = _target((2, 4))
    target["layer003"] = jax.ShapeDtypeStruct(
        (16, 16), np.float32, sharding=target["layer003"].sharding
    )
    cases.append((target, ShapeMismatchError, "shape"))
    target = _target((2, 4))
    t = target["layer001"]
    target["layer001"] = jax.ShapeDtypeStruct(t.shape, np.int32, sharding=t.sharding)
    cases.append((target, DtypeMismatchError, "dtype"))
    for target, error, match in cases:
        with Subscriber(publisher.name, target, secret=SECRET, address=publisher.address) as sub:
            with pytest.raises(error, match=match):
                sub.pull(1)
            assert sub.version is None and sub._shadow is None
    with pytest.raises(AuthenticationError):
        Subscriber(publisher.name, _target((2, 4)), secret=secrets.token_bytes(32),
                   address=publisher.address).pull(1)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="target"):
        Subscriber(publisher.name, {"a": np.zeros(3)}, secret=SECRET, address=publisher.address)
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        Subscriber(publisher.name, _target((2, 4)), secret=SECRET)
    with pytest.raises(InvalidArgumentError, match="not above"):
        publisher.publish(_params(1), 1)
    with pytest.raises(InvalidArgumentError, match="name"):
        Publisher("../x", secret=SECRET)
    with pytest.raises(InvalidArgumentError, match="params"):
        publisher.publish({"a": [1, 2]}, 5)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: WeightsPoolOptions(keep=0), "keep"),
        (lambda: WeightsPoolOptions(chunk_bytes=5000), "chunk_bytes"),
        (lambda: WeightsPoolOptions(chunk_bytes=CHUNK, capacity_bytes=CHUNK - 1), "capacity"),
        (lambda: WeightsServerOptions(port=70000), "port"),
        (lambda: WeightsServerOptions(lease_ttl_s=0), "lease_ttl_s"),
        (  # a hold's whole life shorter than one grant
            lambda: WeightsServerOptions(lease_ttl_s=10, lease_max_s=5),
            "lease_max_s: expected at least lease_ttl_s",
        ),
        (lambda: WeightsServerOptions(lease_max_s=-1), "lease_max_s"),
        (lambda: WeightsClientOptions(connections=0), "connections"),
        (lambda: WeightsClientOptions(deadline_s=-1.0), "deadline_s"),
        (lambda: WeightsClientOptions(same_host="yes"), "same_host"),
        (lambda: TlsOptions(context="cert.pem"), "context"),
        (lambda: Publisher("w", secret=SECRET, pool={"keep": 1}), "pool: expected a"),
        (lambda: Publisher("w", secret=SECRET, tls=ssl.create_default_context()), "tls:"),
        (
            lambda: Publisher("w", secret=SECRET, server=WeightsServerOptions(host="10.1.2.3")),
            "not a loopback address",
        ),
        (
            lambda: Subscriber("w", {}, secret=SECRET, address="x:1", client=vars(NETWORK)),
            "client: expected a",
        ),
    ],
)
def test_options_are_checked_where_they_are_written(make, match):
    """Each options object refuses a wrong value when it is made; the constructors refuse
    anything but their options class, before a pool, a socket or a thread is made."""
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def test_a_malformed_manifest_is_refused_naming_the_field():
    with pytest.raises(WeightSyncError, match="malformed"):
        Manifest.from_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}xyz", name="w", version=1)
    with pytest.raises(WeightSyncError, match="length field"):
        Manifest.from_bytes((1 << 40).to_bytes(8, "little") + b"{}", name="w", version=1)


def test_over_tls_a_version_lands_and_a_plain_client_is_refused(shm_names, tmp_path):
    server, client = self_signed_tls(tmp_path)
    params = _params(1)
    with Publisher(shm_names(), secret=SECRET, pool=POOL, tls=TlsOptions(server)) as pub:
        pub.publish(params, 1)
        with Subscriber(pub.name, _target((4, 2)), secret=SECRET, address=pub.address,
                        client=NETWORK, tls=TlsOptions(client)) as sub:  # fmt: skip
            report = sub.pull(1)
            assert report.chunks_network > 0
            _same_bits(sub.commit(), params)
        with Subscriber(pub.name, _target((4, 2)), secret=SECRET, address=pub.address,
                        client=WeightsClientOptions(timeout_s=2.0)) as plain:  # fmt: skip
            with pytest.raises(WeightSyncError, match="cannot be reached"):
                plain.pull(1)
            assert plain.version is None


# --- issue 53: a failed publish leaves the publisher as it was --------------------------------


def _pull_exact(pub: Publisher, version: int, params: dict[str, Any], leaves: int) -> None:
    """A subscriber of another mesh pulls ``version`` and gets ``params`` bit for bit."""
    with Subscriber(pub.name, _target((2, 4), leaves), secret=SECRET, address=pub.address) as sub:
        _same_bits(sub.update(version), params)


def _pool_state(pub: Publisher) -> tuple[int, list[bytes], list[int]]:
    assert pub.pool is not None
    return pub.pool.free, sorted(pub.pool.keys()), pub.versions


def test_a_publish_that_does_not_fit_is_refused_before_a_byte_moves(shm_names):
    """The failure of issue 53: the version's chunks fit, its manifest did not. The chunks were
    committed, then stayed (unannounced, never dropped), and every later publish failed, "cannot
    hold 1 more chunks" where 6 were needed. Now the chunks and the manifest are reserved
    together: the publish is refused before anything is staged, saying what it needs and what
    is free, and the publisher goes on with versions of every size that fits."""
    small, large = (lambda v: _params(v, leaves=2)), (lambda v: _params(v, leaves=24))
    n_small, n_large = 1, 5  # chunks of CHUNK bytes (plus one manifest chunk each)
    capacity = (n_small + 1) + n_large  # a kept small version and the large one's chunks only
    pool = WeightsPoolOptions(chunk_bytes=CHUNK, keep=1, capacity_bytes=capacity * CHUNK)
    with Publisher(shm_names(), secret=SECRET, pool=pool) as pub:
        versions = {1: small(1)}
        assert pub.publish(versions[1], 1).chunks == n_small
        before = _pool_state(pub)
        with pytest.raises(TierFullError) as info:
            pub.publish(large(2), 2)
        message = str(info.value)
        assert message.startswith(
            f"version 2 needs {n_large + 1} chunks of {CHUNK} bytes ({n_large} for its "
        )
        assert f"1 for its manifest), the pool has {n_large} of its {capacity} chunks free (" in (
            message
        )
        assert f"{n_small + 1} hold the 1 versions kept, [1])" in message
        assert "sized from WeightsPoolOptions.capacity_bytes and does not grow" in message
        assert f"pool=WeightsPoolOptions(capacity_bytes={3 * (n_large + 1) * CHUNK})" in message
        assert _pool_state(pub) == before, "the refused publish left something in the pool"
        with pytest.raises(TierFullError, match=r"^version 2 needs"):  # again: the same answer
            pub.publish(large(2), 2)
        assert _pool_state(pub) == before
        for v in (2, 3, 4):  # the same size and the versions go on
            versions[v] = small(v)
            pub.publish(versions[v], v)
            _pull_exact(pub, v, versions[v], 2)
        with pytest.raises(TierFullError, match=r"more than the whole pool holds \(7 chunks\)"):
            pub.publish(_params(5, leaves=40), 5)
        assert pub.versions == [4] and pub.pool is not None and pub.pool.free == capacity - 2


@pytest.mark.parametrize("where", ["_stage", "_write_manifest"])
def test_a_publish_that_fails_midway_leaves_nothing(shm_names, monkeypatch, where):
    """A failure while staging the chunks or writing the manifest frees the whole version's
    slots: the same version is then published as if it had not been tried."""
    with Publisher(shm_names(), secret=SECRET, pool=POOL) as pub:
        pub.publish(_params(1), 1)
        before = _pool_state(pub)
        with monkeypatch.context() as patch:
            patch.setattr(pub, where, lambda *a: (_ for _ in ()).throw(OSError("injected")))
            with pytest.raises(OSError, match="injected"):
                pub.publish(_params(2), 2)
        assert _pool_state(pub) == before
        params = _params(2)
        pub.publish(params, 2)
        _pull_exact(pub, 2, params, 24)


def test_a_growing_tree_is_published_or_refused_cleanly(shm_names):
    """A small warm-up version first sizes the pool (keep + 2 of it); the tree then grows. Each
    version fits and is pulled bit for bit, or is refused before a byte moves, saying the
    capacity_bytes that takes versions of its size; a publisher started with it takes them."""
    name = shm_names()
    published: list[int] = []
    refused: dict[int, str] = {}
    with Publisher(name, secret=SECRET, pool=POOL) as pub:
        for version, leaves in enumerate((2, 12, 24, 40, 40, 2, 12), start=1):
            params = _params(version, leaves=leaves)
            before = _pool_state(pub) if pub.pool is not None else None
            try:
                pub.publish(params, version)
            except TierFullError as error:
                refused[version] = str(error)
                assert "does not grow" in str(error) and "first version published" in str(error)
                assert _pool_state(pub) == before
                continue
            published.append(version)
            _pull_exact(pub, version, params, leaves)
        assert published == [1, 2, 3, 6, 7] and sorted(refused) == [4, 5]
        assert pub.versions == [6, 7]
    capacity = int(re.search(r"capacity_bytes=(\d+)", refused[4]).group(1))
    pool = WeightsPoolOptions(chunk_bytes=CHUNK, keep=2, capacity_bytes=capacity)
    with Publisher(name, secret=SECRET, pool=pool) as pub:
        for version in (1, 2, 3, 4):
            params = _params(version, leaves=40)
            pub.publish(params, version)
            _pull_exact(pub, version, params, 40)
