"""Child processes for the weight-sync tests and benchmark: a trainer that publishes versions
of a test tree and samplers that pull them into their own meshes, each with 8 CPU devices,
driven by one command a line on stdin and answering one JSON line on stdout.

The test tree (:func:`tree_spec`, :func:`leaf_bytes`) is random bytes of mixed shapes and
dtypes, the same in every process for a (seed, version); each leaf's first 4 bytes are the
version, so a sampler's step can tell which version each leaf it read belongs to.

    python -m tpusync._src.testing.weights_procs trainer NAME REGISTRY [LEAVES [SCALE [DTYPE [KEEP
        [CHUNK_MIB]]]]]
    python -m tpusync._src.testing.weights_procs sampler NAME REGISTRY MESH [LEAVES [SCALE [DTYPE
        [SAME_HOST [WINDOW_MIB]]]]]
    python -m tpusync._src.testing.weights_procs follower NAME REGISTRY MESH
    python -m tpusync._src.testing.weights_procs multitrainer NAME REGISTRY COORDINATOR INDEX
        COUNT LEAVES [SCALE [DTYPE]]
    python -m tpusync._src.testing.weights_procs multisampler NAME REGISTRY COORDINATOR INDEX
        COUNT LEAVES
    python -m tpusync._src.testing.weights_procs fanouttrainer NAME REGISTRY HOST MIB
    python -m tpusync._src.testing.weights_procs fanoutsampler NAME REGISTRY HOST UPSTREAM|-|none
        MIB

with the deployment secret in hex in the environment (``TPUSYNC_TEST_SECRET``), not on the
command line where every user sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

try:  # the benchmark's baseline; not in every jax
    from jax.experimental import transfer as jax_transfer
except ImportError:  # pragma: no cover
    jax_transfer = None

from tpusync._src.cluster.dataplane import BlockClient
from tpusync._src.cluster.registry import RemoteRegistry
from tpusync._src.tiers.dram import HostPool
from tpusync._src.weights.manifest import chunk_key, chunk_layout
from tpusync._src.weights.options import (
    TlsOptions,
    WeightsClientOptions,
    WeightsPoolOptions,
    WeightsServerOptions,
)
from tpusync._src.weights.publisher import Publisher
from tpusync._src.weights.relay import Relay
from tpusync._src.weights.subscriber import Subscriber, published_structure
from tpusync.errors import StructureChangedError, TpuSyncError

DTYPES = ("bfloat16", "float32", "int8", "float16", "int32", "uint8")
MESHES = {"8x1": (8, 1), "2x4": (2, 4), "4x2": (4, 2), "1x8": (1, 8)}


def tree_spec(
    leaves: int, scale: int = 1, dtype: str | None = None
) -> list[tuple[str, tuple[int, ...], str]]:
    """``leaves`` (path name, shape, dtype): 2-D shapes divisible by 8 on both axes, a few 1-D
    and small ones among them; ``scale`` multiplies the last axis, ``dtype`` replaces the
    mix (the benchmark's bf16)."""
    out = []
    for i in range(leaves):
        kind = dtype or DTYPES[i % len(DTYPES)]
        if i % 10 == 9:
            shape: tuple[int, ...] = (8 * (1 + i % 5) * scale,)
        else:  # scaled along the rows' length, as a model's matrices are wide
            shape = (8 * (1 + (i * 7) % 24), 8 * (1 + (i * 5) % 16) * scale)
        out.append((f"layer{i:03d}", shape, kind))
    return out


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def leaf_bytes(seed: int, version: int, index: int, shape: tuple[int, ...], dtype: str) -> bytes:
    """The leaf's bytes in C order: random, its first 4 bytes the version."""
    n = int(np.prod(shape)) * np_dtype(dtype).itemsize
    data = bytearray(np.random.default_rng([seed, version, index]).bytes(n))
    data[:4] = int(version).to_bytes(4, "little")
    return bytes(data)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _setup() -> None:
    """8 CPU devices in this child (before JAX starts its backend)."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _mesh(name: str) -> Any:

    return Mesh(np.array(jax.devices()[:8]).reshape(MESHES[name]), ("x", "y"))


def _spec(shape: tuple[int, ...], mesh_name: str) -> Any:

    if mesh_name == "1x8":
        return P()  # replicated
    return P("x", "y") if len(shape) == 2 else P("x")


def trainer(
    name: str,
    registry_address: str,
    secret: bytes,
    leaves: int = 100,
    scale: int = 1,
    dtype: str | None = None,
    keep: int = 2,
    chunk_mib: int = 1,
) -> None:
    """Publishes versions on command: ``publish V`` (answers the report), ``again V``
    (publishes the last tree once more as V: the benchmark's versions), ``grow V`` (publishes
    V with one leaf more, and every later version so), ``stall V`` (stages
    V's chunks, then stops before its manifest: for a SIGKILL mid-publish), ``reshard [N]``
    (times N ``jax.device_put`` of the last tree into the 2x4 layout after a warm-up, in this
    process), ``inproc V...`` (publish -> commit of each version into a 2x4 subscriber in this
    process), ``quit``."""
    _setup()

    mesh = _mesh("8x1")
    spec = tree_spec(leaves, scale, dtype)
    registry = RemoteRegistry(registry_address, secret=secret)
    publisher = Publisher(
        name,
        secret=secret,
        registry=registry,
        pool=WeightsPoolOptions(keep=keep, chunk_bytes=chunk_mib << 20),
        server=WeightsServerOptions(registry_ttl_s=3.0),
    )

    def params(version: int) -> dict[str, Any]:
        out = {}
        for i, (path, shape, dtype) in enumerate(spec):
            raw = np.frombuffer(leaf_bytes(0, version, i, shape, dtype), np_dtype(dtype))
            sharding = NamedSharding(mesh, _spec(shape, "8x1"))
            out[path] = jax.device_put(raw.reshape(shape), sharding)
        return out

    _say({"ready": True, "pid": os.getpid()})
    tree: dict[str, Any] = {}
    server: Any = None
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        if command == "jaxoffer":  # offer the last tree to one jax.experimental.transfer pull
            if jax_transfer is None:
                _say({"error": "this jax has no jax.experimental.transfer"})
                continue
            if server is None:
                server = jax_transfer.start_transfer_server(
                    jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
                )
            server.await_pull(int(args[0]), jax.tree_util.tree_leaves(tree))
            _say({"address": server.address()})
            continue
        if command == "orbaxsave":  # the last tree saved by orbax to a directory
            start = time.perf_counter()
            _orbax_save(args[0], tree)
            _say({"seconds": time.perf_counter() - start})
            continue
        if command == "reshard":
            mesh2 = _mesh("2x4")
            shardings = {p: NamedSharding(mesh2, _spec(s, "2x4")) for p, s, _ in spec}
            jax.block_until_ready(jax.device_put(tree, shardings))  # compiled / warmed
            seconds = []
            for _ in range(int(args[0]) if args else 1):
                start = time.perf_counter()
                placed = jax.block_until_ready(jax.device_put(tree, shardings))
                seconds.append(time.perf_counter() - start)
                del placed  # freed before the next run, as a sampler's old version would be
            _say({"reshard_seconds": seconds})
            continue
        if command == "inproc":  # publish -> commit into 2x4 in this process (same host path)
            _say(_in_process(publisher, tree, spec, [int(v) for v in args], secret))
            continue
        version = int(args[0])
        if command == "grow":
            spec = tree_spec(len(spec) + 1, scale, dtype)
        if command != "again" or not tree:
            tree = params(version)
        if command == "stall":

            def stall(*_: Any, version: int = version) -> None:
                _say({"stalled": version})
                time.sleep(3600)

            publisher._write_manifest = stall  # type: ignore[method-assign]
        report = publisher.publish(tree, version)
        _say({"published": version, "seconds": report.seconds, "kept": report.kept,
              "address": publisher.address, "chunks": report.chunks,
              "nbytes": report.nbytes})  # fmt: skip
    publisher.close()
    registry.close()


def sampler(
    name: str,
    registry_address: str,
    secret: bytes,
    mesh_name: str,
    leaves: int = 100,
    scale: int = 1,
    dtype: str | None = None,
    same_host: int = 1,
) -> None:
    """Pulls on command: ``pull V [nodigest]`` (answers each leaf's digest, or the error, and
    the seconds), ``prepare`` (waits until the next pull's buffers are made), ``rawpull V
    CHUNKS ADDRESS`` (times a plain BlockClient pull of the version's chunks into a HostPool:
    the data plane's own speed), ``jaxpull UUID ADDRESS`` and ``orbaxrestore DIR`` (the
    benchmark's baselines), ``loop`` starts the toy step loop, ``stamps`` answers how many
    steps saw one version and how many more than one, ``quit``."""
    _setup()

    mesh = _mesh(mesh_name)
    spec = tree_spec(leaves, scale, dtype)
    target = {
        path: jax.ShapeDtypeStruct(shape, np_dtype(dtype), sharding=NamedSharding(
            mesh, _spec(shape, mesh_name)))
        for path, shape, dtype in spec
    }  # fmt: skip
    registry = RemoteRegistry(registry_address, secret=secret)
    subscriber = Subscriber(
        name,
        target,
        secret=secret,
        registry=registry,
        client=WeightsClientOptions(timeout_s=5.0, deadline_s=120.0, same_host=bool(same_host)),
    )
    stamps = {"one": 0, "mixed": 0, "seen": []}
    stop = threading.Event()

    def first_bytes(leaf: Any) -> int:  # the version's low byte: the array's first byte
        for shard in leaf.addressable_shards:
            if all((s.start or 0) == 0 for s in shard.index):
                return int(np.asarray(shard.data).view(np.uint8).reshape(-1)[0])
        raise AssertionError("no shard holds the first element")

    def loop() -> None:
        while not stop.is_set():
            try:
                params = subscriber.params  # a step runs on one reference
            except TpuSyncError:
                time.sleep(0.001)
                continue
            versions = {first_bytes(leaf) for leaf in jax.tree_util.tree_leaves(params)}
            stamps["one" if len(versions) == 1 else "mixed"] += 1
            for v in versions:
                if v not in stamps["seen"]:
                    stamps["seen"].append(v)

    _say({"ready": True, "pid": os.getpid()})
    worker = threading.Thread(target=loop, daemon=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        if command == "loop":
            worker.start()
            _say({"looping": True})
        elif command == "stamps":
            _say(stamps)
        elif command == "jaxpull":  # jax.experimental.transfer into 8x1, then device_put
            _say(_jax_pull(int(args[0]), args[1], spec, target))
        elif command == "orbaxrestore":
            start = time.perf_counter()
            restored = _orbax_restore(args[0], target)
            jax.block_until_ready(restored)
            _say({"seconds": time.perf_counter() - start})
            del restored
        elif command == "prepare":
            subscriber.prepare()
            _say({"prepared": True})
        elif command == "rawpull":
            _say(_raw_pull(name, secret, int(args[0]), int(args[1]), args[2]))
        elif command == "pull":
            version = int(args[0])
            try:
                report = subscriber.pull(version)
                subscriber.commit()
                if args[1:] == ["nodigest"]:
                    _say({"version": version, "seconds": report.seconds,
                          "commit_seconds": subscriber.last_commit_seconds,
                          "local": report.chunks_local,
                          "network": report.chunks_network})  # fmt: skip
                    continue
            except TpuSyncError as error:
                _say({"error": type(error).__name__, "message": str(error),
                      "committed": subscriber.version})  # fmt: skip
                continue
            params = subscriber.params
            _say({
                "version": version,
                "digests": {p: digest(np.asarray(params[p]).tobytes()) for p in params},
                "local": report.chunks_local, "network": report.chunks_network,
                "shardings_ok": all(params[p].sharding == target[p].sharding for p in params),
            })  # fmt: skip
    stop.set()
    if worker.is_alive():  # a daemon thread inside JAX at exit aborts the interpreter
        worker.join(timeout=10)
    subscriber.close()
    registry.close()


def multi_trainer(
    name: str, registry_address: str, secret: bytes, coordinator: str, index: int, count: int,
    leaves: int, scale: int = 1, dtype: str | None = None,
) -> None:  # fmt: skip
    """One process of a trainer of ``count`` ``jax.distributed`` processes, 8 CPU devices
    across them, holding each version of the test tree sharded 8x1 over all of them (each
    process only its own shards): ``make V`` makes V's arrays, ``publish V`` on every process
    publishes V (answers the report or the error), ``quit``."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8 // count)
    jax.distributed.initialize(coordinator, num_processes=count, process_id=index)
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("x", "y"))
    spec = tree_spec(leaves, scale, dtype)
    registry = RemoteRegistry(registry_address, secret=secret)
    publisher = Publisher(
        name, secret=secret, registry=registry, pool=WeightsPoolOptions(chunk_bytes=1 << 20),
        server=WeightsServerOptions(registry_ttl_s=3.0, parts_timeout_s=10.0),
    )  # fmt: skip

    def params(version: int) -> dict[str, Any]:
        out = {}
        for i, (path, shape, dtype) in enumerate(spec):
            whole = np.frombuffer(leaf_bytes(0, version, i, shape, dtype), np_dtype(dtype))
            whole = whole.reshape(shape)
            sharding = NamedSharding(mesh, _spec(shape, "8x1"))
            out[path] = jax.make_array_from_callback(shape, sharding, lambda at, w=whole: w[at])
        return out

    _say({"ready": True, "pid": os.getpid(), "process": jax.process_index()})
    made: tuple[int, dict[str, Any]] | None = None
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        version = int(args[0])
        if command == "make":  # the arrays of V, made before a timed publish
            made = (version, params(version))
            _say({"made": version})
            continue
        tree = made[1] if made is not None and made[0] == version else params(version)
        made = None
        try:
            report = publisher.publish(tree, version)
        except TpuSyncError as error:
            _say({"error": type(error).__name__, "message": str(error)})
            continue
        _say({"published": version, "chunks": report.chunks, "nbytes": report.nbytes,
              "address": publisher.address, "seconds": report.seconds})  # fmt: skip
    publisher.close()
    registry.close()
    jax.distributed.shutdown()


def multi_sampler(
    name: str, registry_address: str, secret: bytes, coordinator: str, index: int, count: int,
    leaves: int,
) -> None:  # fmt: skip
    """One process of a sampler of ``count`` ``jax.distributed`` processes, 8 CPU devices
    across them, its target the test tree on a 2x4 mesh over all of them: ``pull V [DELAY_S
    [DEADLINE_S]]`` (says ``pulling`` first, then waits DELAY_S), ``commit``, ``latest``,
    ``wait AFTER TIMEOUT_S``, ``check V`` (whether this process's shards of the committed
    version are V's bytes), ``quit``; each answers its result or the error."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8 // count)
    jax.distributed.initialize(coordinator, num_processes=count, process_id=index)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    spec = tree_spec(leaves)
    target = {
        path: jax.ShapeDtypeStruct(
            shape, np_dtype(dtype), sharding=NamedSharding(mesh, _spec(shape, "2x4"))
        )
        for path, shape, dtype in spec
    }
    registry = RemoteRegistry(registry_address, secret=secret)
    options = WeightsClientOptions(timeout_s=5.0, deadline_s=8.0)
    subscriber = Subscriber(name, target, secret=secret, registry=registry, client=options)

    def exact(version: int) -> bool:
        for i, (path, shape, dtype) in enumerate(spec):
            whole = np.frombuffer(leaf_bytes(0, version, i, shape, dtype), np_dtype(dtype))
            whole = whole.reshape(shape)
            for shard in subscriber.params[path].addressable_shards:
                if np.asarray(shard.data).tobytes() != whole[shard.index].tobytes():
                    return False
        return True

    _say({"ready": True, "pid": os.getpid(), "process": jax.process_index()})
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        try:
            if command == "pull":
                _say({"pulling": int(args[0])})
                time.sleep(float(args[1]) if len(args) > 1 else 0.0)
                deadline = float(args[2]) if len(args) > 2 else None
                report = subscriber.pull(int(args[0]), deadline_s=deadline)
                _say({"pulled": report.version, "nbytes": report.nbytes})
            elif command == "commit":
                subscriber.commit()
                _say({"committed": subscriber.version})
            elif command == "latest":
                _say({"latest": subscriber.latest()})
            elif command == "wait":
                _say({"newer": subscriber.wait_for_newer(int(args[0]), timeout_s=float(args[1]))})
            elif command == "check":
                _say({"version": subscriber.version, "exact": exact(int(args[0]))})
        except TpuSyncError as error:
            _say({"error": type(error).__name__, "message": str(error)})
    subscriber.close()
    registry.close()
    jax.distributed.shutdown()


def fanout_spec(mib: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The fan-out tree: 8 float32 leaves, ``mib`` MiB in all."""
    return [(f"layer{i}", (mib * 32, 1024), "float32") for i in range(8)]


def _fanout_leaves(version: int, mib: int) -> dict[str, np.ndarray]:
    return {
        path: np.frombuffer(leaf_bytes(0, version, i, shape, dtype), np_dtype(dtype)).reshape(shape)
        for i, (path, shape, dtype) in enumerate(fanout_spec(mib))
    }


def _fanout_registry(address: str, secret: bytes) -> RemoteRegistry:
    return RemoteRegistry(address, secret=secret, insecure=True)  # hosts of one test's switch


def fanout_trainer(name: str, registry_address: str, secret: bytes, host: str, mib: int) -> None:
    """A trainer on host ``host`` publishing the fan-out tree with chunk digests: ``publish
    V``, ``quit``."""
    registry = _fanout_registry(registry_address, secret)
    publisher = Publisher(
        name, secret=secret, registry=registry, relays=True,
        pool=WeightsPoolOptions(chunk_bytes=1 << 20, keep=2),
        server=WeightsServerOptions(host=host),
        tls=TlsOptions(insecure=True),
    )  # fmt: skip
    _say({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        version = int(args[0])
        report = publisher.publish(_fanout_leaves(version, mib), version)
        _say({"published": version, "nbytes": report.nbytes, "seconds": report.seconds})
    publisher.close()
    registry.close()


def fanout_sampler(
    name: str, registry_address: str, secret: bytes, host: str, upstream: str, mib: int
) -> None:
    """A sampler on host ``host`` (2 CPU devices) beside a relay at ``host:7400`` taking chunks
    from ``upstream`` (a relay's address, or ``-``: the publisher); its subscriber takes them
    from that relay first (``none``: no relay, every chunk from the publisher). ``pull V``
    (pulls and commits V: its seconds, where its chunks came from, whether every byte is
    V's), ``flip`` (from now on its relay damages each chunk that lands in it, a byte each,
    as memory gone bad would), ``quit``."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 2)
    registry = _fanout_registry(registry_address, secret)
    tls = TlsOptions(insecure=True)
    client = WeightsClientOptions(
        same_host=False, timeout_s=5.0, deadline_s=60.0, poll_s=0.01, relay_wait_s=10.0
    )
    flipping = threading.Event()

    class DamagingRelay(Relay):
        """A relay whose memory goes bad once told to (``flip``): each chunk that lands has a
        byte flipped right after, so it is served unlike its block checksum."""

        def _landed(self, keys: list[bytes], numbers: np.ndarray) -> None:
            pool = self.pool
            if not flipping.is_set() or pool is None:
                return
            for key in keys:
                slot = pool.slot_of(key)
                if slot is not None:
                    with pool.slot_memory(slot) as memory:
                        memory[1000] ^= 0x01

    relay = None if upstream == "none" else DamagingRelay(
        name, secret=secret, registry=registry, upstream=None if upstream == "-" else upstream,
        server=WeightsServerOptions(host=host, port=7400), client=client,
        tls=tls, pool=WeightsPoolOptions(chunk_bytes=1 << 20, keep=2),
    )  # fmt: skip
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("x", "y"))
    target = {
        path: jax.ShapeDtypeStruct(
            shape, np_dtype(dtype), sharding=NamedSharding(mesh, P("x", "y"))
        )
        for path, shape, dtype in fanout_spec(mib)
    }
    subscriber = Subscriber(
        name, target, secret=secret, registry=registry, client=client, tls=tls,
        relays=False if relay is None else f"{host}:7400",
    )  # fmt: skip
    _say({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        if command == "flip":
            flipping.set()
            _say({"flipping": True})
            continue
        version = int(args[0])
        try:
            report = subscriber.pull(version)
            tree = subscriber.commit()
        except TpuSyncError as error:
            _say({"error": type(error).__name__, "message": str(error)})
            continue
        want = _fanout_leaves(version, mib)
        exact = all(np.asarray(tree[p]).tobytes() == want[p].tobytes() for p in want)
        waited = time.monotonic() + 10.0  # its relay books the copy a moment after its end
        while relay is not None and time.monotonic() < waited:
            if relay.last is not None and relay.last.version >= version:
                break
            time.sleep(0.01)
        last = None if relay is None else relay.last
        copied = None if last is None else dataclasses.asdict(last)
        _say({"version": version, "seconds": report.seconds, "exact": exact,
              "relayed": report.chunks_relayed, "direct": report.chunks_network,
              "relay": copied})  # fmt: skip
    subscriber.close()
    if relay is not None:
        relay.close()
    registry.close()


def follower(name: str, registry_address: str, secret: bytes, mesh_name: str) -> None:
    """A sampler told nothing but the registry, the weights' name and its own mesh: builds its
    target from the newest version's published structure, then follows every newer version
    (``wait_for_newer``), answering each commit's version, leaf count and digests unasked; a
    changed structure makes it subscribe again with a target built from the new one. ``quit``
    on stdin stops it."""
    _setup()

    mesh = _mesh(mesh_name)
    registry = RemoteRegistry(registry_address, secret=secret)
    options = WeightsClientOptions(timeout_s=5.0, deadline_s=120.0, poll_s=0.02)
    stop = threading.Event()

    def subscribe(version: int | None) -> tuple[Subscriber, int]:
        structure = published_structure(
            name, version, secret=secret, registry=registry, client=options, wait_s=120
        )
        target = structure.target(mesh)
        made = Subscriber(name, target, secret=secret, registry=registry, client=options)
        return made, structure.version

    def follow() -> None:
        subscriber, first = subscribe(None)
        version: int | None = first
        try:
            while not stop.is_set():
                if version is not None:
                    try:
                        params = subscriber.update(version)
                    except TpuSyncError as error:
                        _say({"error": type(error).__name__, "message": str(error)})
                    else:
                        _say({"version": version, "leaves": len(params),
                              "digests": {p: digest(np.asarray(params[p]).tobytes())
                                          for p in params}})  # fmt: skip
                try:
                    version = subscriber.wait_for_newer(timeout_s=1.0)
                except StructureChangedError as change:
                    subscriber.close()
                    subscriber, version = subscribe(change.version)
                except TpuSyncError as error:  # said, then waited on again
                    _say({"error": type(error).__name__, "message": str(error)})
                    version = None
                    stop.wait(1.0)
        finally:
            subscriber.close()

    worker = threading.Thread(target=follow, daemon=True)
    worker.start()
    _say({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if line.split() == ["quit"]:
            break
    stop.set()
    worker.join(timeout=30)
    registry.close()


def _in_process(
    publisher: Publisher,
    tree: dict[str, Any],
    spec: list[tuple[str, tuple[int, ...], str]],
    versions: list[int],
    secret: bytes,
) -> dict[str, Any]:
    """Seconds from publish() to commit() of each version with a 2x4 subscriber in this
    process (the first is a warm-up)."""
    mesh = _mesh("2x4")
    target = {
        p: jax.ShapeDtypeStruct(s, np_dtype(d), sharding=NamedSharding(mesh, _spec(s, "2x4")))
        for p, s, d in spec
    }
    seconds = []
    with Subscriber(publisher.name, target, secret=secret, address=publisher.address) as sub:
        for version in versions:
            sub.prepare()
            start = time.perf_counter()
            publisher.publish(tree, version)
            sub.update(version)
            seconds.append(time.perf_counter() - start)
    return {"seconds": seconds[1:]}


_jax_side: dict[str, Any] = {}


def _jax_pull(
    uuid: int, address: str, spec: list[tuple[str, tuple[int, ...], str]], target: dict[str, Any]
) -> dict[str, Any]:
    """Pulls the trainer's offered tree with jax.experimental.transfer into the trainer's own
    layout (8x1 here: it cannot pull into another), then reshards it with device_put."""
    if jax_transfer is None:
        return {"error": "this jax has no jax.experimental.transfer"}
    if "server" not in _jax_side:
        _jax_side["server"] = jax_transfer.start_transfer_server(
            jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
        )
    connection = _jax_side["server"].connect(address)
    mesh = _mesh("8x1")
    specs = [
        jax.ShapeDtypeStruct(
            shape, np_dtype(dtype), sharding=NamedSharding(mesh, _spec(shape, "8x1"))
        )
        for _, shape, dtype in spec
    ]
    start = time.perf_counter()
    pulled = connection.pull(uuid, specs)
    jax.block_until_ready(pulled)
    middle = time.perf_counter()
    placed = jax.device_put(pulled, [target[p].sharding for p, _, _ in spec])
    jax.block_until_ready(placed)
    end = time.perf_counter()
    return {"pull_seconds": middle - start, "reshard_seconds": end - middle}


def _orbax_save(directory: str, tree: Any) -> None:
    import orbax.checkpoint as ocp  # optional heavy dependency

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, tree)
        checkpointer.wait_until_finished()


def _orbax_restore(directory: str, target: Any) -> Any:
    import orbax.checkpoint as ocp  # optional heavy dependency

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(directory, target)


def _raw_pull(name: str, secret: bytes, version: int, chunks: int, address: str) -> dict[str, Any]:

    keys = [chunk_key(name, version, i) for i in range(chunks)]
    with (
        # over TCP even on this host: the data plane the network subscriber is measured against
        BlockClient(address, secret=secret, connections=2, same_host=False) as client,
        HostPool(chunk_layout(name, client.payload_bytes), chunks) as pool,
    ):
        start = time.perf_counter()
        loaded = client.pull(keys, pool)
        return {"seconds": time.perf_counter() - start, "loaded": sum(loaded)}


class Child:
    """A child of this module, driven from another process: one command a line in, one JSON
    line out, each answer awaited with a timeout; stopped by its pid."""

    def __init__(self, args: list[str], env: dict[str, str], host: Any = None) -> None:
        argv = [sys.executable, "-m", "tpusync._src.testing.weights_procs", *args]
        self.process = subprocess.Popen(
            argv if host is None else host.command(argv),  # a testing.hosts.Host
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"no answer from {self.process.args} in {timeout} s") from None

    def ask(self, command: str, timeout: float = 60.0) -> dict[str, Any]:
        self.send(command)
        return self.answer(timeout)

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.send("quit")
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def stop_together(children: list[Child]) -> None:
    """Stops the processes of one ``jax.distributed`` job: tells every one to quit before
    waiting for any, since each one's shutdown waits for the others to reach it."""
    for child in children:
        if child.process.poll() is None:
            with contextlib.suppress(OSError):
                child.send("quit")
    for child in children:
        child.stop()


def main(argv: list[str]) -> None:
    role, name, registry_address, *rest = argv
    secret = bytes.fromhex(os.environ["TPUSYNC_TEST_SECRET"])
    if role == "trainer":
        counts = [int(x) for x in rest[:2]]
        trainer(name, registry_address, secret, *counts, *rest[2:3], *(int(x) for x in rest[3:]))
    elif role == "sampler":
        counts = [int(x) for x in rest[1:3]]
        sampler(
            name, registry_address, secret, rest[0], *counts, *rest[3:4],
            *(int(x) for x in rest[4:]),
        )  # fmt: skip
    elif role == "follower":
        follower(name, registry_address, secret, rest[0])
    elif role == "multitrainer":
        multi_trainer(
            name, registry_address, secret, rest[0], *(int(x) for x in rest[1:5]), *rest[5:6]
        )
    elif role == "fanouttrainer":
        fanout_trainer(name, registry_address, secret, rest[0], int(rest[1]))
    elif role == "fanoutsampler":
        fanout_sampler(name, registry_address, secret, rest[0], rest[1], int(rest[2]))
    elif role == "multisampler":
        multi_sampler(name, registry_address, secret, rest[0], *(int(x) for x in rest[1:4]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
