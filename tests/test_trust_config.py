"""Issue 17, "no wrong output from a plausible mistake, nothing destroyed": a configuration that
contradicts what it is given is refused when the store (or `tpusync serve`) starts, naming both
values and the fix, and a refused start makes nothing (no pool, no directory).

Real stores over the test model's KV pools (random bits), real tiers (a store node on loopback, a
RegistryPool, a DiskPool), real directories, real tmpfs mounts, and real `python -m tpusync
serve` children (stopped by pid, with timeouts).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from mounts import tmpfs

from tpusync import DevicePool
from tpusync.cluster import MemoryRegistry, RegistryPool, StoreNode, StoreNodePool
from tpusync.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    TierFullError,
)
from tpusync.kv import (
    DiskTier,
    DramTier,
    ExistingTier,
    KVCacheStore,
    KVStoreConfig,
    SharedFsTier,
)
from tpusync.testing.model import ModelConfig
from tpusync.tiers import ArrayLayout, DiskPool, PoolLayout
from tpusync.tiers.dram import pool_path

MiB = 1 << 20
# The test model's KV pools, made small: 8 arrays of (32 blocks, 16 tokens, 2 heads, 32).
CFG = ModelConfig(num_blocks=32, max_blocks_per_seq=8)
SECRET = secrets.token_bytes(32)
TIMEOUT = 20.0
SERVE_TIMEOUT = 60.0


def model_pools(arrays: Any, rng: np.random.Generator, dtype: Any = np.float32) -> list[DevicePool]:
    """The test model's KV pools (``CFG.kv_pool_shape``, K and V per layer) of random bits."""
    return [
        DevicePool(jax.device_put(arrays.random(rng, CFG.kv_pool_shape, dtype)), name=f"kv{i}")
        for i in range(2 * CFG.n_layers)
    ]


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, CFG.vocab_size, n).tolist()


def mem_available() -> int:
    """MemAvailable in bytes (read here, not through the code under test)."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib << 10


# --- 1. a block size that contradicts the pools ------------------------------------------------


def test_block_size_that_contradicts_the_pools_is_refused(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, shm_names: Callable[[], str]
) -> None:
    """block_size=32 over pools of 16-token blocks used to be accepted: a save keyed 32-token
    "blocks" onto 16-token device blocks and a later load gave wrong logits. Now the store
    refuses it before making anything, naming both sizes, the pool's shape and the fix."""
    pools = model_pools(arrays, rng)
    name = shm_names()
    disk = tmp_path / "disk"
    config = KVStoreConfig(
        "toy",
        2 * CFG.block_size,
        DramTier(8, name=name),
        tiers=(DiskTier(disk, 8, create=True),),
    )
    with pytest.raises(ShapeMismatchError) as info:
        KVCacheStore(config, pools)
    message = str(info.value)
    assert message.startswith("block_size: 32 tokens per block, but device_pools[0] of shape ")
    assert f"shape {CFG.kv_pool_shape} holds 16 on token_axis=1" in message
    assert "set block_size=16" in message and "token_axis=2" in message  # both fixes
    assert not pool_path(name).exists(), "a refused store made its DRAM pool"
    assert not disk.exists(), "a refused store made its disk directory"

    # The pools' own block size: saved and loaded back bit for bit.
    with KVCacheStore(dataclasses.replace(config, block_size=CFG.block_size), pools) as store:
        prompt = tokens(rng, 3 * CFG.block_size)
        assert store.save(prompt, [4, 9, 2]).stored_blocks == 3
        before = [np.array(arrays.bits(p.array)[[4, 9, 2]], copy=True) for p in pools]
        with store.lookup(prompt) as hit:
            assert store.load(hit, [20, 21, 22]).loaded_blocks == 3
        for pool, expected in zip(pools, before, strict=True):
            arrays.assert_same(arrays.bits(pool.array)[[20, 21, 22]], expected, "loaded")


def test_token_axis_names_the_pools_token_axis(arrays: Any, rng: np.random.Generator) -> None:
    """vLLM's CPU layout [num_blocks, kv_heads, block_size, 2*head_dim] keeps tokens on axis 2:
    the default (the axis after block_axis) is refused with the fix, token_axis=2 works."""
    heads, block, width = 4, 16, 16
    pools = [
        DevicePool(jax.device_put(arrays.random(rng, (12, heads, block, width), np.float32)))
        for _ in range(2)
    ]
    config = KVStoreConfig("vllm-cpu", block, DramTier(8))
    with pytest.raises(ShapeMismatchError, match=r"^block_size: 16 tokens per block") as info:
        KVCacheStore(config, pools)
    assert "holds 4 on token_axis=1 (the default: block_axis + 1)" in str(info.value)
    with KVCacheStore(dataclasses.replace(config, token_axis=2), pools) as store:
        prompt = tokens(rng, 2 * block)
        assert store.save(prompt, [3, 5]).stored_blocks == 2
        with store.lookup(prompt) as hit:
            assert store.load(hit, [8, 9]).loaded_blocks == 2
        for pool in pools:
            host = arrays.bits(pool.array)
            arrays.assert_same(host[[8, 9]], host[[3, 5]], "loaded")

    # vLLM's (2, num_blocks, block_size, heads, dim) with block_axis=1: tokens on axis 2.
    stacked = [DevicePool(jax.device_put(arrays.random(rng, (2, 12, block, 2, 8), np.float32)))]
    with KVCacheStore(KVStoreConfig("vllm-gpu", block, DramTier(4), block_axis=1), stacked):
        pass
    with pytest.raises(ShapeMismatchError, match=r"^token_axis: token_axis=4 is out of range"):
        KVCacheStore(dataclasses.replace(config, token_axis=4), pools)
    for bad in (1, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match=r"^token_axis: "):
            KVStoreConfig("m", 16, DramTier(4), block_axis=1, token_axis=bad)


def test_dram_tier_larger_than_memory_is_refused(arrays: Any, rng: np.random.Generator) -> None:
    """An anonymous DRAM tier beyond MemAvailable would be prefaulted into the OOM killer: it is
    refused before anything is mapped, naming the field and its block size."""
    pools = model_pools(arrays, rng)
    slot = PoolLayout.from_pools("toy", pools).slot_bytes
    capacity = (mem_available() + (8 << 30)) // slot
    config = KVStoreConfig("toy", CFG.block_size, DramTier(capacity))
    with pytest.raises(TierFullError, match=r"^dram.capacity_blocks: .* asked for, but") as info:
        KVCacheStore(config, pools)
    assert f"({capacity} blocks of {slot} B)" in str(info.value)


# --- 1b. an extra tier built for another layout --------------------------------------------


def test_extra_tier_of_another_layout_is_refused(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, shm_names: Callable[[], str]
) -> None:
    """A store node tier made for another model id, a cluster tier of another dtype and a disk
    tier of another shape were accepted (their blocks could never be this store's): each is
    refused at construction, naming both values, and nothing is made."""
    pools = model_pools(arrays, rng)
    own = PoolLayout.from_pools("toy", pools)
    bf16 = PoolLayout.from_pools("toy", model_pools(arrays, rng, ml_dtypes.bfloat16))
    wide = PoolLayout(
        "toy", tuple(dataclasses.replace(a, shard_block_shape=(16, 4, 32)) for a in own.arrays)
    )
    name = shm_names()
    (tmp_path / "other-disk").mkdir()
    with (
        StoreNode(8 * MiB, secret=SECRET, max_layouts=2) as node,
        StoreNodePool(
            node.address, layout=PoolLayout.from_pools("other-model", pools), secret=SECRET
        ) as other_model,
        RegistryPool(MemoryRegistry(), bf16, secret=SECRET) as other_dtype,
        DiskPool(wide, 4, tmp_path / "other-disk") as other_shape,
        StoreNodePool(node.address, layout=own, secret=SECRET) as same,
    ):
        cases: list[tuple[Any, type[Exception], str]] = [
            (other_model, InvalidArgumentError, "model_id 'other-model', this store's 'toy'"),
            (other_dtype, DtypeMismatchError, "dtype 'bfloat16', this store's pools 'float32'"),
            (other_shape, ShapeMismatchError, "shard_block_shape (16, 4, 32), this store's pools "),
        ]
        for tier, error, what in cases:
            config = KVStoreConfig(
                "toy", CFG.block_size, DramTier(8, name=name), tiers=(ExistingTier("t", tier),)
            )
            with pytest.raises(error, match=r"^tiers\[0\] \('t'\): the tier was built") as info:
                KVCacheStore(config, pools)
            assert what in str(info.value) and "store.layout" in str(info.value)
            assert not pool_path(name).exists(), "a refused store made its DRAM pool"
        # The store's own layout is taken, and the node tier works through it.
        config = KVStoreConfig(
            "toy", CFG.block_size, DramTier(8), tiers=(ExistingTier("node", same),)
        )
        with KVCacheStore(config, pools) as store:
            assert store.save(tokens(rng, 2 * CFG.block_size), [0, 1]).stored_blocks == 2
            assert store.flush(TIMEOUT)
        assert same.used == 2


# --- 2. a missing tier directory -------------------------------------------------------------


def test_missing_tier_directory_is_refused_unless_create(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, shm_names: Callable[[], str]
) -> None:
    """DiskTier("/mnt/nvme/kv") on a host where the disk is not mounted used to create the
    directory on / (and fill it); now a missing directory is refused, naming the path and the
    fix, unless create=True, which makes it 0700."""
    pools = model_pools(arrays, rng)
    missing = tmp_path / "mnt" / "nvme" / "kv"
    for tiers, argument, kind in [
        (DiskTier(missing, 8), "disk.directory", "DiskTier"),
        (SharedFsTier(missing), "shared_fs.directory", "SharedFsTier"),
    ]:
        name = shm_names()
        config = KVStoreConfig("toy", CFG.block_size, DramTier(8, name=name), tiers=(tiers,))
        with pytest.raises(
            InvalidArgumentError, match=rf"^{argument}: {re.escape(str(missing))} does not exist"
        ) as info:
            KVCacheStore(config, pools)
        assert f"{kind}(..., create=True)" in str(info.value)
        assert not (tmp_path / "mnt").exists(), "a refused store made the directory"
        assert not pool_path(name).exists(), "a refused store made its DRAM pool"
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError, match=r"^disk.create: expected True or False"):
            DiskTier(missing, 8, create=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"^shared_fs.create: expected True"):
            SharedFsTier(missing, create=bad)  # type: ignore[arg-type]

    shared = tmp_path / "shared" / "kv"
    config = KVStoreConfig(
        "toy",
        CFG.block_size,
        DramTier(8),
        tiers=(DiskTier(missing, 8, create=True), SharedFsTier(shared, create=True)),
    )
    with KVCacheStore(config, pools) as store:
        for made in (missing, shared):
            assert stat.S_IMODE(made.stat().st_mode) == 0o700
        assert store.save(tokens(rng, 2 * CFG.block_size), [0, 1]).stored_blocks == 2
        assert store.flush(TIMEOUT)
        assert [t.used for t in store._stack.tiers[1:]] == [2, 2]
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o700)
    config = KVStoreConfig("toy", CFG.block_size, DramTier(8), tiers=(DiskTier(existing, 8),))
    with KVCacheStore(config, pools) as store:  # an existing directory needs no create
        assert store._stack.tiers[1].used == 0


# --- 3. `tpusync serve` with sizes or paths this host cannot give -----------------------------


def serve(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """Runs `python -m tpusync serve ARGS` and returns (exit code, stdout, stderr); a child
    still running after SERVE_TIMEOUT (it accepted the arguments) is killed by pid."""
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    child = subprocess.Popen(
        [sys.executable, "-m", "tpusync", "serve", *args, "--secret-file", str(secret)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    try:
        out, err = child.communicate(timeout=SERVE_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate(timeout=10)
        pytest.fail(f"`tpusync serve {' '.join(args)}` kept running: {out!r} {err[-2000:]!r}")
    return child.returncode, out, err


def _beyond_memory() -> str:
    """A --dram of 8 GiB more than MemAvailable."""
    return f"{(mem_available() >> 30) + 8}GiB"


@pytest.mark.parametrize(
    "case",
    [
        "100TiB of DRAM",
        "more DRAM than this host has",
        "a missing disk directory",
        "a disk path that is a file",
        "a disk on a read-only mount",
        "more disk than its mount has",
        "a named pool larger than its shm directory",
    ],
)
def test_serve_refuses_what_this_host_cannot_lend(tmp_path: Path, case: str) -> None:
    """`tpusync serve` used to print its ready line and run whatever --dram or --disk said;
    nothing was checked until a client pushed. Now it exits 2 at start with a message naming
    the flag, and prints no ready line."""
    mount: tuple[str, str] | None = None
    if case == "100TiB of DRAM":
        args, expected = ["--dram", "100TiB"], "--dram: 100.0 TiB asked for, but this host has "
    elif case == "more DRAM than this host has":
        args, expected = ["--dram", _beyond_memory()], "of memory available (MemAvailable"
    elif case == "a missing disk directory":
        args = ["--dram", "64MiB", "--disk", "/proc/x", "--disk-size", "1GiB"]
        expected = "--disk: /proc/x does not exist; create it (or mount its filesystem) first"
    elif case == "a disk path that is a file":
        (tmp_path / "file").write_bytes(b"not a directory")
        args = ["--dram", "64MiB", "--disk", str(tmp_path / "file"), "--disk-size", "1GiB"]
        expected = f"--disk: {tmp_path / 'file'} is not a directory"
    elif case == "a disk on a read-only mount":
        mount = ("size=4m,ro", "--disk")
        args = ["--dram", "64MiB", "--disk-size", "2MiB"]
        expected = "--disk: cannot create files in "
    elif case == "more disk than its mount has":
        mount = ("size=4m", "--disk")
        args = ["--dram", "64MiB", "--disk-size", "64MiB"]
        expected = "--disk-size: 64.0 MiB asked for, but "
    else:
        mount = ("size=4m", "--shm-dir")
        args = ["--dram", "64MiB", "--name", f"trust-{secrets.token_hex(4)}"]
        expected = "--dram: 64.0 MiB asked for, but "
    if mount is None:
        code, out, err = serve(tmp_path, *args)
    else:
        with tmpfs(tmp_path / "mnt", mount[0]) as where:
            code, out, err = serve(tmp_path, *args, mount[1], str(where))
            assert list(where.iterdir()) == [], "a refused node left files behind"
    assert code == 2, f"exit {code}: {out!r} {err[-2000:]!r}"
    assert out == "", f"a refused node printed {out!r}"
    assert expected in err, err[-2000:]
    assert "lending" not in err and "Traceback" not in err


def test_store_server_refuses_room_it_lacks_and_counts_its_own_pools(
    tmp_path: Path, rng: np.random.Generator, arrays: Any
) -> None:
    """The API refuses too, naming its arguments; a restarted named node's own pool files count
    as room (an 8 MiB tmpfs holding a 6 MiB pool restarts it, and refuses a second one)."""
    with pytest.raises(TierFullError, match=r"^dram_bytes: 100.0 TiB asked for"):
        StoreNode(100 << 40, secret=SECRET)
    with pytest.raises(InvalidArgumentError, match=r"^disk_dir: .* does not exist"):
        StoreNode(4 * MiB, secret=SECRET, disk_dir=tmp_path / "absent", disk_bytes=2 * MiB)
    assert not (tmp_path / "absent").exists()
    layout = PoolLayout("trust-node", (ArrayLayout("k", "uint8", (128 * 1024,), 0, 1),))
    name = f"trust-{secrets.token_hex(4)}"
    with tmpfs(tmp_path / "shm", "size=8m") as shm:
        with (
            StoreNode(6 * MiB, secret=SECRET, name=name, shm_dir=str(shm)) as node,
            StoreNodePool(node.address, layout=layout, secret=SECRET, timeout_s=5.0),
        ):
            assert len(node.server.pools) == 1  # made at the client's hello
        assert os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize < 6 * MiB
        with StoreNode(6 * MiB, secret=SECRET, name=name, shm_dir=str(shm)) as node:
            assert [p.capacity for p in node.server.pools] == [48]  # re-attached
        with pytest.raises(TierFullError, match=rf"^dram_bytes: 6.0 MiB asked for, but {shm}"):
            StoreNode(6 * MiB, secret=SECRET, name=f"{name}-b", shm_dir=str(shm))
