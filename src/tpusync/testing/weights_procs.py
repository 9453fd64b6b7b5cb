"""Child processes for the weight-sync tests and benchmark: a trainer that publishes versions
of a test tree and samplers that pull them into their own meshes, each with 8 CPU devices,
driven by one command a line on stdin and answering one JSON line on stdout.

The test tree (:func:`tree_spec`, :func:`leaf_bytes`) is random bytes of mixed shapes and
dtypes, the same in every process for a (seed, version); each leaf's first 4 bytes are the
version, so a sampler's step can tell which version each leaf it read belongs to.

    python -m tpusync.testing.weights_procs trainer NAME REGISTRY [LEAVES]
    python -m tpusync.testing.weights_procs sampler NAME REGISTRY MESH [LEAVES]

with the deployment secret in hex in the environment (``TPUSYNC_TEST_SECRET``), not on the
command line where every user sees it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

DTYPES = ("bfloat16", "float32", "int8", "float16", "int32", "uint8")
MESHES = {"8x1": (8, 1), "2x4": (2, 4), "4x2": (4, 2), "1x8": (1, 8)}


def tree_spec(leaves: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``leaves`` (path name, shape, dtype): 2-D shapes divisible by 8 on both axes, a few 1-D
    and small ones among them."""
    out = []
    for i in range(leaves):
        dtype = DTYPES[i % len(DTYPES)]
        if i % 10 == 9:
            shape: tuple[int, ...] = (8 * (1 + i % 5),)
        else:
            shape = (8 * (1 + (i * 7) % 24), 8 * (1 + (i * 5) % 16))
        out.append((f"layer{i:03d}", shape, dtype))
    return out


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

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
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _mesh(name: str) -> Any:
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:8]).reshape(MESHES[name]), ("x", "y"))


def _spec(shape: tuple[int, ...], mesh_name: str) -> Any:
    from jax.sharding import PartitionSpec as P

    if mesh_name == "1x8":
        return P()  # replicated
    return P("x", "y") if len(shape) == 2 else P("x")


def trainer(name: str, registry_address: str, secret: bytes, leaves: int = 100) -> None:
    """Publishes versions on command: ``publish V`` (answers the report), ``stall V`` (stages
    V's chunks, then stops before its manifest: for a SIGKILL mid-publish), ``quit``."""
    _setup()
    import jax
    from jax.sharding import NamedSharding

    from tpusync.cluster import RemoteRegistry
    from tpusync.weights import Publisher

    mesh = _mesh("8x1")
    spec = tree_spec(leaves)
    registry = RemoteRegistry(registry_address, secret=secret)
    publisher = Publisher(
        name, secret=secret, registry=registry, keep=2, chunk_bytes=1 << 20, registry_ttl_s=3.0
    )

    def params(version: int) -> dict[str, Any]:
        out = {}
        for i, (path, shape, dtype) in enumerate(spec):
            raw = np.frombuffer(leaf_bytes(0, version, i, shape, dtype), np_dtype(dtype))
            sharding = NamedSharding(mesh, _spec(shape, "8x1"))
            out[path] = jax.device_put(raw.reshape(shape), sharding)
        return out

    _say({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command, *args = line.split()
        if command == "quit":
            break
        version = int(args[0])
        tree = params(version)
        if command == "stall":

            def stall(*_: Any, version: int = version) -> None:
                _say({"stalled": version})
                time.sleep(3600)

            publisher._write_manifest = stall  # type: ignore[method-assign]
        report = publisher.publish(tree, version)
        _say({"published": version, "seconds": report.seconds, "kept": report.kept,
              "address": publisher.address})  # fmt: skip
    publisher.close()
    registry.close()


def sampler(
    name: str, registry_address: str, secret: bytes, mesh_name: str, leaves: int = 100
) -> None:
    """Pulls on command: ``pull V`` (answers each leaf's digest or the error), ``loop`` starts
    the toy step loop, ``stamps`` answers how many steps saw one version and how many more
    than one, ``quit``."""
    _setup()
    import jax
    from jax.sharding import NamedSharding

    from tpusync.cluster import RemoteRegistry
    from tpusync.errors import TpuSyncError
    from tpusync.weights import Subscriber

    mesh = _mesh(mesh_name)
    spec = tree_spec(leaves)
    target = {
        path: jax.ShapeDtypeStruct(shape, np_dtype(dtype), sharding=NamedSharding(
            mesh, _spec(shape, mesh_name)))
        for path, shape, dtype in spec
    }  # fmt: skip
    registry = RemoteRegistry(registry_address, secret=secret)
    subscriber = Subscriber(name, target, secret=secret, registry=registry, timeout_s=5.0,
                            deadline_s=30.0)  # fmt: skip
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
        elif command == "pull":
            version = int(args[0])
            try:
                report = subscriber.pull(version)
                subscriber.commit()
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


def main(argv: list[str]) -> None:
    role, name, registry_address, *rest = argv
    secret = bytes.fromhex(os.environ["TPUSYNC_TEST_SECRET"])
    if role == "trainer":
        trainer(name, registry_address, secret, *(int(x) for x in rest))
    elif role == "sampler":
        sampler(name, registry_address, secret, rest[0], *(int(x) for x in rest[1:]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
