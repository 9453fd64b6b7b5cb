"""The processes of the network benchmark (:mod:`tpusync._src.bench.network`): block payloads and
pools, TLS certificates, the child processes (block server, block client, store node, registry,
jax.experimental.transfer server) that answer JSON lines on stdin, and the puller that times
pulls and pushes. A child runs as ``python -m tpusync._src.bench.network_procs --child KIND
CONFIG``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tpusync._src.bench.common import stop_process
from tpusync._src.bench.peer_workers.protocol import PREFIX, reply, serve
from tpusync._src.cluster.dataplane import BlockClient, BlockServer
from tpusync._src.cluster.registry import MemoryRegistry, RegistryServer
from tpusync._src.cluster.store_node import StoreNodePool, StoreServer
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import ArrayLayout, PoolLayout

jax_transfer: Any
try:
    from jax.experimental import transfer as jax_transfer
except ImportError:  # an older jax: the peer is listed as not available
    jax_transfer = None

SEED = 20240611
LEASE_TTL_S = 600.0  # a pull's deadline is 0.8x this: far beyond any pull here
CHILD_PROGRAM = (sys.executable, "-m", "tpusync._src.bench.network_procs")


# -- blocks --------------------------------------------------------------------------------------


def block_keys(n: int, seed: int = SEED) -> list[bytes]:
    """24-byte keys, like the store's."""
    return [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=24).digest() for i in range(n)]


def block_payload(i: int, size: int, seed: int = SEED) -> bytes:
    """Block ``i``'s random bytes (the same in every process)."""
    return np.random.default_rng([seed, i]).bytes(size)


def make_layout(block_bytes: int) -> Any:
    return PoolLayout("bench-network", (ArrayLayout("kv", "uint8", (block_bytes,), 0, 1),))


def filled_pool(n: int, block_bytes: int) -> Any:
    """A HostPool holding blocks 0..n-1, committed with their checksums."""
    pool = HostPool(make_layout(block_bytes), n)
    reservation = pool.reserve(block_keys(n))
    for i, slot in enumerate(reservation.slots.tolist()):
        with pool.slot_memory(slot) as memory:
            memory[:block_bytes] = block_payload(i, block_bytes)
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    return pool


def make_certificate(directory: str, ips: list[str]) -> tuple[str, str] | None:
    """A self-signed certificate for ``ips`` (as the TLS tests make theirs); None without
    openssl."""
    if shutil.which("openssl") is None:
        return None
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    san = ",".join(f"IP:{ip}" for ip in ips)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={ips[0]}", "-addext", f"subjectAltName={san}",
         "-keyout", key, "-out", cert],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def server_context(cert: tuple[str, str]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*cert)
    return context


def client_context(cert: tuple[str, str]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert[0])


# -- child processes -------------------------------------------------------------------------------


class Child:
    """A child process that answers one JSON line (marked with PREFIX) per JSON line it is sent,
    and exits at EOF on its stdin. Its stderr goes to a log file, shown when it fails."""

    def __init__(
        self, name: str, argv: list[str], log_dir: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0,
                env=env,
            )  # fmt: skip
        self._buffer = b""

    def tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-3000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                if text.startswith(PREFIX):
                    answer = json.loads(text[len(PREFIX) :])
                    if "error" in answer:
                        raise RuntimeError(f"{self.name}: {answer['error']}")
                    return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer within {timeout:.0f} s\n{self.tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(
                        f"{self.name} exited (rc={self.proc.wait()}):\n{self.tail()}"
                    )
                self._buffer += chunk

    def request(self, message: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.proc, timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_child(
    stack: contextlib.ExitStack,
    name: str,
    kind: str,
    config: dict[str, Any],
    log_dir: str,
    netns: str | None = None,
    timeout: float = 180.0,
    program: Sequence[str] = CHILD_PROGRAM,
    env: dict[str, str] | None = None,
) -> tuple[Child, dict[str, Any]]:
    """Starts ``program --child kind config`` (default: this module; in ``netns`` when given;
    with ``env``, default this process's), registers its stop with ``stack`` and returns it
    with its first answer."""
    argv = [*program, "--child", kind, json.dumps(config)]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    child = Child(name, argv, log_dir, env)
    stack.callback(child.stop)
    return child, child.read(timeout)


def child_block_server(config: dict[str, Any]) -> None:
    """Serves a HostPool of ``blocks`` random blocks on each of ``servers`` (network_tuning.py
    runs it in its own child, with its ablation applied first)."""
    secret = bytes.fromhex(config["secret"])
    pool = filled_pool(config["blocks"], config["block_bytes"])
    servers = []
    try:
        for spec in config["servers"]:
            tls = server_context(tuple(config["cert"])) if spec.get("tls") else None
            servers.append(
                BlockServer(
                    pool,
                    secret=secret,
                    host=spec["host"],
                    lease_ttl_s=LEASE_TTL_S,
                    tls=tls,
                    insecure=spec.get("insecure", False),
                )
            )
        reply({"ports": [s.port for s in servers], "used": pool.used})
        serve(lambda request: {"used": pool.used})
    finally:
        for server in servers:
            server.close()
        pool.close()


def child_block_client(config: dict[str, Any]) -> None:
    """Holds a target HostPool and one BlockClient per entry of ``clients``; answers
    ``{"pull": name}`` with the pull's seconds and ``{"verify": name}`` with a byte check."""
    puller = Puller(config["blocks"], config["block_bytes"], bytes.fromhex(config["secret"]))
    try:
        cert = tuple(config["cert"]) if config.get("cert") else None
        for name, spec in config["clients"].items():
            tls = client_context(cert) if spec.get("tls") and cert else None
            puller.add(name, spec["addresses"], spec["connections"], tls, not spec.get("tls"))
        reply({"ready": True})

        def handle(request: dict[str, Any]) -> dict[str, Any]:
            if "pull" in request:
                return {"seconds": puller.pull(request["pull"])}
            return {"verified": puller.verify(request["verify"])}

        serve(handle)
    finally:
        puller.close()


def child_jax_server(config: dict[str, Any]) -> None:
    """A jax.experimental.transfer server offering the same blocks as one pytree of arrays;
    ``{"offer": uuid}`` schedules one pull of them under ``uuid``."""
    if jax_transfer is None:
        raise RuntimeError("this jax has no jax.experimental.transfer")
    transfer = jax_transfer
    n, size = config["blocks"], config["block_bytes"]
    device = jax.devices()[0]
    server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
    arrays = [
        jax.device_put(np.frombuffer(block_payload(i, size), dtype=np.uint8), device)
        for i in range(n)
    ]
    jax.block_until_ready(arrays)
    reply({"address": server.address()})

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        server.await_pull(int(request["offer"]), arrays)
        return {"offered": request["offer"]}

    serve(handle)


def child_registry_server(config: dict[str, Any]) -> None:
    """A RegistryServer over a MemoryRegistry on a loopback port."""
    server = RegistryServer(MemoryRegistry(), secret=bytes.fromhex(config["secret"]))
    try:
        reply({"address": server.address})
        serve(lambda request: {})
    finally:
        server.close()


def child_store_server(config: dict[str, Any]) -> None:
    """A store node's server (``tpusync serve``'s StoreServer) lending ``dram_bytes``."""
    server = StoreServer(
        config["dram_bytes"], secret=bytes.fromhex(config["secret"]), lease_ttl_s=LEASE_TTL_S
    )
    try:
        reply({"address": server.address})
        serve(lambda request: {})
    finally:
        server.close()


CHILDREN = {
    "block-server": child_block_server,
    "store-server": child_store_server,
    "block-client": child_block_client,
    "jax-server": child_jax_server,
    "registry-server": child_registry_server,
}


# -- pulls ---------------------------------------------------------------------------------------


class Puller:
    """A target HostPool and named BlockClients that pull every block into it."""

    def __init__(self, blocks: int, block_bytes: int, secret: bytes) -> None:
        self.keys = block_keys(blocks)
        self.block_bytes = block_bytes
        self.secret = secret
        self.target = HostPool(make_layout(block_bytes), blocks)
        self.clients: dict[str, Any] = {}

    def add(
        self,
        name: str,
        addresses: list[str],
        connections: int,
        tls: ssl.SSLContext | None,
        insecure: bool,
    ) -> None:
        self.clients[name] = BlockClient(
            addresses=addresses,
            connections=connections,
            secret=self.secret,
            timeout_s=60.0,
            lease_ttl_s=LEASE_TTL_S,
            tls=tls,
            insecure=insecure and tls is None,
        )

    def pull(self, name: str) -> float:
        """Seconds to pull every block into the emptied target (all must arrive)."""
        self.target.delete(self.keys)
        assert self.target.used == 0, "the target still holds blocks"
        start = time.perf_counter()
        loaded = self.clients[name].pull(self.keys, self.target)
        seconds = time.perf_counter() - start
        if not all(loaded):
            raise RuntimeError(f"{name}: {len(loaded) - sum(loaded)} blocks not pulled")
        return seconds

    def add_pusher(self, name: str, address: str, connections: int) -> None:
        """A StoreNodePool (a store node as a lower tier) that pushes the target's blocks."""
        self.clients[name] = StoreNodePool(
            address,
            layout=self.target.layout,
            secret=self.secret,
            connections=connections,
            timeout_s=60.0,
        )

    def push(self, name: str) -> float:
        """Seconds to push every block of the (full) target to the emptied store node (all
        must be stored: the node verifies each against its checksum)."""
        node = self.clients[name]
        node.delete(self.keys)
        start = time.perf_counter()
        stored = node.put(self.keys, self.target)
        seconds = time.perf_counter() - start
        if stored != len(self.keys):
            raise RuntimeError(f"{name}: {len(self.keys) - stored} blocks not stored")
        return seconds

    def verify(self, name: str) -> bool:
        """The first, a middle and the last block hold exactly the bytes the server made."""
        self.pull(name)
        n = len(self.keys)
        for i in sorted({0, n // 2, n - 1}):
            slot = self.target.slot_of(self.keys[i])
            with self.target.slot_memory(slot) as memory:
                got = bytes(memory[: self.block_bytes])
            if got != block_payload(i, self.block_bytes):
                raise RuntimeError(f"{name}: block {i} differs from what the server holds")
        return True

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.target.delete(self.keys)
        self.target.close()


def child_main(argv: Sequence[str]) -> None:
    """Runs the child ``argv[0]`` with the JSON config ``argv[1]``."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run every finally block
    CHILDREN[argv[0]](json.loads(argv[1]))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--child":
        sys.exit("usage: python -m tpusync._src.bench.network_procs --child KIND CONFIG")
    child_main(sys.argv[2:])
