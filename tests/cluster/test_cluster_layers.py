"""The cluster layer's shape: kv imports no cluster, not even inside a function;
serving a store lives in ``tpusync._src.cluster.serving`` (the store has no ``serve`` /
``publish_to`` of its own); cluster errors live in ``tpusync.errors``; the moved modules are gone
from their old paths; one options dataclass per server kind; one node-lease rule.
"""

from __future__ import annotations

import ast
import json
import secrets
import subprocess
import sys

import numpy as np
import pytest
from paths import REPO

import tpusync.cluster as cluster
import tpusync.errors as errors
from tpusync._src.cluster import serving
from tpusync._src.cluster.registry._leases import has_lapsed, lapsed_nodes, lease_end, live_nodes
from tpusync._src.cluster.tcp_server import BlockServerOptions, ServerOptions
from tpusync.cluster import BlockServer, MemoryRegistry, NodeInfo, RegistryServer
from tpusync.errors import InvalidArgumentError
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

SRC = REPO / "src" / "tpusync"
SECRET = secrets.token_bytes(32)


def _store(rng: np.random.Generator, model_id: str = "toy-layers") -> object:
    import jax.numpy as jnp

    from tpusync import DevicePool
    from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig

    pools = [
        DevicePool(jnp.asarray(rng.standard_normal((16, 16, 2, 8), dtype=np.float32)))
        for _ in range(2)
    ]
    return KVCacheStore(KVStoreConfig(model_id, 16, DramTier(16)), pools)


def test_kv_imports_no_cluster() -> None:
    """No module of tpusync.kv imports tpusync.cluster, at module level or inside a function,
    and importing the whole of tpusync.kv loads no cluster module."""
    for path in sorted((SRC / "kv").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.startswith("tpusync.cluster") for n in names), path
    code = (
        "import sys, json, tpusync.kv; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tpusync.cluster'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []


def test_serving_publish_to(rng: np.random.Generator) -> None:
    registry = MemoryRegistry()
    store = _store(rng)
    try:
        serving.publish_to(store, registry, NodeInfo("n1"), ttl_s=30)
        assert [n.node_id for n in registry.nodes()] == ["n1"]
        with pytest.raises(InvalidArgumentError, match="already publishes"):
            serving.publish_to(store, registry, NodeInfo("n2"))
        assert [n.node_id for n in registry.nodes()] == ["n1"]  # the refusal changed nothing
    finally:
        store.close()
    assert registry.nodes() == []
    assert not hasattr(store, "publish_to")  # the store's own spelling is gone (issue 55)


def test_serving_serve(rng: np.random.Generator) -> None:
    registry = MemoryRegistry()
    store = _store(rng)
    try:
        server = serving.serve(store, registry, "srv", secret=SECRET, ttl_s=30)
        assert isinstance(server, BlockServer)
        assert [n.addresses for n in registry.nodes()] == [(server.address,)]
    finally:
        store.close()
    assert registry.nodes() == []
    assert not hasattr(store, "serve")  # the store's own spelling is gone (issue 55)


def test_serving_refuses_a_closed_store_before_listening(rng: np.random.Generator) -> None:
    store = _store(rng)
    store.close()
    with pytest.raises(InvalidArgumentError):
        serving.serve(store, MemoryRegistry(), "x", secret=SECRET)
    with pytest.raises(InvalidArgumentError, match="store: expected a KVCacheStore"):
        serving.publish_to(object(), MemoryRegistry(), NodeInfo("x"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        "AuthenticationError",
        "DeadlineExceededError",
        "FrameError",
        "PeerUnavailableError",
        "RegistryUnavailableError",
        "RemoteOperationUnsupportedError",
    ],
)
def test_cluster_errors_live_in_errors(name: str) -> None:
    """Each is defined and exported once, in tpusync.errors (issue 55), not again by
    tpusync.cluster."""
    cls = getattr(errors, name)
    assert name in errors.__all__
    assert issubclass(cls, errors.TpuSyncError)
    assert cls.__module__ == "tpusync.errors"
    assert name not in cluster.__all__


def test_cluster_all_is_kept() -> None:
    kept = {
        "BlockClient", "BlockServer", "Holder", "JaxRegistry", "Lease", "LeaseTable",
        "MemoryRegistry", "NodeInfo", "PullResult", "RedisRegistry", "Registry", "RegistryPool",
        "RegistryServer", "RemotePool", "RemoteRegistry", "StoreNode", "StoreNodePool",
        "StoreServer", "longest_common_prefix", "longest_prefix",
    }  # fmt: skip
    assert kept <= set(cluster.__all__)
    assert all(hasattr(cluster, n) for n in cluster.__all__)


def test_server_options_are_spelled_once(rng: np.random.Generator) -> None:
    """Servers take their options as keywords or as one options object, checked alike."""
    registry = MemoryRegistry()
    with RegistryServer(registry, options=ServerOptions(secret=SECRET)) as server:
        assert server.options.port == 0 and server.port != 0  # asked for a free one
    with pytest.raises(InvalidArgumentError, match="not both"):
        RegistryServer(registry, options=ServerOptions(secret=SECRET), secret=SECRET)
    with pytest.raises(InvalidArgumentError, match="lease_ttl_s"):
        BlockServerOptions(secret=SECRET, lease_ttl_s=0)
    with pytest.raises(InvalidArgumentError, match="handshake_timeout_s"):
        ServerOptions(secret=SECRET, handshake_timeout_s=-1)
    with pytest.raises(InvalidArgumentError, match="secret"):
        ServerOptions(secret=b"short")
    layout = PoolLayout("toy-options", (ArrayLayout("f32", "float32", (4, 8), 0, 1),))
    with (
        HostPool(layout, 4) as pool,
        BlockServer(pool, options=BlockServerOptions(secret=SECRET, lease_ttl_s=3)) as blocks,
    ):
        assert blocks.lease_ttl_s == 3.0


def test_the_node_lease_rule() -> None:
    """One liveness rule: a lease ends ttl after it was taken and has lapsed at its end."""
    end = lease_end(2.0, 10.0)
    assert end == 12.0
    assert not has_lapsed(end, 11.999) and has_lapsed(end, 12.0) and has_lapsed(None, 0.0)
    assert lapsed_nodes([("a", 5.0), ("b", 15.0)], 10.0) == ["a"]
    assert live_nodes({"a": 5.0, "b": 15.0}, 10.0) == {"b"}
    with pytest.raises(InvalidArgumentError, match="ttl_s"):
        lease_end(0, 1.0)
    clock = [100.0]
    registry = MemoryRegistry(clock=lambda: clock[0])
    registry.register(NodeInfo("n"), 2.0)
    clock[0] = 101.999
    assert registry.heartbeat("n", 2.0)  # renewed: ends at 103.999
    clock[0] = 103.999
    assert not registry.heartbeat("n", 2.0) and registry.nodes() == []
