"""The tiers and the store's configuration: lower tiers listed as specs that open
themselves (store nodes and registries included), the plain-data form of KVStoreConfig, and
the tier modules' homes."""

from __future__ import annotations

import dataclasses
import json
import secrets
import ssl
import subprocess
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from tools import require_tool

from tpusync import DevicePool
from tpusync._src.testing.model import ModelConfig
from tpusync._src.tiers.spec import OpenedTier, TierContext, TierSpec
from tpusync.cluster import (
    MemoryRegistry,
    PeerTier,
    RegistryServer,
    RegistryTier,
    StoreNode,
    StoreNodeTier,
)
from tpusync.errors import InvalidArgumentError
from tpusync.kv import (
    DiskTier,
    DramTier,
    ExistingTier,
    KVCacheStore,
    KVStoreConfig,
    SharedFsTier,
)
from tpusync.tiers import BlockTier, DiskPool, HostPool, PoolLayout, SharedFsPool

CFG = ModelConfig(num_blocks=32, max_blocks_per_seq=8)
SECRET = secrets.token_bytes(32)
TIMEOUT = 30.0


def model_pools(arrays: Any, rng: np.random.Generator) -> list[DevicePool]:
    return [
        DevicePool(jax.device_put(arrays.random(rng, CFG.kv_pool_shape, np.float32)))
        for _ in range(2 * CFG.n_layers)
    ]


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, CFG.vocab_size, n).tolist()


def directory(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


# --- tiers as specs ---------------------------------------------------------------------------


def test_tiers_are_listed_as_specs_the_store_opens(arrays, rng, tmp_path):
    disk, shared = directory(tmp_path / "disk"), directory(tmp_path / "shared")
    config = KVStoreConfig(
        "toy",
        CFG.block_size,
        DramTier(8),
        tiers=(DiskTier(disk, 16), SharedFsTier(shared)),
    )
    assert config.tier("disk") == DiskTier(disk, 16) and config.tier("nope") is None
    with KVCacheStore(config, model_pools(arrays, rng)) as store:
        assert store._stack.names == ["dram", "disk", "shared_fs"]
        assert isinstance(store._stack.tiers[1], DiskPool)
        assert isinstance(store._stack.tiers[2], SharedFsPool)
        assert store.save(tokens(rng, 2 * CFG.block_size), [0, 1]).stored_blocks == 2
        assert store.flush(TIMEOUT)
        assert [t.used for t in store._stack.tiers[1:]] == [2, 2]


@dataclasses.dataclass(frozen=True)
class SecondDramTier:
    """A tier kind the store knows nothing of: another DRAM pool as a lower tier."""

    capacity_blocks: int
    name: str = "ram2"
    opened: list[Any] = dataclasses.field(default_factory=list, compare=False)

    def check(self, context: TierContext) -> None:
        if context.default_secret:
            raise InvalidArgumentError(f"{self.name}: give the deployment's own secret")

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        pool = HostPool(layout, self.capacity_blocks, populate=False)
        self.opened.append(pool)
        return OpenedTier(pool)


def test_a_new_tier_kind_touches_no_store_code(arrays, rng):
    spec = SecondDramTier(16)
    assert isinstance(spec, TierSpec)
    pools = model_pools(arrays, rng)
    refused = KVStoreConfig("toy", CFG.block_size, DramTier(8), tiers=(spec,))
    with pytest.raises(InvalidArgumentError, match="ram2: give the deployment's own secret"):
        KVCacheStore(refused, pools)
    assert spec.opened == []  # checked before anything was opened
    config = dataclasses.replace(refused, secret=SECRET)
    with KVCacheStore(config, pools) as store:
        assert store._stack.names == ["dram", "ram2"]
        assert store.save(tokens(rng, 2 * CFG.block_size), [0, 1]).stored_blocks == 2
        assert store.flush(TIMEOUT)
        assert spec.opened[0].used == 2
    assert spec.opened[0].closed  # the store closes what it opened


def test_store_node_and_registry_tiers_need_no_layout(arrays, rng):
    pools = model_pools(arrays, rng)
    with StoreNode(8 << 20, secret=SECRET) as node:
        config = KVStoreConfig(
            "toy",
            CFG.block_size,
            DramTier(8),
            secret=SECRET,  # the data plane's secret too, as no tier has its own
            tiers=(StoreNodeTier(node.address), RegistryTier(MemoryRegistry(), exclude="me")),
        )
        with KVCacheStore(config, pools) as store:
            assert store._stack.names == ["dram", "node", "cluster"]
            assert store._stack.read_only == [False, False, True]
            assert store.save(tokens(rng, 2 * CFG.block_size), [0, 1]).stored_blocks == 2
            assert store.flush(TIMEOUT)
            assert store._stack.tiers[1].used == 2


def test_a_registry_tier_by_address_opens_and_closes_its_registry(arrays, rng):
    """The plain form's registry section: a RegistryServer's address; the tier opens the
    RemoteRegistry with the store and closes it with the store."""
    server = RegistryServer(MemoryRegistry(), secret=SECRET)
    try:
        data = {
            "model_id": "toy",
            "block_size": CFG.block_size,
            "dram": {"capacity_blocks": 8},
            "registry": {"address": server.address, "exclude": "me"},
        }
        config = dataclasses.replace(KVStoreConfig.from_dict(data), secret=SECRET)
        assert config.tiers == (RegistryTier(address=server.address, exclude="me"),)
        with KVCacheStore(config, model_pools(arrays, rng)) as store:
            tier = store._stack.tiers[1]
            assert store._stack.read_only == [False, True]
            assert tier.contains([b"k" * 16]) == [False]  # asks the server
            registry = tier.owned_registry
        assert tier.owned_registry is None and registry._closed
    finally:
        server.close()


def test_cluster_specs_check_their_fields():
    for make, match in [
        (lambda: StoreNodeTier(), r"^node\.address: give"),
        (lambda: StoreNodeTier("a:1", addresses=("b:2",)), r"^node\.address"),
        (lambda: StoreNodeTier("a:1", connections=0), r"^node\.connections"),
        (lambda: StoreNodeTier("a:1", timeout_s=0), r"^node\.timeout_s"),
        (lambda: StoreNodeTier("a:1", tls="yes"), r"^node\.tls"),
        (lambda: StoreNodeTier("a:1", name="a b"), r"^store_node\.name"),
        (lambda: PeerTier("a:1", secret=b""), r"^remote\.secret"),
        (lambda: PeerTier("a:1", secret=b"k" * 8), r"^remote\.secret .* 8 bytes; at least 16"),
        (lambda: RegistryTier(object()), r"^cluster\.registry"),
        (lambda: RegistryTier(), r"^cluster\.registry: give one of"),
        (lambda: RegistryTier(MemoryRegistry(), address="a:1"), r"^cluster\.registry: give one"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            make()


def test_an_existing_tier_is_used_as_it_is_and_left_open(arrays, rng):
    below = HostPool(new_layout := PoolLayout.from_pools("toy", model_pools(arrays, rng)), 8)
    try:
        config = KVStoreConfig(
            "toy", CFG.block_size, DramTier(8), tiers=(ExistingTier("ram", below),)
        )
        with KVCacheStore(config, model_pools(arrays, rng)) as store:
            assert store.layout == new_layout and store._stack.names == ["dram", "ram"]
        assert not below.closed  # the caller's to close
    finally:
        below.close()


def test_the_tiers_share_one_block_transaction():
    assert issubclass(DiskPool, BlockTier) and issubclass(SharedFsPool, BlockTier)
    for method in ("get", "_put", "_load_verified", "_report"):  # SharedFsPool.put: overwrite=
        assert method not in vars(DiskPool) and method not in vars(SharedFsPool), method


# --- the plain-data form ----------------------------------------------------------------------


def test_config_round_trips_through_plain_data(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET.hex() + "\n")
    node_secret = tmp_path / "node-secret"
    node_secret.write_text(secrets.token_hex(32))
    for path in (secret_file, node_secret):
        path.chmod(0o600)  # a secret file only its user may read
    data = {
        "model_id": "m",
        "block_size": 16,
        "weight_version": "step-9",
        "salt": "abcd",
        "secret_file": str(secret_file),
        "token_axis": 2,
        "writeback_policy": "skip",
        "dram": {"capacity_blocks": 4096, "name": "a"},
        "disk": {"directory": "/mnt/nvme/kv", "capacity_blocks": 100000, "durability": "none"},
        "shared_fs": [
            {"directory": "/mnt/lustre/kv", "mac": True},
            {"directory": "/mnt/nfs/kv", "name": "nfs", "capacity_blocks": 10},
        ],
        "store_node": {
            "addresses": ["10.0.0.9:7400", "10.0.1.9:7400"],
            "secret_file": str(node_secret),
        },
    }
    config = KVStoreConfig.from_dict(json.loads(json.dumps(data)))
    assert config.secret == SECRET and config.salt == bytes.fromhex("abcd")
    assert config.dram == DramTier(4096, name="a")
    assert [t.name for t in config.tiers] == ["disk", "shared_fs", "nfs", "node"]
    assert config.tiers[1] == SharedFsTier("/mnt/lustre/kv", mac=True)
    assert config.tiers[3].addresses == ("10.0.0.9:7400", "10.0.1.9:7400")
    plain = config.to_dict(secret_file=str(secret_file), secret_files={"node": str(node_secret)})
    assert json.loads(json.dumps(plain)) == plain == data
    assert KVStoreConfig.from_dict(plain) == config
    minimal = {"model_id": "m", "block_size": 16, "dram": {"capacity_blocks": 8}}
    assert KVStoreConfig.from_dict(minimal).to_dict() == minimal


def test_plain_data_errors_name_the_key_and_section(tmp_path):
    base = {"model_id": "m", "block_size": 16, "dram": {"capacity_blocks": 8}}
    bad_hex = tmp_path / "bad"
    bad_hex.write_text("not hex")
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(256)))  # not text at all: refused, never a UnicodeDecodeError
    for path in (bad_hex, raw):
        path.chmod(0o600)
    for data, match in [
        ({**base, "colour": "red"}, r"^colour: unknown key of the store's config"),
        ({**base, "dram": {"capacity_blocks": 8, "size": 1}}, r"^dram\.size: unknown key"),
        ({**base, "disk": {"directory": "/d", "capacity_blocks": 4, "x": 1}}, r"^disk\.x: "),
        ({**base, "shared_fs": [{"directory": "/s"}, {"dir": "/t"}]}, r"^shared_fs\[1\]\.dir: "),
        ({**base, "disk": {"directory": "/d"}}, r"^disk: "),
        ({**base, "secret": "00"}, r"^secret: unknown key"),
        ({**base, "secret_file": str(tmp_path / "absent")}, r"^secret_file: cannot read"),
        # not hex: raw bytes, as --secret-file reads them (7 too few, 256 too many for BLAKE2b)
        ({**base, "secret_file": str(bad_hex)}, r"^secret_file: .* 7 bytes, read as raw bytes"),
        ({**base, "secret_file": str(raw)}, r"^secret_file \(.*raw\): a secret of 256 bytes"),
        ({**base, "salt": "zz"}, r"^salt: expected a hex string"),
        ({"model_id": "m", "block_size": 16}, r"^dram: missing"),
        ({**base, "disk": {"directory": "/d", "capacity_blocks": 0}}, r"^disk\.capacity_blocks"),
        ([1, 2], r"^config: expected a mapping"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            KVStoreConfig.from_dict(data)


def test_to_dict_refuses_what_has_no_plain_form(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    config = KVStoreConfig("m", 16, DramTier(8), secret=SECRET)
    with pytest.raises(InvalidArgumentError, match=r"^secret: a secret is not written"):
        config.to_dict()
    with pytest.raises(InvalidArgumentError, match=r"^secret_file: .* holds another secret"):
        config.to_dict(secret_file=str(secret_file))
    with_registry = KVStoreConfig("m", 16, DramTier(8), tiers=(RegistryTier(MemoryRegistry()),))
    with pytest.raises(InvalidArgumentError, match=r"^registry\.registry: a MemoryRegistry"):
        with_registry.to_dict()
    mixed = KVStoreConfig(
        "m",
        16,
        DramTier(8),
        tiers=(DiskTier("/a", 4), SharedFsTier("/b"), DiskTier("/c", 4, name="d2")),
    )
    with pytest.raises(InvalidArgumentError, match=r"^tiers: tiers of one kind apart"):
        mixed.to_dict()


def test_a_client_tier_takes_a_ca_bundle_by_file_name(tmp_path):
    require_tool("openssl", "openssl")
    cert = tmp_path / "ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", str(tmp_path / "key.pem"), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    base = {"model_id": "m", "block_size": 16, "dram": {"capacity_blocks": 8}}
    node = {"address": "127.0.0.1:7", "tls_ca": str(cert)}
    config = KVStoreConfig.from_dict({**base, "store_node": node})
    (spec,) = config.tiers
    assert isinstance(spec.tls, ssl.SSLContext) and spec.tls.check_hostname
    assert spec.tls.verify_mode == ssl.CERT_REQUIRED
    # the context keeps no CA file name: to_dict says how to write the section instead
    with pytest.raises(
        InvalidArgumentError,
        match=r'^store_node\.tls: .*tls=None .*set "tls_ca" in its store_node section',
    ):
        config.to_dict()
    for section, match in [
        ({"address": "h:1", "tls_ca": str(tmp_path / "absent.pem")}, r"store_node\.tls_ca: cannot"),
        ({"address": "h:1", "tls_ca": 7}, r"^store_node\.tls_ca: expected the path"),
        ({"address": "h:1", "tls": "x"}, r"^store_node\.tls: unknown key; .* tls_ca"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            KVStoreConfig.from_dict({**base, "store_node": section})
