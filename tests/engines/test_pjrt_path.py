"""The native engine on PJRT plugin backends, run against a STAND-IN plugin over CPU memory.

No GPU or TPU here, so ``tests/helpers/pjrt_stand_in.c`` (built with gcc for this module) plays the
plugin: views, raw aliases, DMA registration and copies that complete on a thread of its own,
through the same PJRT C API calls tpusync makes on real hardware. It is bound to the CPU devices
(``engines.pjrt.engine.bind``), so real JAX arrays travel through tpusync's PJRT engine: segment
tables, views, event callbacks, host-side checksums, error and leak handling. The ABI itself is
proven against real plugin tables (test_pjrt_plugins.py) and on a GPU (benchmarks/gpu_transfer.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from device_model import keys_for, load, make_model, store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from paths import HELPERS, REPO

import tpusync
from tpusync import options
from tpusync._native import core as _core
from tpusync._src.engines.devices import device_path
from tpusync._src.engines.pjrt import engine as pjrt
from tpusync.errors import NativePathUnavailableError, TpuSyncError
from tpusync.tiers import HostPool

REPO = REPO
TIMEOUT = 30.0
BF16 = np.dtype(ml_dtypes.bfloat16)
COUNTERS = ("live_events", "live_views", "live_raw")


class StandIn:
    """The built stand-in plugin: its table and client as tpusync sees them, and its hooks."""

    mode = "staged"  # or "direct": see the stand_in fixture

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.stand_in_counter.restype = ctypes.c_long
        self.lib.stand_in_counter.argtypes = [ctypes.c_char_p]
        hooks = (
            "stand_in_refuse_copy",
            "stand_in_fail_copy",
            "stand_in_delay_us",
            "stand_in_corrupt",
        )
        for hook in hooks:
            getattr(self.lib, hook).argtypes = [ctypes.c_long]
        self.lib.stand_in_set_writes.argtypes = [ctypes.c_int]
        self.api = _core.PjrtApi.from_library(str(library))
        self.client = self.api.try_create_client()

    def count(self, name: str) -> int:
        value = int(self.lib.stand_in_counter(name.encode()))
        assert value >= 0, f"unknown counter {name}"
        return value

    def bind(self, *, writes: bool = True, auto: bool = True) -> None:
        self.lib.stand_in_set_writes(int(writes))
        pjrt.bind("cpu", self.api, self.client, "stand-in PJRT plugin", auto=auto)

    def reset(self) -> None:
        self.lib.stand_in_corrupt(0)
        self.lib.stand_in_refuse_copy(0)
        self.lib.stand_in_fail_copy(0)
        self.lib.stand_in_delay_us(0)

    def assert_nothing_live(self) -> None:
        assert {name: self.count(name) for name in COUNTERS} == dict.fromkeys(COUNTERS, 0)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> StandIn:
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "the stand-in plugin needs a C compiler (gcc)"
    library = tmp_path_factory.mktemp("pjrt") / "stand_in.so"
    subprocess.run(
        [compiler, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread",
         "-I", str(REPO / "include"), "-o", str(library), str(HELPERS / "pjrt_stand_in.c")],
        check=True, timeout=120,
    )  # fmt: skip
    return StandIn(library)


@pytest.fixture(params=["staged", "direct"])
def stand_in(built: StandIn, request: pytest.FixtureRequest) -> Iterator[StandIn]:
    """The stand-in bound to the CPU devices for one test; unbound (and checked for leaks)
    afterwards. Each test runs twice: with small reads gathered on the device first (the
    default) and with every row its own plugin copy."""
    built.mode = request.param
    staging = 0 if request.param == "direct" else options.current().pjrt_stage_below
    restore = options.set_current(dataclasses.replace(options.current(), pjrt_stage_below=staging))
    built.reset()
    built.bind()
    for device in jax.devices():  # each device's self-test runs before the test's copies
        assert device_path(device).engine == "pjrt"
    try:
        yield built
        built.assert_nothing_live()
    finally:
        built.reset()
        pjrt.unbind("cpu")
        options.set_current(restore)


def put(x: np.ndarray, target: Any = None) -> jax.Array:
    return jax.device_put(np.array(x, copy=True), target or jax.devices()[0])


def bits(x: Any) -> np.ndarray:
    host = np.asarray(x)
    return host.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[host.dtype.itemsize])


def test_info_and_paths_name_the_engine(stand_in):
    path = device_path(jax.devices()[0])
    assert (path.engine, path.native, path.reads, path.writes) == ("pjrt", True, True, True)
    text = str(tpusync.info())
    assert "stand-in PJRT plugin; reads, in-place writes, DMA registration" in text


CASES = [
    # shape, dtype, block axis
    ((16, 4, 8), BF16, 0),
    ((16, 3, 5), np.dtype(ml_dtypes.float8_e4m3fn), 0),
    ((16, 64), np.dtype(ml_dtypes.float8_e5m2), 0),
    ((2, 16, 4, 8), BF16, 1),
    ((16,), np.dtype(np.int8), 0),
    ((16, 2, 2, 3, 2), np.dtype(np.int32), 0),
    ((3, 16, 8), np.dtype(np.float32), 1),
]


@pytest.mark.parametrize(("shape", "dtype", "axis"), CASES, ids=[str(c) for c in CASES])
def test_both_directions_match_the_jax_path(stand_in, arrays, rng, shape, dtype, axis):
    n = shape[axis]
    source = arrays.random(rng, shape, dtype)
    src_blocks = rng.permutation(n)[: n - 3]  # scattered, some left out
    dst_blocks = rng.permutation(n)[: n - 3]
    host_shape = (*shape[:axis], len(src_blocks), *shape[axis + 1 :])
    out = {}
    for path in ("native", "jax"):
        pool = tpusync.DevicePool(put(source))
        host = np.zeros(host_shape, dtype)
        f = tpusync.transfer(
            pool,
            host,
            src_blocks=src_blocks,
            dst_blocks=np.arange(len(src_blocks)),
            block_axis=axis,
            path=path,
        )
        assert f.result(TIMEOUT) == host.nbytes and f.path == path
        incoming = arrays.random(rng, host_shape, dtype)
        g = tpusync.transfer(
            incoming,
            pool,
            src_blocks=np.arange(len(dst_blocks)),
            dst_blocks=dst_blocks,
            block_axis=axis,
            path=path,
        )
        g.result(TIMEOUT)
        out[path] = (host, np.asarray(pool.array).copy(), incoming)
    host, device, incoming = out["native"]
    arrays.assert_same(host, np.take(source, src_blocks, axis=axis), "device->host")
    expected = source.copy()
    index = (slice(None),) * axis + (dst_blocks,)
    expected[index] = incoming
    arrays.assert_same(device, expected, "host->device")
    arrays.assert_same(out["jax"][0], host, "jax path, device->host")
    assert stand_in.count("callbacks_on_worker") > 0  # completion came from the plugin's thread


@given(data=st.data())
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_block_lists(stand_in, arrays, rng, data):
    n = 40
    source = arrays.random(rng, (n, 3, 4), BF16)
    pool = tpusync.DevicePool(put(source))
    src = data.draw(st.lists(st.integers(0, n - 1), max_size=n), label="src")
    dst = data.draw(st.permutations(range(n)), label="dst")[: len(src)]
    host = arrays.random(rng, (n, 3, 4), BF16)
    expected = host.copy()
    expected[np.asarray(dst, dtype=np.int64)] = source[np.asarray(src, dtype=np.int64)]
    tpusync.transfer(pool, host, src_blocks=src, dst_blocks=dst).result(TIMEOUT)
    arrays.assert_same(host, expected, "device->host")
    back = arrays.random(rng, (n, 3, 4), BF16)
    want = np.asarray(pool.array).copy()
    want[np.asarray(dst, dtype=np.int64)] = back[np.asarray(src, dtype=np.int64)]
    tpusync.transfer(back, pool, src_blocks=src, dst_blocks=dst).result(TIMEOUT)
    arrays.assert_same(pool.array, want, "host->device")


@pytest.mark.parametrize(
    "spec", [P(None, "a"), P(None, "a", "b"), P()], ids=["with-replicas", "split", "replicated"]
)
def test_sharded_arrays(stand_in, arrays, rng, mesh, spec):
    source = arrays.random(rng, (8, 4, 6), np.float32)
    sharding = NamedSharding(mesh, spec)
    pool = tpusync.DevicePool(put(source, sharding))
    groups = {}
    for shard in pool.array.addressable_shards:
        groups.setdefault(tuple((s.start, s.stop) for s in shard.index), shard.index)
    order = sorted(groups, key=lambda k: tuple(a for a, _ in k))
    shard_shape = sharding.shard_shape(source.shape)
    host = np.zeros((len(order), *shard_shape), np.float32)
    f = tpusync.transfer(pool, host, path="native")
    f.result(TIMEOUT)
    for i, key in enumerate(order):
        arrays.assert_same(host[i], source[groups[key]], f"shard {i}")
    incoming = arrays.random(rng, host.shape, np.float32)
    tpusync.transfer(incoming, pool, path="native").result(TIMEOUT)
    for shard in pool.array.addressable_shards:  # every replica got its shard
        i = order.index(tuple((s.start, s.stop) for s in shard.index))
        arrays.assert_same(shard.data, incoming[i], f"replica on {shard.device}")


@pytest.mark.parametrize("direction", ["read", "write"])
@pytest.mark.parametrize("failure", ["refused", "failed"])
def test_a_failed_copy_fails_the_transfer_and_leaks_nothing(
    stand_in, arrays, rng, direction, failure
):
    source = arrays.random(rng, (32, 16), np.uint16)
    pool = tpusync.DevicePool(put(source))
    host = np.zeros_like(source)
    order = rng.permutation(32)  # 32 separate copies
    stand_in.lib.stand_in_delay_us(200)  # copies still pending when the failure happens
    # direct: 32 copies, the 5th fails; staged: reads are one merged copy, which fails
    nth = 1 if stand_in.mode == "staged" and direction == "read" else 5
    if failure == "refused":
        stand_in.lib.stand_in_refuse_copy(nth)
    else:
        stand_in.lib.stand_in_fail_copy(nth)
    if direction == "read":
        f = tpusync.transfer(pool, host, src_blocks=order, dst_blocks=np.arange(32))
    else:
        f = tpusync.transfer(host, pool, src_blocks=np.arange(32), dst_blocks=order)
    error = f.exception(TIMEOUT)
    assert isinstance(error, TpuSyncError) and isinstance(error, _core.PjrtError)
    wanted = "injected refusal" if failure == "refused" else "injected copy failure"
    assert wanted in str(error), error
    assert error.code_name == ("RESOURCE_EXHAUSTED" if failure == "refused" else "DATA_LOSS")
    stand_in.assert_nothing_live()  # every issued copy finished; views and aliases freed
    stand_in.reset()
    f = tpusync.transfer(pool, host, src_blocks=order, dst_blocks=np.arange(32))
    f.result(TIMEOUT)  # the engine is usable again
    if direction == "read":
        arrays.assert_same(host, source[order], "after the failure")


def test_pending_copies_are_waited_for(stand_in, arrays, rng):
    source = arrays.random(rng, (64, 1024), np.uint8)
    pool = tpusync.DevicePool(put(source))
    host = np.zeros_like(source)
    stand_in.lib.stand_in_delay_us(500)  # 64 copies x 0.5 ms on the plugin's thread
    names = ("callbacks_on_worker", "callbacks_inline", "copies")
    before = [stand_in.count(n) for n in names]
    order = rng.permutation(64)
    tpusync.transfer(pool, host, src_blocks=order, dst_blocks=np.arange(64)).result(TIMEOUT)
    arrays.assert_same(host, source[order], "after delayed copies")
    on_worker, inline, copies = (stand_in.count(n) - b for n, b in zip(names, before, strict=True))
    # one copy per run of neighbouring blocks (staged: one for all, gathered on the device
    # in destination order), each completed by a callback from the plugin's thread: none was
    # ready when its callback was registered
    assert copies == 1 if stand_in.mode == "staged" else copies > 32, copies
    assert (on_worker, inline) == (copies, 0)


def test_concurrent_transfers(stand_in, arrays, rng):
    stand_in.lib.stand_in_delay_us(50)
    errors: list[BaseException] = []
    sources = [arrays.random(rng, (24, 64), np.int32) for _ in range(4)]
    orders = [rng.permutation(24) for _ in range(4)]

    def work(i: int) -> None:
        try:
            pool = tpusync.DevicePool(put(sources[i]))
            host = tpusync.HostBuffer((24, 64), np.int32)
            for _ in range(5):
                tpusync.transfer(pool, host, src_blocks=orders[i], dst_blocks=np.arange(24)).result(
                    TIMEOUT
                )
                assert np.array_equal(host.array, sources[i][orders[i]])
                tpusync.transfer(host, pool, src_blocks=np.arange(24), dst_blocks=orders[i]).result(
                    TIMEOUT
                )
                assert np.array_equal(np.asarray(pool.array), sources[i])
            host.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_a_plugin_without_in_place_writes(stand_in, arrays, rng):
    stand_in.bind(writes=False)
    path = device_path(jax.devices()[0])
    assert (path.engine, path.native, path.reads, path.writes) == ("pjrt", True, True, False)
    assert "no raw-buffer extension for writes" in path.reason
    read_then_write(arrays, rng, read_path="native", refusal="no in-place writes")


def read_then_write(arrays: Any, rng: Any, *, read_path: str, refusal: str | None = None) -> None:
    """A read with ``path="auto"`` takes ``read_path``, and delivers the bytes; a write runs in
    JAX (and delivers them); asking for a native write is refused (matching ``refusal``)."""
    source = arrays.random(rng, (8, 256), BF16)
    pool = tpusync.DevicePool(put(source))
    host = np.zeros_like(source)
    f = tpusync.transfer(pool, host)
    assert f.path == read_path and f.result(TIMEOUT) == host.nbytes
    arrays.assert_same(host, source, "read")
    incoming = arrays.random(rng, (8, 256), BF16)
    g = tpusync.transfer(incoming, pool)
    assert g.path == "jax"  # auto: the write runs in JAX
    g.result(TIMEOUT)
    arrays.assert_same(pool.array, incoming, "written through JAX")
    with pytest.raises(NativePathUnavailableError, match=refusal):
        tpusync.transfer(incoming, pool, path="native")


def test_unproven_platforms_keep_auto_on_jax(stand_in, arrays, rng):
    stand_in.bind(auto=False)
    path = device_path(jax.devices()[0])
    assert (path.engine, path.native) == ("pjrt", False)
    assert "until proven on this platform's hardware" in path.reason
    source = arrays.random(rng, (8, 16), np.float32)
    pool = tpusync.DevicePool(put(source))
    host = np.zeros_like(source)
    f = tpusync.transfer(pool, host)
    assert f.path == "jax" and f.result(TIMEOUT) == host.nbytes
    f = tpusync.transfer(pool, host, path="native")  # asked for explicitly: it runs
    assert f.path == "native" and f.result(TIMEOUT) == host.nbytes
    with options.overridden(pjrt=True):  # paths are found again for the new options
        assert device_path(jax.devices()[0]).native
        f = tpusync.transfer(pool, host)
        assert f.path == "native" and f.result(TIMEOUT) == host.nbytes


def test_device_to_device_runs_in_jax(stand_in, arrays, rng):
    source = arrays.random(rng, (8, 16), np.float32)
    a = tpusync.DevicePool(put(source))
    b = tpusync.DevicePool.zeros((8, 16), np.float32)
    f = tpusync.transfer(a, b, src_blocks=[1, 2], dst_blocks=[5, 0])
    assert f.path == "jax"
    f.result(TIMEOUT)
    np.testing.assert_array_equal(np.asarray(b.array)[[5, 0]], source[[1, 2]])


def test_host_memory_is_registered_for_dma_once(stand_in, arrays, rng):
    source = arrays.random(rng, (16, 1024), np.uint8)
    pool = tpusync.DevicePool(put(source))
    host = tpusync.HostBuffer((16, 1024), np.uint8)
    calls, live, to_dma = (
        stand_in.count(n) for n in ("dma_map_calls", "dma_maps_live", "copies_to_dma")
    )
    for _ in range(3):
        tpusync.transfer(pool, host, src_blocks=np.arange(16)[::-1], dst_blocks=range(16)).result(
            TIMEOUT
        )
    assert stand_in.count("dma_map_calls") == calls + 1  # once, on first use
    assert stand_in.count("dma_maps_live") == live + 1
    assert stand_in.count("copies_to_dma") >= to_dma + 3
    plain = np.zeros_like(source)  # memory tpusync did not allocate is never registered
    tpusync.transfer(pool, plain).result(TIMEOUT)
    assert stand_in.count("dma_map_calls") == calls + 1
    host.close()  # unregistered before it is unmapped
    assert stand_in.count("dma_maps_live") == live


@pytest.mark.parametrize("kind", ["per-layer", "stacked-sharded"])
def test_host_pool_round_trip_with_checksums(stand_in, arrays, rng, mesh, kind):
    """The DRAM tier over the PJRT engine: blocks stored and loaded bit for bit, and each
    block's checksum (hashed on the host after the plugin's copy) is the format's."""
    model = make_model(arrays, rng, mesh, kind, BF16)
    pool = HostPool(model.layout, 6)
    try:
        pool.prepare(model.pools)  # registers the slots for DMA, plans both directions
        assert stand_in.count("dma_maps_live") >= 1
        keys = keys_for([0, 2, 5])
        copies = stand_in.count("copies")
        assert store(pool, model, keys, [0, 2, 5], "native") == 3
        pieces = 3 * len(model.pools) * model.layout.arrays[0].n_shards
        if kind == "per-layer":  # staged: a slot's pieces from every layer are one copy
            expected = 3 if stand_in.mode == "staged" else pieces
            assert stand_in.count("copies") - copies == expected
        for key in keys:
            assert int(pool._records["checksum"][pool.slot_of(key)]) == model.checksum(key)
        load(pool, model, keys[::-1], [7, 1, 3], "native")
        stats = pool.stats
        assert (stats.hits, stats.misses, stats.checksum_failures) == (3, 0, 0)
    finally:
        pool.close()
    assert stand_in.count("dma_maps_live") == 0


def test_copy_rows_rejects_rows_outside_one_buffer(built):
    buffer = np.arange(4096, dtype=np.uint8)
    host = np.zeros(4096, np.uint8)
    api, client = built.api, built.client
    device = api.lookup_device(client, 0)
    view = api.create_view(client, device, buffer.ctypes.data, 1024)
    try:
        targets = np.array([[buffer.ctypes.data, 1024, view, 0]], dtype=np.uint64)
        crossing = np.array([[buffer.ctypes.data + 1000, host.ctypes.data, 100]], np.uint64)
        with pytest.raises(_core.PjrtError, match="crosses the end of a device buffer") as info:
            api.copy_rows(targets, crossing)
        assert info.value.code_name == "INVALID_ARGUMENT"
        no_alias = np.array([[host.ctypes.data, buffer.ctypes.data, 8]], np.uint64)
        with pytest.raises(_core.PjrtError, match="no raw alias"):
            api.copy_rows(targets, no_alias)
        assert not host.any()  # nothing was copied
        fine = np.array([[buffer.ctypes.data + 8, host.ctypes.data, 16]], np.uint64)
        assert api.copy_rows(targets, fine) == 1
        np.testing.assert_array_equal(host[:16], buffer[8:24])
    finally:
        api.destroy_buffer(view)
    built.assert_nothing_live()
    assert os.path.exists(api.library_path)


def test_reads_of_mixed_pieces_and_dtypes(stand_in, arrays, rng):
    """Pieces of different sizes (a common unit of 64 bytes), several arrays in one batch, and
    a dtype that cannot be bitcast (bool: copied as it is) all arrive bit for bit."""
    shapes = [((16, 64), np.float32), ((16, 96), BF16), ((16, 3, 5), np.bool_)]
    sources = [arrays.random(rng, shape, dtype) for shape, dtype in shapes]
    pools = [tpusync.DevicePool(put(x)) for x in sources]
    src = rng.permutation(16)[:11]
    dst = rng.permutation(16)[:11]
    hosts = [np.zeros_like(x) for x in sources]
    items = [tpusync.Transfer(p, h, src, dst) for p, h in zip(pools, hosts, strict=True)]
    copies = stand_in.count("copies")
    f = tpusync.transfer_batch(items)
    assert f.path == "native"
    f.result(TIMEOUT)
    for host, source in zip(hosts, sources, strict=True):
        expected = np.zeros_like(source)
        expected[dst] = source[src]
        arrays.assert_same(host, expected, str(source.dtype))
    if stand_in.mode == "staged":  # bool rows one by one; the others gathered, fewer copies
        assert stand_in.count("copies") - copies < 11 + 2 * 11


def test_large_reads_are_gathered_in_chunks(stand_in, arrays, rng, monkeypatch):
    from tpusync._src.engines.pjrt import staging

    monkeypatch.setattr(staging, "CHUNK_BYTES", 8 << 10)  # 8 blocks of 1 KiB a gather
    source = arrays.random(rng, (64, 512), BF16)
    pool = tpusync.DevicePool(put(source))
    host = np.zeros_like(source)
    order = rng.permutation(64)
    copies = stand_in.count("copies")
    tpusync.transfer(pool, host, src_blocks=order, dst_blocks=np.arange(64)).result(TIMEOUT)
    arrays.assert_same(host, source[order], "chunked")
    if stand_in.mode == "staged":  # each chunk's destinations follow each other: one copy
        assert stand_in.count("copies") - copies == 8


@pytest.mark.parametrize("lie", ["reads", "writes"])
def test_a_plugin_that_moves_wrong_bytes_is_not_used(stand_in, arrays, rng, lie):
    """Each device's engine is proven with scratch arrays before any caller's byte moves: a
    plugin whose reads (or raw writes) come back wrong is not used for them."""
    stand_in.lib.stand_in_corrupt(1 if lie == "reads" else 2)
    stand_in.bind()  # proven anew
    path = device_path(jax.devices()[0])
    if lie == "reads":
        assert (path.engine, path.native) == ("none", False)
        assert "self-test: bytes read through a view differ" in path.reason
    else:
        assert (path.engine, path.native, path.reads, path.writes) == ("pjrt", True, True, False)
        assert "self-test: bytes written through a raw alias differ" in path.reason
    read_then_write(arrays, rng, read_path="jax" if lie == "reads" else "native")


def test_a_batch_that_reads_and_writes_the_same_blocks_runs_in_order(stand_in, arrays, rng):
    source = arrays.random(rng, (8, 512), np.uint16)
    pool = tpusync.DevicePool(put(source))
    saved = np.zeros((4, 512), np.uint16)
    incoming = arrays.random(rng, (4, 512), np.uint16)
    f = tpusync.transfer_batch(
        [
            tpusync.Transfer(pool, saved, [1, 3, 5, 7], range(4)),  # read first...
            tpusync.Transfer(incoming, pool, range(4), [7, 5, 3, 1]),  # ...then overwrite
        ]
    )
    assert f.path == "native"
    f.result(TIMEOUT)
    arrays.assert_same(saved, source[[1, 3, 5, 7]], "read before the write")
    expected = source.copy()
    expected[[7, 5, 3, 1]] = incoming
    arrays.assert_same(pool.array, expected, "written after the read")


def test_kv_store_over_the_plugin(stand_in, arrays, rng, stores, tmp_path):
    """The KV store end to end on the PJRT engine: a save, a load from DRAM, and a load after
    the blocks were evicted to disk, every block bit for bit and no checksum failure."""
    from test_kv_store import BS, Kv, make_config, prompt

    kv = Kv(arrays, rng, BF16)
    store = stores(make_config(tmp_path, 16, disk=16), kv.pools)
    tokens = prompt(rng, 5 * BS + 7)
    src = [3, 9, 1, 20, 33, 40]
    expected = kv.blocks(src[:5])
    assert store.save(tokens, src).stored_blocks == 5
    assert store.flush(TIMEOUT)
    for targets, evict in (([50, 51, 52, 53, 54], False), ([60, 2, 44, 7, 12], True)):
        if evict:
            assert store.evict(tokens, tier="dram") == 5
        copies = stand_in.count("copies")
        with store.lookup(tokens) as hit:
            assert hit.num_blocks == 5 and hit.tiers == ("disk" if evict else "dram",) * 5
            assert store.load(hit, targets).loaded_blocks == 5
        assert stand_in.count("copies") > copies  # the load went through the plugin
        kv.check(targets, expected)
    stats = store.stats()
    failures = {name: tier["checksum_failures"] for name, tier in stats["tiers"].items()}
    assert set(failures.values()) == {0}, failures
