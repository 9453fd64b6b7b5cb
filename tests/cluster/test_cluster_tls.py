"""TLS on the cluster's connections: encrypted block pulls and registry calls, plaintext refused
off loopback unless asked for, and a plaintext peer of a TLS server served nothing. The
certificate is a real self-signed one made by ``openssl`` for 127.0.0.1."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cluster_dataplane import (
    CAPACITY,
    LAYOUT,
    SECRET,
    RenewalGate,
    assert_clean,
    assert_stops_at_deadline,
    fill,
    key_for,
    payload,
    slow_server,
)
from tools import require_tool

from tpusync._src.cluster.dataplane.frames import LOCAL_SEND_BUFFER_BYTES
from tpusync._src.cluster.dataplane.protocol import DEADLINE_FRACTION
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    MemoryRegistry,
    NodeInfo,
    RegistryServer,
    RemoteRegistry,
)
from tpusync.errors import InvalidArgumentError, PeerUnavailableError, RegistryUnavailableError
from tpusync.tiers import HostPool


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    require_tool("openssl", "openssl")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def contexts(certificate: tuple[Path, Path]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = certificate
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    return server, client


@pytest.fixture
def source(rng: np.random.Generator, arrays: Any) -> Iterator[HostPool]:
    with HostPool(LAYOUT, CAPACITY) as pool:
        fill(pool, [key_for(i) for i in range(24)], rng, arrays)
        yield pool


@pytest.fixture
def pools(source: HostPool) -> Iterator[tuple[HostPool, HostPool]]:
    with HostPool(LAYOUT, CAPACITY) as target:
        yield source, target


def test_block_pull_over_tls(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    source, target = pools
    server_tls, client_tls = contexts
    keys = [key_for(i) for i in range(12)]
    with (
        BlockServer(source, secret=SECRET, tls=server_tls) as server,
        BlockClient(server.address, secret=SECRET, tls=client_tls, connections=2) as client,
    ):
        assert client.pull(keys, target) == [True] * 12
        for key in keys:
            assert payload(target, key) == payload(source, key)
        assert_clean(target, 12)
        # TLS record writes ran slower through the small loopback send buffer: left autotuned
        with server._lock:
            served = list(server._conns)
        with open("/proc/sys/net/core/wmem_max") as f:  # what SO_SNDBUF is capped at
            small = 2 * min(LOCAL_SEND_BUFFER_BYTES, int(f.read()))
        assert served and all(
            c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) != small for c in served
        )


def test_store_node_push_and_pull_over_tls(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """A store node over TLS: blocks pushed to it (received by the Python ssl path) and
    pulled back equal the source's."""
    from tpusync.cluster import StoreNode, StoreNodePool

    source, target = pools
    server_tls, client_tls = contexts
    keys = [key_for(i) for i in range(10)]
    with (
        StoreNode(8 << 20, secret=SECRET, tls=server_tls) as node,
        StoreNodePool(
            node.address, layout=LAYOUT, secret=SECRET, tls=client_tls, connections=2
        ) as tier,
    ):
        assert tier.put(keys, source) == 10
        tier.get(keys, target)
        for key in keys:
            assert payload(target, key) == payload(source, key)


def test_a_plaintext_client_of_a_tls_server_gets_nothing(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """It fails long before its timeout (both sides used to wait for the other to speak
    first, until the client's timeout said "timed out"), saying the server speaks TLS and
    what to give; the server logs it as a peer that sent nothing to a TLS server."""
    source, target = pools
    with BlockServer(source, secret=SECRET, tls=contexts[0]) as server:
        start = time.monotonic()
        with pytest.raises(PeerUnavailableError) as refused:
            BlockClient(server.address, secret=SECRET, timeout_s=120)
        took = time.monotonic() - start
        assert len(server.leases) == 0
        assert server.refusals() == {"sent nothing to this TLS server (a client without TLS?)": 1}
    assert_clean(target, 0)
    message = str(refused.value)
    assert message.startswith(f"tls: the block server at {server.address} serves TLS only")
    assert "tls=ssl.create_default_context(cafile=CA)" in message and "--tls-ca" in message
    assert took < 60  # about a second (TLS_HINT_S); half the timeout is a margin for load


def test_a_tls_client_of_a_plaintext_server_is_told_so(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    source, _ = pools
    with (
        BlockServer(source, secret=SECRET) as server,
        pytest.raises(PeerUnavailableError, match="does not serve TLS") as refused,
    ):
        BlockClient(server.address, secret=SECRET, tls=contexts[1], timeout_s=120)
    assert "connect without tls=" in str(refused.value)


def test_a_client_that_does_not_trust_the_certificate_refuses(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    source, _ = pools
    untrusting = ssl.create_default_context()  # the system CAs: not our self-signed one
    with (
        BlockServer(source, secret=SECRET, tls=contexts[0]) as server,
        pytest.raises(PeerUnavailableError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        BlockClient(server.address, secret=SECRET, tls=untrusting, timeout_s=3)


def test_registry_over_tls(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    registry = MemoryRegistry()
    with RegistryServer(registry, secret=SECRET, tls=contexts[0]) as server:
        remote = RemoteRegistry(server.address, secret=SECRET, tls=contexts[1])
        try:
            remote.register(NodeInfo("n1", addresses=("10.0.0.1:9",)), 5.0)
            remote.publish("n1", [b"k" * 24], "dram")
            assert [[h.node_id for h in held] for held in remote.holders([b"k" * 24])] == [["n1"]]
        finally:
            remote.close()
        with pytest.raises(RegistryUnavailableError, match="serves TLS only"):
            RemoteRegistry(server.address, secret=SECRET, timeout_s=120)  # plaintext
    with (
        RegistryServer(registry, secret=SECRET) as plain,
        pytest.raises(RegistryUnavailableError, match="does not serve TLS"),
    ):
        RemoteRegistry(plain.address, secret=SECRET, tls=contexts[1], timeout_s=120)


def test_plaintext_off_loopback_is_refused_unless_asked_for(source: HostPool) -> None:
    with pytest.raises(InvalidArgumentError, match="encrypted by default"):
        BlockServer(source, secret=SECRET, host="0.0.0.0")
    with pytest.raises(InvalidArgumentError, match="encrypted by default"):
        BlockClient("10.255.255.1:7000", secret=SECRET)
    with pytest.raises(InvalidArgumentError, match="encrypted by default"):
        RegistryServer(MemoryRegistry(), host="0.0.0.0", secret=SECRET)
    with pytest.raises(InvalidArgumentError, match="encrypted by default"):
        RemoteRegistry("10.255.255.1:7000", secret=SECRET)
    with BlockServer(source, secret=SECRET, host="0.0.0.0", insecure=True) as server:
        assert server.port > 0  # listening in the clear, as asked
    with pytest.raises(InvalidArgumentError, match=r"tls: expected an ssl\.SSLContext"):
        BlockServer(source, secret=SECRET, tls="yes")  # type: ignore[arg-type]


def test_a_pull_over_tls_stops_at_its_deadline(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """Real time, TLS (whose reads wait in Python, not in the native loop): a block every 0.3 s
    under a 1 s lease that is never renewed; the client stops after 0.8 s and keeps only the
    blocks it completed."""
    source, target = pools
    server_tls, client_tls = contexts
    slow = slow_server(0.3, renews=False)
    keys = [key_for(i) for i in range(6)]
    with (
        slow(source, secret=SECRET, lease_ttl_s=1.0, tls=server_tls) as server,
        BlockClient(server.address, secret=SECRET, tls=client_tls, timeout_s=5.0) as client,
    ):
        assert_stops_at_deadline(client, keys, target)


def test_a_pull_over_tls_follows_its_renewed_deadline(
    pools: tuple[HostPool, HostPool], contexts: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """TLS: 8 blocks under a 2 s lease (the pull's first deadline: 1.6 s), the last sent only
    once the server has granted three renewals (at least 2 s in): each renewal moves the deadline
    on, and reads wait by the moved deadline, not by the one they started with. Events, not
    sleeps: a renewal's round trip has about 0.9 s of margin, which holds on a loaded machine."""
    source, target = pools
    server_tls, client_tls = contexts
    gate = RenewalGate(last=8, renewals=3)
    keys = [key_for(i) for i in range(8)]
    with (
        gate.server(source, secret=SECRET, lease_ttl_s=2.0, tls=server_tls) as server,
        BlockClient(server.address, secret=SECRET, tls=client_tls, timeout_s=5.0) as client,
    ):
        start = time.monotonic()
        result = client.pull_result(keys, target)
        assert result.loaded == [True] * 8 and result.released and result.error is None
        assert gate.last_sent_at is not None
        assert gate.last_sent_at - start > 2.0 * DEADLINE_FRACTION  # past the first deadline
        assert server.leases.expired == 0
        for key in keys:
            assert payload(target, key) == payload(source, key)
        assert_clean(target, 8)
