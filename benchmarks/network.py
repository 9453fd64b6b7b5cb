"""GB/s of tpusync's block data plane between two processes, beside iperf3 and
jax.experimental.transfer; striping over two rate-limited paths; registry lookups per second.

* Loopback: a BlockServer in a child process serves a HostPool of ``--total-mib`` of 2 MiB blocks
  (random bytes); the benchmark process pulls them all into a local HostPool with a BlockClient
  (``client.pull(keys, target)``, every block verified against its checksum as it lands), with
  1, 2 and 4 connections, without and with TLS (a self-signed certificate made by ``openssl``),
  and pushes the same blocks to a store node's server (``StoreServer``, in a third child) through
  a ``StoreNodePool``, which the node verifies before it stores them.
  Alternating with those pulls in the same run: ``iperf3`` over loopback with the same byte count
  and as many streams (a bare TCP ceiling: no framing, no checksums, nothing stored), both with
  its defaults and with a 256 KiB socket buffer and 1 MiB writes (the ratio divides by the
  better), and
  ``jax.experimental.transfer`` pulling the same bytes, as one pytree of 2 MiB arrays, from a
  TransferServer in another child process. Medians of ``--repeats`` after one warm-up each.
* Two paths (root only): two network namespaces joined by two veth pairs, each on its own /24
  subnet and shaped to ``--rate-mbit`` by ``tc tbf`` on both ends; the server runs in one
  namespace, a client child process in the other pulls ``--netns-mib`` over one path or striped
  over both (``"local>remote:port"`` addresses, 2 connections either way), plaintext
  (``insecure=True``) and TLS, beside iperf3 over one path and over both at once.
* Registry: longest-prefix lookups (``longest_prefix``) per second of a 512-block prefix of
  24-byte keys, all held by one live node: MemoryRegistry in process, RemoteRegistry against a
  RegistryServer in a child process over TCP, RedisRegistry against a redis-server started here.

Targets (printed as ratios): tpusync loopback without TLS >= 0.8x the better iperf3 and >= 2.5x
jax.experimental.transfer; two striped paths >= 1.8x one path. Every child process is stopped by
its pid (EOF on its stdin, then SIGTERM, then SIGKILL, each with a timeout) and the namespaces are
deleted, also on error. Prints markdown tables; writes JSON.

    python benchmarks/network.py [--total-mib 1024] [--block-kib 2048] [--repeats 5]
        [--connections 1,2,4] [--netns-mib 256] [--rate-mbit 1000] [--skip-netns]
        [--lookup-s 0.5] [--json benchmarks/results/network-cpu-2core.json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, median, print_table, stop_process, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "network-cpu-2core.json")
PREFIX = "@tpsbench "  # marks the protocol lines of a child's stdout (anything else is noise)
SEED = 20240611
LEASE_TTL_S = 600.0  # a pull's deadline is 0.8x this: far beyond any pull here
PATHS = (("10.71.1.1", "10.71.1.2"), ("10.72.1.1", "10.72.1.2"))  # (server, client) per veth
REGISTRY_BLOCKS = 512
TARGETS = {"iperf3": 0.8, "jax": 2.5, "striped": 1.8}


# -- blocks --------------------------------------------------------------------------------------


def block_keys(n: int, seed: int = SEED) -> list[bytes]:
    """24-byte keys, like the store's."""
    return [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=24).digest() for i in range(n)]


def block_payload(i: int, size: int, seed: int = SEED) -> bytes:
    """Block ``i``'s random bytes (the same in every process)."""
    return np.random.default_rng([seed, i]).bytes(size)


def make_layout(block_bytes: int) -> Any:
    from tpusync.tiers import ArrayLayout, PoolLayout

    return PoolLayout("bench-network", (ArrayLayout("kv", "uint8", (block_bytes,), 0, 1),))


def filled_pool(n: int, block_bytes: int) -> Any:
    """A HostPool holding blocks 0..n-1, committed with their checksums."""
    from tpusync.tiers import HostPool

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

    def __init__(self, name: str, argv: list[str], log_dir: str) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0
            )
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


def start_child(
    stack: contextlib.ExitStack,
    name: str,
    kind: str,
    config: dict[str, Any],
    log_dir: str,
    netns: str | None = None,
    timeout: float = 180.0,
) -> tuple[Child, dict[str, Any]]:
    """Starts ``network.py --child kind`` (in ``netns`` when given), registers its stop with
    ``stack`` and returns it with its first answer."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", kind, json.dumps(config)]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    child = Child(name, argv, log_dir)
    stack.callback(child.stop)
    return child, child.read(timeout)


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def _serve_requests(handle: Any) -> None:
    """Answers each JSON line on stdin with ``handle(request)`` until EOF."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            _reply(handle(json.loads(line)))
        except Exception:
            _reply({"error": traceback.format_exc()})


def child_block_server(config: dict[str, Any]) -> None:
    """Serves a HostPool of ``blocks`` random blocks on each of ``servers``."""
    from tpusync.cluster import BlockServer

    secret = bytes.fromhex(config["secret"])
    if config.get("autotuned_send_buffer"):  # the ablation in network_tuning.py
        from tpusync.cluster.dataplane import _connection, server

        server.tune_for_peer = _connection.tune_for_peer = lambda sock: None
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
        _reply({"ports": [s.port for s in servers], "used": pool.used})
        _serve_requests(lambda request: {"used": pool.used})
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
        _reply({"ready": True})

        def handle(request: dict[str, Any]) -> dict[str, Any]:
            if "pull" in request:
                return {"seconds": puller.pull(request["pull"])}
            return {"verified": puller.verify(request["verify"])}

        _serve_requests(handle)
    finally:
        puller.close()


def child_jax_server(config: dict[str, Any]) -> None:
    """A jax.experimental.transfer server offering the same blocks as one pytree of arrays;
    ``{"offer": uuid}`` schedules one pull of them under ``uuid``."""
    import jax
    from jax.experimental import transfer

    n, size = config["blocks"], config["block_bytes"]
    device = jax.devices()[0]
    server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
    arrays = [
        jax.device_put(np.frombuffer(block_payload(i, size), dtype=np.uint8), device)
        for i in range(n)
    ]
    jax.block_until_ready(arrays)
    _reply({"address": server.address()})

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        server.await_pull(int(request["offer"]), arrays)
        return {"offered": request["offer"]}

    _serve_requests(handle)


def child_registry_server(config: dict[str, Any]) -> None:
    """A RegistryServer over a MemoryRegistry on a loopback port."""
    from tpusync.cluster import MemoryRegistry, RegistryServer

    server = RegistryServer(MemoryRegistry(), secret=bytes.fromhex(config["secret"]))
    try:
        _reply({"address": server.address})
        _serve_requests(lambda request: {})
    finally:
        server.close()


def child_store_server(config: dict[str, Any]) -> None:
    """A store node's server (``tpusync serve``'s StoreServer) lending ``dram_bytes``."""
    from tpusync.cluster import StoreServer

    server = StoreServer(
        config["dram_bytes"], secret=bytes.fromhex(config["secret"]), lease_ttl_s=LEASE_TTL_S
    )
    try:
        _reply({"address": server.address})
        _serve_requests(lambda request: {})
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
        from tpusync.tiers import HostPool

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
        from tpusync.cluster import BlockClient

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
        from tpusync.cluster import StoreNodePool

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


# -- iperf3 --------------------------------------------------------------------------------------


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


# iperf3 as tpusync runs within a host: a 256 KiB socket buffer (iperf3 sets both ends') and
# 1 MiB writes; here faster than its defaults (3.2-3.7 against 2.2-2.9 GB/s, one stream). The
# limit a loopback ratio divides by is the better of the two.
IPERF3_TUNED = ("-w", "256K", "-l", "1M")


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
        import jax
        from jax.experimental import transfer

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


# -- the benchmark parts ---------------------------------------------------------------------------


def bench_loopback(
    args: argparse.Namespace, cert: tuple[str, str] | None, log_dir: str, notes: list[str]
) -> dict[str, Any]:
    block_bytes = args.block_kib << 10
    blocks = (args.total_mib << 20) // block_bytes
    nbytes = blocks * block_bytes
    secret = secrets.token_bytes(32)
    conns = [int(c) for c in args.connections.split(",")]
    times: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        servers = [{"host": "127.0.0.1"}] + ([{"host": "127.0.0.1", "tls": True}] if cert else [])
        _, ready = start_child(
            stack,
            "block-server",
            "block-server",
            {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "servers": servers,
                "cert": cert,
            },
            log_dir,
        )
        ports = ready["ports"]
        puller = Puller(blocks, block_bytes, secret)
        stack.callback(puller.close)
        runs: dict[str, int] = {}  # name -> connections
        for tls in [False, True] if cert else [False]:
            port = ports[1] if tls else ports[0]
            for c in conns:
                name = f"tpusync{' TLS' if tls else ''} {c} conn{'s' if c > 1 else ''}"
                context = client_context(cert) if tls and cert else None
                puller.add(name, [f"127.0.0.1:{port}"], c, context, insecure=False)
                runs[name] = c
        # pushes of the same blocks (the target's, once pulled) to a store node's server
        layout = puller.target.layout
        _, store = start_child(
            stack,
            "store-server",
            "store-server",
            {"secret": secret.hex(), "dram_bytes": (blocks + 8) * layout.slot_bytes + (16 << 20)},
            log_dir,
        )
        pushes: list[str] = []
        for c in conns:
            pushes.append(f"tpusync push {c} conn{'s' if c > 1 else ''}")
            puller.add_pusher(pushes[-1], store["address"], c)
        iperf_port = None
        if iperf3_available():
            iperf_port = free_port()
            iperf3_server(stack, iperf_port, "127.0.0.1", None, log_dir)
        jax_puller = None
        try:
            jax_child, jax_ready = start_child(
                stack,
                "jax-server",
                "jax-server",
                {"blocks": blocks, "block_bytes": block_bytes},
                log_dir,
            )
            jax_puller = JaxPuller(jax_child, jax_ready["address"], blocks, block_bytes)
        except Exception as exc:
            notes.append(f"jax.experimental.transfer: n/a ({type(exc).__name__}: {exc})")
        # warm-up (and a byte-for-byte check of what each path delivers)
        for name in runs:
            puller.verify(name)
        for name in pushes:  # the node stores only blocks it verified
            puller.push(name)
        if iperf_port is not None:
            for c in conns:
                iperf3_gbps([("127.0.0.1", iperf_port, None)], nbytes, c, tries=20)
        if jax_puller is not None:
            try:
                jax_puller.pull(verify=True)
            except Exception as exc:
                notes.append(f"jax.experimental.transfer: n/a ({type(exc).__name__}: {exc})")
                jax_puller = None
        for _ in range(args.repeats):
            for name, c in runs.items():  # tpusync and iperf3 alternate, count by count
                times.setdefault(name, []).append(nbytes / puller.pull(name) / 1e9)
                if iperf_port is not None and " TLS" not in name:
                    label = f"iperf3 {c} stream{'s' if c > 1 else ''}"
                    for options, suffix in (((), ""), (IPERF3_TUNED, " " + " ".join(IPERF3_TUNED))):
                        gbps = iperf3_gbps(
                            [("127.0.0.1", iperf_port, None)], nbytes, c, options=options
                        )
                        times.setdefault(label + suffix, []).append(gbps)
            for name in pushes:  # the target holds every block after the pulls
                times.setdefault(name, []).append(nbytes / puller.push(name) / 1e9)
            if jax_puller is not None:
                times.setdefault("jax.experimental.transfer", []).append(
                    nbytes / jax_puller.pull() / 1e9
                )
            print(".", end="", flush=True)
        print(flush=True)
    if iperf_port is None:
        notes.append("iperf3: not installed (apt-get install iperf3); its column is skipped")
    return {
        "bytes": nbytes,
        "block_bytes": block_bytes,
        "blocks": blocks,
        "gbps": {k: median(v) for k, v in times.items()},
        "gbps_runs": times,
        "tls": cert is not None,
    }


@contextlib.contextmanager
def network_namespaces(rate_mbit: int) -> Iterator[tuple[str, str]]:
    """Two namespaces (server, client) joined by two veth pairs, one /24 each, every end shaped
    to ``rate_mbit`` with tbf; deleted on exit, also on error."""
    tag = f"{os.getpid() % 100000}"
    names = (f"tpsbench-s{tag}", f"tpsbench-c{tag}")
    created: list[str] = []
    burst = max(rate_mbit * 125_000 // 100, 256 << 10)  # 10 ms at the rate, at least 256 KiB

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)

    try:
        for name in names:
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        for k, (server_ip, client_ip) in enumerate(PATHS, 1):
            ends = ((names[0], f"p{k}s", server_ip), (names[1], f"p{k}c", client_ip))
            ip("link", "add", ends[0][1], "netns", names[0], "type", "veth",
               "peer", "name", ends[1][1], "netns", names[1])  # fmt: skip
            for ns, dev, address in ends:
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"],
                    check=True, capture_output=True, text=True, timeout=30,
                )  # fmt: skip
        yield names
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def netns_unavailable(args: argparse.Namespace) -> str | None:
    if args.skip_netns:
        return "skipped (--skip-netns)"
    if os.geteuid() != 0:
        return "skipped: needs root (network namespaces, veth, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"skipped: {' and '.join(missing)} not installed (apt-get install iproute2)"
    return None


def bench_netns(
    args: argparse.Namespace, cert: tuple[str, str] | None, log_dir: str, notes: list[str]
) -> dict[str, Any]:
    block_bytes = args.block_kib << 10
    blocks = (args.netns_mib << 20) // block_bytes
    nbytes = blocks * block_bytes
    secret = secrets.token_bytes(32)
    times: dict[str, list[float]] = {}
    with network_namespaces(args.rate_mbit) as (ns_server, ns_client), contextlib.ExitStack() as st:
        servers = [{"host": "0.0.0.0", "insecure": True}]
        servers += [{"host": "0.0.0.0", "tls": True}] if cert else []
        _, ready = start_child(
            st,
            "netns-block-server",
            "block-server",
            {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "servers": servers,
                "cert": cert,
            },
            log_dir,
            netns=ns_server,
        )
        clients = {}
        for tls in [False, True] if cert else [False]:
            port = ready["ports"][1 if tls else 0]
            paths = [f"{local}>{remote}:{port}" for remote, local in PATHS]
            suffix = " TLS" if tls else ""
            clients[f"one path{suffix}"] = {"addresses": paths[:1], "connections": 2, "tls": tls}
            clients[f"two paths{suffix}"] = {"addresses": paths, "connections": 2, "tls": tls}
        client, _ = start_child(
            st,
            "netns-block-client",
            "block-client",
            {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "clients": clients,
                "cert": cert,
            },
            log_dir,
            netns=ns_client,
        )
        iperf = iperf3_available()
        iperf_targets = [(remote, 5201 + k, local) for k, (remote, local) in enumerate(PATHS)]
        if iperf:
            for _, port, _ in iperf_targets:
                iperf3_server(st, port, None, ns_server, log_dir)
        timeout = 60 + 4 * nbytes * 8 / (args.rate_mbit * 1e6)
        for name in clients:
            client.request({"verify": name}, timeout)
        if iperf:
            iperf3_gbps(iperf_targets, nbytes, 1, ns_client, tries=20)
        for _ in range(args.repeats):
            for name in clients:
                seconds = client.request({"pull": name}, timeout)["seconds"]
                times.setdefault(name, []).append(nbytes / seconds / 1e9)
            if iperf:
                for label, targets in (
                    ("iperf3 one path", iperf_targets[:1]),
                    ("iperf3 two paths", iperf_targets),
                ):
                    gbps = iperf3_gbps(targets, nbytes, 1, ns_client)
                    times.setdefault(label, []).append(gbps)
            print(".", end="", flush=True)
        print(flush=True)
    if not iperf:
        notes.append("iperf3 (netns): not installed; the link ceiling is not measured")
    return {
        "bytes": nbytes,
        "rate_mbit_per_path": args.rate_mbit,
        "gbps": {k: median(v) for k, v in times.items()},
        "gbps_runs": times,
    }


def _lookup_rate(registry: Any, keys: list[bytes], window: float) -> float:
    from tpusync.cluster import longest_prefix

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
    import redis

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


def bench_registry(args: argparse.Namespace, log_dir: str, notes: list[str]) -> dict[str, Any]:
    from tpusync.cluster import MemoryRegistry, NodeInfo, RemoteRegistry

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
                from tpusync.cluster import RedisRegistry

                url = start_redis(stack, log_dir)
                redis_registry = RedisRegistry(url, prefix=f"bench{os.getpid()}")
                stack.callback(redis_registry.close)
                registries["RedisRegistry -> redis-server"] = redis_registry
            except Exception as exc:
                notes.append(f"RedisRegistry: n/a ({type(exc).__name__}: {exc})")
        for registry in registries.values():
            registry.register(node, ttl_s=3600)
            registry.publish(node.node_id, keys, "dram")
            _lookup_rate(registry, keys, 0.1)  # warm-up
        for _ in range(args.repeats):
            for name, registry in registries.items():
                rates.setdefault(name, []).append(_lookup_rate(registry, keys, args.lookup_s))
        for registry in registries.values():
            registry.unregister(node.node_id)
    return {
        "blocks": REGISTRY_BLOCKS,
        "key_bytes": len(keys[0]),
        "lookups_per_s": {k: median(v) for k, v in rates.items()},
        "lookups_per_s_runs": rates,
    }


# -- report --------------------------------------------------------------------------------------


def _ratio(name: str, value: float | None, target: float) -> dict[str, Any]:
    return {
        "ratio": name,
        "value": value,
        "target": target,
        "met": None if value is None else value >= target,
    }


def report(
    args: argparse.Namespace,
    loop: dict[str, Any],
    net: dict[str, Any] | None,
    reg: dict[str, Any],
    notes: list[str],
) -> list[dict[str, Any]]:
    g = loop["gbps"]
    mib = loop["bytes"] / 2**20
    print(
        f"\nloopback: {mib:.0f} MiB of {loop['block_bytes'] >> 10} KiB blocks per pull, two "
        f"processes, median of {args.repeats} (GB/s); tpusync verifies every block's checksum"
    )
    rows = []
    for name, value in g.items():
        runs = loop["gbps_runs"][name]
        rows.append([name, value, f"{min(runs):.2f}-{max(runs):.2f}"])
    if not any(k.startswith("iperf3") for k in g):
        rows.append(["iperf3", "n/a", "not installed"])
    if "jax.experimental.transfer" not in g:
        rows.append(["jax.experimental.transfer", "n/a", "see notes"])
    print_table(["path", "GB/s", "range"], rows)

    ratios = []
    for c in [int(c) for c in args.connections.split(",")]:
        plain = g.get(f"tpusync {c} conn{'s' if c > 1 else ''}")
        streams = f"iperf3 {c} stream{'s' if c > 1 else ''}"
        iperf = max(
            (v for k, v in g.items() if k.startswith(streams + " ") or k == streams), default=None
        )
        jax_gbps = g.get("jax.experimental.transfer")
        ratios.append(
            _ratio(
                f"tpusync {c} conn{'s' if c > 1 else ''} / best of {streams} (loopback)",
                plain / iperf if plain and iperf else None,
                TARGETS["iperf3"],
            )
        )
        ratios.append(
            _ratio(
                f"tpusync {c} conn{'s' if c > 1 else ''} / jax.experimental.transfer",
                plain / jax_gbps if plain and jax_gbps else None,
                TARGETS["jax"],
            )
        )
    if net is not None:
        n = net["gbps"]
        print(
            f"\ntwo namespaces, veth paths shaped to {args.rate_mbit} Mbit/s each (tbf), "
            f"{net['bytes'] / 2**20:.0f} MiB per pull, 2 connections, median of {args.repeats} "
            "(GB/s)"
        )
        rows = []
        for name, value in n.items():
            runs = net["gbps_runs"][name]
            rows.append([name, value, f"{min(runs):.3f}-{max(runs):.3f}", value * 8])
        print_table(["path", "GB/s", "range", "Gbit/s"], rows)
        for suffix in ("", " TLS"):
            one, two = n.get(f"one path{suffix}"), n.get(f"two paths{suffix}")
            if one and two:
                ratios.append(
                    _ratio(f"two striped paths / one{suffix}", two / one, TARGETS["striped"])
                )
    else:
        ratios.append(_ratio("two striped paths / one", None, TARGETS["striped"]))

    r = reg["lookups_per_s"]
    print(
        f"\nregistry: longest-prefix lookups of {reg['blocks']} blocks ({reg['key_bytes']}-byte "
        f"keys, all held by one live node), median of {args.repeats}"
    )
    rows = [
        [name, f"{value:,.0f}", f"{1e3 / value:.3f}", f"{value * reg['blocks']:,.0f}"]
        for name, value in r.items()
    ]
    print_table(["registry", "lookups/s", "ms/lookup", "keys/s"], rows)

    print("\ntargets")
    rows = [
        [
            r["ratio"],
            "n/a" if r["value"] is None else f"{r['value']:.2f}x",
            f">= {r['target']}x",
            {None: "-", True: "yes", False: "NO"}[r["met"]],
        ]
        for r in ratios
    ]
    print_table(["ratio", "value", "target", "met"], rows)
    if notes:
        print("\nnotes")
        for note in notes:
            print(f"- {note}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per loopback pull")
    parser.add_argument("--block-kib", type=int, default=2048, help="block size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--connections", default="1,2,4", help="loopback connection counts")
    parser.add_argument("--netns-mib", type=int, default=256, help="bytes per rate-limited pull")
    parser.add_argument("--rate-mbit", type=int, default=1000, help="each veth path's rate")
    parser.add_argument("--skip-netns", action="store_true", help="skip the two-path part")
    parser.add_argument("--lookup-s", type=float, default=0.5, help="seconds per lookup window")
    parser.add_argument("--json", default=DEFAULT_JSON)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run every finally block
    if args.child:
        CHILDREN[args.child[0]](json.loads(args.child[1]))
        return
    if args.rate_mbit > 2000:
        parser.error("--rate-mbit: at most 2000 (the paths must be slower than the CPUs)")
    notes: list[str] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpusync-bench-net-") as work:
        cert = make_certificate(work, ["127.0.0.1", *(server for server, _ in PATHS)])
        if cert is None:
            notes.append("TLS: openssl not installed; the TLS rows are skipped")
        print(f"loopback pulls ({args.total_mib} MiB) ", end="", flush=True)
        loop = bench_loopback(args, cert, work, notes)
        net = None
        why = netns_unavailable(args)
        if why is None:
            print(f"two-path pulls ({args.netns_mib} MiB) ", end="", flush=True)
            net = bench_netns(args, cert, work, notes)
        else:
            notes.append(f"two paths: {why}")
        print("registry lookups", flush=True)
        reg = bench_registry(args, work, notes)
    ratios = report(args, loop, net, reg, notes)
    elapsed = time.perf_counter() - start
    print(f"\n{elapsed:.0f} s in all")
    write_json(
        args.json,
        {
            "benchmark": "network",
            "repeats": args.repeats,
            "loopback": loop,
            "two_paths": net,
            "registry": reg,
            "args": {k: v for k, v in vars(args).items() if k != "child"},
            "targets": ratios,
            "notes": notes,
            "seconds": elapsed,
        },
    )


if __name__ == "__main__":
    main()
