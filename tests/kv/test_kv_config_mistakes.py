"""No wrong output from a plausible mistake, nothing destroyed: a configuration that
contradicts what it is given is refused when the store (or `tpusync serve`) starts, naming both
values and the fix, and a refused start makes nothing (no pool, no directory).

Real stores over the test model's KV pools (random bits), real tiers (a store node on loopback, a
RegistryPool, a DiskPool), real directories, real tmpfs mounts, and real `python -m tpusync
serve` children (stopped by pid, with timeouts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mounts import tmpfs

from tpusync import DevicePool
from tpusync._src.testing.model import ModelConfig
from tpusync._src.tiers.dram import pool_path
from tpusync.cluster import MemoryRegistry, RegistryPool, StoreNode, StoreNodePool
from tpusync.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    TierFullError,
    TpuSyncError,
    UnsafeFileError,
)
from tpusync.kv import (
    DiskTier,
    DramTier,
    ExistingTier,
    KVCacheStore,
    KVStoreConfig,
    SharedFsTier,
    load_secret,
)
from tpusync.tiers import ArrayLayout, DiskPool, PoolLayout

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
    secret.chmod(0o600)
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


# === issue 53 (trust, part 3): every config path refuses at once, by one set of rules ========
#
# Each case: refused with a tpusync error naming the config key and the fix; nothing made or
# removed among the names the test made (a per-run prefix; /dev/shm as a whole is never
# compared: other runs share it); no call blocks (each runs on a thread joined with a bound).

RUN = f"trust53-{secrets.token_hex(4)}"  # this run's names in /dev/shm start with it
OTHER_UID = 65534  # nobody
BOUND_S = 10.0
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="making a directory of another uid needs root (chown)"
)
BASE = {"model_id": "toy", "block_size": CFG.block_size, "dram": {"capacity_blocks": 8}}


def bounded(call: Callable[[], Any], fifos: tuple[Path, ...] = ()) -> Any:
    """``call()`` on a daemon thread joined for at most BOUND_S: a call that blocks fails the
    test instead of hanging the run (a reader stuck on one of ``fifos`` is let go first)."""
    outcome: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            outcome.append(("value", call()))
        except BaseException as exc:  # handed to the test's thread
            outcome.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if not outcome:
        for fifo in fifos:  # a writer lets a blocked open of the FIFO return
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{call} blocked for {BOUND_S} s")
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def entries(directory: Path) -> dict[str, int]:
    """Each entry of ``directory`` (not followed) and its inode: what a call made or removed."""
    return {p.name: p.lstat().st_ino for p in directory.iterdir()}


def own_shm_names() -> list[str]:
    """This run's names in /dev/shm (never the others')."""
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"tpusync-{RUN}"))


@pytest.fixture
def run_names() -> Any:
    """Pool names with this run's prefix; whatever was made under them is removed at the end."""
    made: list[str] = []

    def make() -> str:
        made.append(f"{RUN}-{secrets.token_hex(4)}")
        return made[-1]

    yield make
    for name in made:
        for path in Path("/dev/shm").glob(f"tpusync-{name}*"):
            if path.is_dir() and not path.is_symlink():
                for inner in path.iterdir():
                    inner.unlink()
                path.rmdir()
            else:
                path.unlink()


# --- the secret file: one reader, never blocking, the same rules everywhere --------------------

SECRET_CASES = {  # kind -> what the error says (besides the key that named the file)
    "fifo": "found a FIFO",
    "directory": "found a directory",
    "symlink": "found a symlink",
    "socket": "found a socket",
    "device": "found a character device",
    "too large": "more than the 4096 bytes",
    "group-readable": "mode 0640 lets other users read or change it; run chmod 600",
    "world-readable": "mode 0644 lets other users read or change it; run chmod 600",
    "other uid": f"owned by uid {OTHER_UID}",
    "4 bytes of hex": "holds a secret of 4 bytes, read as hex text; at least 16 needed",
    "4 raw bytes": "holds a secret of 4 bytes, read as raw bytes (it is not hex text); at least",
}
NEEDS_ROOT = {"device", "other uid"}  # mknod, chown


def plant_secret(kind: str, path: Path) -> list[Any]:
    """Makes what ``kind`` names at ``path``; returns what must stay open meanwhile."""
    keep: list[Any] = []
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "symlink":  # to a good secret: refused all the same (its holder may repoint it)
        target = path.with_name(f"{path.name}-target")
        target.write_text(secrets.token_hex(32))
        target.chmod(0o600)
        path.symlink_to(target)
    elif kind == "socket":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(1)
        keep.append(listener)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    else:
        data = {
            "too large": secrets.token_hex(32).encode() + b"\n" * 8192,
            "4 bytes of hex": b"01020304\n",
            "4 raw bytes": b"\xff\x00\xfe\x01",
        }.get(kind, secrets.token_hex(32).encode())
        path.write_bytes(data)
        path.chmod({"group-readable": 0o640, "world-readable": 0o644}.get(kind, 0o600))
        if kind == "other uid":
            os.chown(path, OTHER_UID, OTHER_UID)
    return keep


def secret_entry_points(path: Path) -> dict[str, tuple[str, Callable[[], Any]]]:
    """Every way a secret file is read, with the key it is named by."""
    from tpusync._src.serve import read_secret

    section = {"address": "127.0.0.1:1", "secret_file": str(path)}
    return {
        "load_secret": ("secret_file", lambda: load_secret(path, argument="secret_file")),
        "from_dict": (
            "secret_file",
            lambda: KVStoreConfig.from_dict({**BASE, "secret_file": str(path)}),
        ),
        "from_dict section": (
            "store_node.secret_file",
            lambda: KVStoreConfig.from_dict({**BASE, "store_node": section}),
        ),
        "tpusync serve": ("--secret-file", lambda: read_secret(str(path))),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(SECRET_CASES))
def test_a_secret_file_is_refused_at_once_by_every_reader(tmp_path: Path, kind: str) -> None:
    """A FIFO given as the secret file used to block load_secret, from_dict (the vLLM and
    SGLang connectors' path) and `tpusync serve` forever; from_dict took a 4-byte secret that
    load_secret refused. Now one reader refuses each case at once, naming the key and the fix,
    and leaves what is at the path as it was."""
    if kind in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("mknod and chown need root")
    path = tmp_path / "secret"
    keep = plant_secret(kind, path)
    try:
        before = entries(tmp_path)
        for how, (key, call) in secret_entry_points(path).items():
            with pytest.raises(TpuSyncError) as info:
                bounded(call, fifos=(path,) if kind == "fifo" else ())
            message = str(info.value)
            assert message.startswith(f"{key}: {path}"), (how, message)
            assert SECRET_CASES[kind] in message, (how, message)
            assert entries(tmp_path) == before, f"{how} made or removed a file"
    finally:
        for held in keep:
            held.close()


@pytest.mark.timeout(60)
def test_tpusync_serve_refuses_a_fifo_secret_file_at_start(tmp_path: Path) -> None:
    """`tpusync serve --secret-file FIFO` used to wait forever for a writer: it exits 2 at
    once, naming the flag, and prints no ready line."""
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)
    child = subprocess.Popen(
        [sys.executable, "-m", "tpusync", "serve", "--dram", "4MiB", "--secret-file", str(fifo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    try:
        out, err = child.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate(timeout=10)
        pytest.fail("`tpusync serve --secret-file FIFO` blocked")
    assert child.returncode == 2 and out == "", (child.returncode, out, err[-2000:])
    assert f"--secret-file: {fifo}: expected a regular file, found a FIFO" in err
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_good_secret_files_read_the_same_everywhere(tmp_path: Path) -> None:
    """Hex text and raw bytes, mode 0600: every reader takes them, and gets the same bytes."""
    secret = secrets.token_bytes(32)
    for name, data in (("hex", secret.hex().encode() + b"\n"), ("raw", secret)):
        path = tmp_path / name
        path.write_bytes(data)
        path.chmod(0o600)
        readers = secret_entry_points(path)
        assert readers["load_secret"][1]() == readers["tpusync serve"][1]() == secret
        assert readers["from_dict"][1]().secret == secret
        node = readers["from_dict section"][1]().tiers[0]
        assert node.secret == secret


def test_a_weak_inline_secret_is_refused_as_a_file_is(tmp_path: Path) -> None:
    """KVStoreConfig(secret=...) and a tier spec's secret= took any bytes: a 4-byte key keyed
    block hashes and the handshake's HMAC. They take at least 16 bytes now, as every secret
    file must hold (and the store's BLAKE2b keys at most 64)."""
    from tpusync.cluster import PeerTier, StoreNodeTier

    for bad, match in [
        (b"1234", r"^secret: a secret of 4 bytes; 16 to 64 needed"),
        (b"k" * 15, r"^secret: a secret of 15 bytes; 16 to 64 needed"),
        (b"k" * 65, r"^secret: a secret of 65 bytes; 16 to 64 needed"),
        ("a text secret", r"^secret: expected bytes \(tpusync.kv.load_secret\(path\)"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            KVStoreConfig("toy", 16, DramTier(8), secret=bad)  # type: ignore[arg-type]
    for spec, key in ((StoreNodeTier, "node"), (PeerTier, "remote")):
        with pytest.raises(InvalidArgumentError, match=rf"^{key}\.secret .*4 bytes; at least 16"):
            spec("127.0.0.1:1", secret=b"1234")
    assert KVStoreConfig("toy", 16, DramTier(8), secret=b"k" * 16).secret == b"k" * 16
    big = tmp_path / "big"  # 65 raw bytes: a fine cluster secret, too long for the store's key
    big.write_bytes(b"\x01" * 65)
    big.chmod(0o600)
    with pytest.raises(InvalidArgumentError, match=r"^secret_file \(.*big\): a secret of 65"):
        KVStoreConfig.from_dict({**BASE, "secret_file": str(big)})


# --- dram.shm_dir: the rules of a tier directory --------------------------------------------


def store_refusal(arrays: Any, rng: np.random.Generator, config: KVStoreConfig) -> BaseException:
    """The error opening a store over ``config`` raises (on a thread with a bound)."""
    pools = model_pools(arrays, rng)
    with pytest.raises(TpuSyncError) as info:
        bounded(lambda: KVCacheStore(config, pools).close())
    return info.value


@needs_root
@pytest.mark.parametrize("mode", [0o755, 0o1777], ids=["0755", "sticky 1777"])
def test_a_shm_dir_of_another_user_is_refused(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, run_names: Any, mode: int
) -> None:
    """A named DRAM pool used to be made inside another user's directory (the same directory
    was refused as a disk tier): its owner could remove or replace the pool. Every named pool
    is refused there now (the KV store's, HostPool's, a store node's, the weights
    publisher's), before anything is made."""
    from tpusync.tiers import HostPool
    from tpusync.weights import Publisher, WeightsPoolOptions

    other = tmp_path / "other"
    other.mkdir()
    os.chown(other, OTHER_UID, OTHER_UID)
    other.chmod(mode)
    name = run_names()
    config = KVStoreConfig("toy", CFG.block_size, DramTier(8, name=name, shm_dir=str(other)))
    error = store_refusal(arrays, rng, config)
    assert isinstance(error, UnsafeFileError)
    assert str(error).startswith(f"dram.shm_dir: {other} is owned by uid {OTHER_UID}")
    assert "give a directory of your own (mkdir -m 0700) or /dev/shm" in str(error)
    layout = PoolLayout("trust", (ArrayLayout("k", "uint8", (4096,), 0, 1),))
    for make in (
        lambda: HostPool(layout, 4, name=name, shm_dir=str(other)),
        lambda: StoreNode(4 * MiB, secret=SECRET, name=name, shm_dir=str(other)),
        lambda: Publisher(
            name, secret=SECRET, pool=WeightsPoolOptions(capacity_bytes=4 * MiB, shm_dir=str(other))
        ),
    ):
        with pytest.raises(UnsafeFileError, match=rf"^shm_dir: {other} is owned by uid"):
            bounded(make)
    assert list(other.iterdir()) == [], "a refused pool made a file in another user's directory"
    assert own_shm_names() == []


@pytest.mark.parametrize("problem", ["a regular file", "missing", "0777", "symlink"])
def test_a_shm_dir_that_is_no_private_directory_is_refused(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, run_names: Any, problem: str
) -> None:
    """dram.shm_dir naming a regular file raised a bare NotADirectoryError; a directory any
    user may write (without the sticky bit of /dev/shm) or a symlink was taken. Each is refused
    now, naming dram.shm_dir and the fix; a sticky one of this uid is taken."""
    shm = tmp_path / "shm"
    if problem == "a regular file":
        shm.write_bytes(b"not a directory")
        kind, expected = InvalidArgumentError, f"{shm} is not a directory but a regular file"
    elif problem == "missing":
        kind, expected = InvalidArgumentError, f"cannot use {shm}: No such file or directory"
    elif problem == "0777":
        shm.mkdir()
        shm.chmod(0o777)
        kind, expected = UnsafeFileError, f"{shm} has mode 0777: other users may remove or"
    else:
        (tmp_path / "real").mkdir(mode=0o700)
        shm.symlink_to(tmp_path / "real")
        kind, expected = UnsafeFileError, f"{shm} is a symlink to {tmp_path / 'real'}; tpusync"
    before = entries(tmp_path)
    config = KVStoreConfig("toy", CFG.block_size, DramTier(8, name=run_names(), shm_dir=str(shm)))
    error = store_refusal(arrays, rng, config)
    assert type(error) is kind and str(error).startswith(f"dram.shm_dir: {expected}"), error
    assert entries(tmp_path) == before
    if problem == "symlink":
        assert list((tmp_path / "real").iterdir()) == []
    if problem == "0777":  # a sticky directory of this uid, as /dev/shm is, is taken
        shm.chmod(0o1777)
        with KVCacheStore(config, model_pools(arrays, rng)) as store:
            assert store.dram.path is not None and store.dram.path.parent == shm


# --- sizes: checked against the host before anything is allocated ---------------------------


def test_a_disk_tier_larger_than_this_host_is_refused_naming_the_key(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, run_names: Any
) -> None:
    """disk.capacity_blocks = 2**60 raised numpy's "array is too big" after the DRAM pool was
    made (2**27 blocks of 4 KiB made an 8 GiB index on a disk with less free). Each size is
    checked first now: against what a process can index, the memory its index takes, and the
    room of its filesystem; the error names disk.capacity_blocks and the fix."""
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    slot = PoolLayout.from_pools("toy", model_pools(arrays, rng)).slot_bytes
    beyond_memory = (mem_available() + (8 << 30)) // 128  # its index: 128 B a block
    beyond_disk = (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize) // slot + 1024
    cases = [
        (2**60, "1152921504606846976 blocks are more than a process can index"),
        (beyond_memory, "of memory available (MemAvailable"),
        (beyond_disk, f"asked for, but {disk} has "),
    ]
    for capacity, expected in cases:
        name = run_names()
        config = KVStoreConfig(
            "toy",
            CFG.block_size,
            DramTier(8, name=name),
            tiers=(DiskTier(disk, capacity),),
        )
        error = store_refusal(arrays, rng, config)
        assert isinstance(error, TierFullError), error
        assert str(error).startswith("disk.capacity_blocks: ") and expected in str(error), error
        assert f"lower disk.capacity_blocks ({capacity} blocks of {slot} B)" in str(error)
        assert list(disk.iterdir()) == [] and not pool_path(name).exists()
    # made by the store (create=True): checked against the filesystem it would be made on
    made_later = DiskTier(disk / "new", beyond_disk, create=True)
    config = KVStoreConfig("toy", CFG.block_size, DramTier(8), tiers=(made_later,))
    assert f"asked for, but {disk} has " in str(store_refusal(arrays, rng, config))
    assert list(disk.iterdir()) == []
    # DiskPool itself: refused before any array or file
    with pytest.raises(TierFullError, match=r"^capacity: 1152921504606846976 blocks are more"):
        DiskPool(PoolLayout.from_pools("toy", model_pools(arrays, rng)), 2**60, disk)
    assert list(disk.iterdir()) == []
    assert own_shm_names() == []


def test_a_disk_tier_on_a_small_mount_is_refused_and_its_own_files_count(
    arrays: Any, rng: np.random.Generator, tmp_path: Path
) -> None:
    """On a 4 MiB tmpfs: a disk tier of 8 MiB is refused at start; one of 3 MiB is made, and
    opened again (its own files count as room, as a restart's)."""
    pools = model_pools(arrays, rng)
    slot = PoolLayout.from_pools("toy", pools).slot_bytes
    with tmpfs(tmp_path / "mnt", "size=4m") as mnt:
        too_many = (8 * MiB) // slot
        config = KVStoreConfig("toy", CFG.block_size, DramTier(8), tiers=(DiskTier(mnt, too_many),))
        error = store_refusal(arrays, rng, config)
        assert str(error).startswith("disk.capacity_blocks: ") and f"{mnt} has" in str(error)
        assert list(mnt.iterdir()) == []
        fits = (3 * MiB) // slot
        config = KVStoreConfig("toy", CFG.block_size, DramTier(8), tiers=(DiskTier(mnt, fits),))
        for _ in range(2):
            with KVCacheStore(config, pools) as store:
                assert store.save(tokens(rng, 2 * CFG.block_size), [0, 1]).stored_blocks == 2
                assert store.flush(TIMEOUT)


def test_a_symlinked_tier_directory_is_refused(
    arrays: Any, rng: np.random.Generator, tmp_path: Path, run_names: Any
) -> None:
    """A symlinked disk directory was followed (checked at its target, then used by the link's
    path, which its holder could repoint), while the README said tier directories are opened
    without following symlinks. Now it is refused before anything is made, naming the target
    to give instead, by the store's specs and the pools alike."""
    from tpusync.tiers import SharedFsPool

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    for spec, key in ((DiskTier(link, 8), "disk"), (SharedFsTier(link), "shared_fs")):
        name = run_names()
        config = KVStoreConfig("toy", CFG.block_size, DramTier(8, name=name), tiers=(spec,))
        error = store_refusal(arrays, rng, config)
        assert isinstance(error, UnsafeFileError), error
        assert str(error).startswith(f"{key}.directory: {link}: expected a directory, found a "
                                     f"symlink to {real}; tpusync never follows")  # fmt: skip
        assert not pool_path(name).exists()
    layout = PoolLayout.from_pools("toy", model_pools(arrays, rng))
    for make in (lambda: DiskPool(layout, 4, link), lambda: SharedFsPool(layout, link)):
        with pytest.raises(UnsafeFileError, match=f"found a symlink to {real}"):
            make()
    assert list(real.iterdir()) == [] and link.is_symlink()
    with KVCacheStore(
        KVStoreConfig("toy", CFG.block_size, DramTier(8), tiers=(DiskTier(real, 8),)),
        model_pools(arrays, rng),
    ):
        pass  # the directory itself is taken


# --- `tpusync serve` and `tpusync shm` --------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["--disk-size without --disk", "a 0777 --disk", "a symlinked --disk"]
)
def test_serve_refuses_disk_flags_it_cannot_honour_at_start(tmp_path: Path, case: str) -> None:
    """`tpusync serve` took --disk-size without --disk (ignored) and a --disk directory any
    user may write (its disk pools' parent: checked only when a client first came, if at
    all). Both are refused at start, exit 2, naming the flag and the fix."""
    disk = tmp_path / "disk"
    if case == "--disk-size without --disk":
        args = ["--dram", "64MiB", "--disk-size", "1GiB"]
        expected = "--disk-size: 1GiB given without --disk; add --disk DIR"
    elif case == "a 0777 --disk":
        disk.mkdir()
        disk.chmod(0o777)
        args = ["--dram", "64MiB", "--disk", str(disk), "--disk-size", "2MiB"]
        expected = f"--disk: {disk}: mode 0777 lets other users write it; run chmod go-w"
    else:
        (tmp_path / "real").mkdir(mode=0o700)
        disk.symlink_to(tmp_path / "real")
        args = ["--dram", "64MiB", "--disk", str(disk), "--disk-size", "2MiB"]
        expected = f"--disk: {disk}: expected a directory, found a symlink to {tmp_path / 'real'}"
    before = entries(tmp_path)
    code, out, err = serve(tmp_path, *args)
    assert code == 2 and out == "", (code, out, err[-2000:])
    assert expected in err, err[-2000:]
    assert "Traceback" not in err
    assert {k: v for k, v in entries(tmp_path).items() if k != "secret"} == before
    if disk.is_dir() and not disk.is_symlink():
        assert list(disk.iterdir()) == []


@pytest.mark.timeout(90)
def test_shm_remove_takes_the_name_serve_was_given(tmp_path: Path, run_names: Any) -> None:
    """`tpusync serve --name N` keeps its DRAM in pools named N-<layout>; `tpusync shm remove
    N` found no pool N. It takes N (as NAME or --name, and --shm-dir as serve spells it) and
    removes that node's pools; a pool named N exactly is still removed by its own name."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    name = run_names()
    layouts = [
        PoolLayout("trust", (ArrayLayout("k", "uint8", (size,), 0, 1),)) for size in (4096, 8192)
    ]
    with StoreNode(8 * MiB, secret=SECRET, name=name, shm_dir=str(shm), max_layouts=2) as node:
        for layout in layouts:
            with StoreNodePool(node.address, layout=layout, secret=SECRET, timeout_s=5.0):
                pass
    made = sorted(p.name for p in shm.iterdir())
    assert len(made) == 2 and all(p.startswith(f"tpusync-{name}-") for p in made), made

    def shm_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tpusync", "shm", *args],
            capture_output=True, text=True, timeout=60,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip

    refused = shm_cli("remove", "other-name", "--name", name, "--shm-dir", str(shm))
    assert refused.returncode == 2 and "NAME, --name: two names" in refused.stderr
    removed = shm_cli("remove", "--name", name, "--shm-dir", str(shm))
    assert removed.returncode == 0, removed.stderr
    lines = removed.stdout.splitlines()
    gone = [Path(line.removeprefix("removed ")).name for line in lines if "removed " in line]
    assert sorted(gone) == made
    assert list(shm.iterdir()) == []
    from tpusync.tiers import HostPool

    with HostPool(layouts[0], 4, name=name, shm_dir=str(shm)):
        pass
    assert shm_cli("--shm-dir", str(shm), "remove", name).returncode == 0  # NAME: the pool itself
    assert list(shm.iterdir()) == []


# --- fuzzing the plain-data config: only tpusync errors, never a block ------------------------

_ODD_FILES = ("fifo", "directory", "symlink", "group-readable", "4 raw bytes", "4 bytes of hex")


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One of each odd secret file (and a good one, and a missing path), made once."""
    where = tmp_path_factory.mktemp("odd")
    paths = {}
    for kind in _ODD_FILES:
        path = where / kind.replace(" ", "-")
        plant_secret(kind, path)
        paths[kind] = str(path)
    good = where / "good"
    good.write_text(secrets.token_hex(32))
    good.chmod(0o600)
    paths["good"] = str(good)
    paths["missing"] = str(where / "missing")
    return paths


def _values(paths: list[str]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**64), 2**64),
        st.sampled_from([0, 1, 16, 2**31, 2**60, -1]),
        st.floats(allow_nan=True),
        st.text(max_size=12),
        st.sampled_from(paths),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=6,
    )


_TOP_KEYS = [
    "model_id", "block_size", "secret_file", "salt", "weight_version", "shard_rank",
    "shard_count", "block_axis", "token_axis", "writeback_max_bytes", "writeback_policy", "path",
]  # fmt: skip
_SECTIONS = {
    "dram": ["capacity_blocks", "name", "shm_dir", "populate", "on_mismatch"],
    "disk": ["directory", "capacity_blocks", "durability", "direct_io", "create", "name"],
    "store_node": ["address", "secret_file", "timeout_s", "name", "tls_ca"],
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_plain_configs_raise_only_tpusync_errors_and_never_block(
    odd_files: dict[str, str], data: st.DataObject
) -> None:
    """Random plain-data configs, their values drawn from every JSON kind, odd numbers, and the
    paths of odd secret files (a FIFO among them): from_dict returns a config or raises a
    tpusync error, at once; a secret it takes is one the secret rules allow."""
    values = _values(sorted(odd_files.values()))
    config: dict[str, Any] = dict(BASE)
    for key in data.draw(st.lists(st.sampled_from(_TOP_KEYS), max_size=4, unique=True)):
        config[key] = data.draw(values)
    for section, keys in _SECTIONS.items():
        if section == "dram" or data.draw(st.booleans()):
            fields = {k: data.draw(values) for k in data.draw(st.lists(st.sampled_from(keys)))}
            base = {"capacity_blocks": 8} if section == "dram" else {}
            config[section] = {**base, **fields}
    fifos = (Path(odd_files["fifo"]),)
    try:
        made = bounded(lambda: KVStoreConfig.from_dict(config), fifos=fifos)
    except TpuSyncError:
        return
    assert 16 <= len(made.secret) <= 64
