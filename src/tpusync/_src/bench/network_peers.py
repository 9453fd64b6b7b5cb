"""The network benchmark's limit and peers: the TCP limit per connection count (the best of
:func:`~tpusync._src.bench.limits.loopback_tcp` in C and
:class:`~tpusync._src.bench.limits.Iperf3PerStream` with its default and tuned buffers), iperf3
over the two shaped paths (one process per path), jax.experimental.transfer, and the registry
lookups (MemoryRegistry, RemoteRegistry, Redis)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
from typing import Any

import jax
import numpy as np

from tpusync._src.bench.common import free_port, median, stop_process
from tpusync._src.bench.network_procs import (
    Child,
    block_keys,
    block_payload,
    jax_transfer,
    start_child,
)
from tpusync._src.cluster.registry import (
    MemoryRegistry,
    NodeInfo,
    RedisRegistry,
    RemoteRegistry,
    longest_prefix,
)

REGISTRY_BLOCKS = 512
REDIS_ROW = "RedisRegistry -> redis-server"  # the peer of the registry lookups
# -- iperf3 over the shaped paths (one process per path) -------------------------------------------


def iperf3_available() -> bool:
    return shutil.which("iperf3") is not None


def iperf3_server(
    stack: contextlib.ExitStack, port: int, bind: str | None, netns: str | None, log_dir: str
) -> None:
    argv = ["iperf3", "-s", "-p", str(port)] + (["-B", bind] if bind else [])
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    log = open(os.path.join(log_dir, f"iperf3-server-{port}.log"), "wb")  # noqa: SIM115
    stack.callback(log.close)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    stack.callback(stop_process, proc, 10.0)


def iperf3_start(
    server: str,
    port: int,
    nbytes: int,
    streams: int,
    bind: str | None,
    netns: str | None,
    options: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    argv = ["iperf3", "-c", server, "-p", str(port), "-n", str(nbytes), "-P", str(streams), "-J"]
    argv += ["-B", bind] if bind else []
    argv += options
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def iperf3_finish(proc: subprocess.Popen[str]) -> tuple[int, float]:
    """(bytes received, seconds) of a finished iperf3 client run."""
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        stop_process(proc, 5.0)
        raise
    try:
        report = json.loads(out)
    except json.JSONDecodeError:
        raise RuntimeError(f"iperf3 failed: {err.strip() or out.strip()}") from None
    if "error" in report:
        raise RuntimeError(f"iperf3 failed: {report['error']}")
    received = report["end"]["sum_received"]
    return int(received["bytes"]), float(received["seconds"])


def iperf3_gbps(
    targets: list[tuple[str, int, str | None]],
    nbytes: int,
    streams: int,
    netns: str | None = None,
    tries: int = 1,
    options: tuple[str, ...] = (),
) -> float:
    """GB/s of iperf3 clients run at once, one per (server, port, bind) in ``targets``, each
    moving its share of ``nbytes`` (the first tries wait for the servers to listen)."""
    for attempt in range(tries):
        procs = [
            iperf3_start(host, port, nbytes // len(targets), streams, bind, netns, options)
            for host, port, bind in targets
        ]
        try:
            runs = [iperf3_finish(p) for p in procs]
        except RuntimeError:
            if attempt + 1 == tries:
                raise
            time.sleep(0.3)
            continue
        return sum(b for b, _ in runs) / max(s for _, s in runs) / 1e9
    raise AssertionError("unreachable")


# -- jax.experimental.transfer ---------------------------------------------------------------------


class JaxPuller:
    """The benchmark process's side of jax.experimental.transfer: its own TransferServer,
    connected to the child's, pulling the child's arrays."""

    def __init__(self, child: Child, address: str, blocks: int, block_bytes: int) -> None:
        if jax_transfer is None:
            raise RuntimeError("this jax has no jax.experimental.transfer")
        transfer = jax_transfer
        self.jax = jax
        self.child = child
        self.block_bytes = block_bytes
        device = jax.devices()[0]
        self.server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
        self.connection = self.server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(device)
        self.specs = [
            jax.ShapeDtypeStruct((block_bytes,), np.uint8, sharding=sharding) for _ in range(blocks)
        ]
        self.uuid = 0

    def pull(self, verify: bool = False) -> float:
        self.uuid += 1
        self.child.request({"offer": self.uuid})
        start = time.perf_counter()
        arrays = self.connection.pull(self.uuid, self.specs)
        self.jax.block_until_ready(arrays)
        seconds = time.perf_counter() - start
        if verify:
            n = len(arrays)
            for i in sorted({0, n // 2, n - 1}):
                if np.asarray(arrays[i]).tobytes() != block_payload(i, self.block_bytes):
                    raise RuntimeError(f"jax.experimental.transfer: block {i} differs")
        del arrays
        return seconds


def _lookup_rate(registry: Any, keys: list[bytes], window: float) -> float:
    count, start = 0, time.perf_counter()
    while True:
        found, _ = longest_prefix(registry, keys)
        if found != len(keys):
            raise RuntimeError(f"{type(registry).__name__}: a prefix of {found}, not {len(keys)}")
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return count / elapsed


def start_redis(stack: contextlib.ExitStack, log_dir: str) -> str:
    import redis  # optional heavy dependency (tpusync[cluster]): only the Redis peer

    port = free_port()
    log = open(os.path.join(log_dir, "redis.log"), "wb")  # noqa: SIM115
    stack.callback(log.close)
    proc = subprocess.Popen(
        ["redis-server", "--save", "", "--appendonly", "no", "--port", str(port),
         "--bind", "127.0.0.1", "--dir", log_dir],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    stack.callback(stop_process, proc, 10.0)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    for _ in range(100):
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.1)
    else:
        raise TimeoutError("redis-server did not answer within 10 s")
    client.close()
    return f"redis://127.0.0.1:{port}/0"


def bench_registry(repeats: int, lookup_s: float, log_dir: str, notes: list[str]) -> dict[str, Any]:
    keys = block_keys(REGISTRY_BLOCKS, seed=7)
    secret = secrets.token_bytes(32)
    node = NodeInfo("bench-node", addresses=("127.0.0.1:1",))
    rates: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        registries: dict[str, Any] = {"MemoryRegistry (in process)": MemoryRegistry()}
        _, ready = start_child(
            stack, "registry-server", "registry-server", {"secret": secret.hex()}, log_dir
        )
        remote = RemoteRegistry(ready["address"], secret=secret)
        stack.callback(remote.close)
        registries["RemoteRegistry -> RegistryServer (TCP)"] = remote
        if shutil.which("redis-server") is None:
            notes.append("RedisRegistry: redis-server not installed; its row is skipped")
        else:
            try:
                url = start_redis(stack, log_dir)
                redis_registry = RedisRegistry(url, prefix=f"bench{os.getpid()}")
                stack.callback(redis_registry.close)
                registries[REDIS_ROW] = redis_registry
            except Exception as exc:
                notes.append(f"RedisRegistry: n/a ({type(exc).__name__}: {exc})")
        for registry in registries.values():
            registry.register(node, ttl_s=3600)
            registry.publish(node.node_id, keys, "dram")
            _lookup_rate(registry, keys, 0.1)  # warm-up
        for _ in range(repeats):
            for name, registry in registries.items():
                rates.setdefault(name, []).append(_lookup_rate(registry, keys, lookup_s))
        for registry in registries.values():
            registry.unregister(node.node_id)
    return {
        "blocks": REGISTRY_BLOCKS,
        "key_bytes": len(keys[0]),
        "lookups_per_s": {k: median(v) for k, v in rates.items()},
        "lookups_per_s_runs": rates,
    }
