"""Damaged or odd files of the disk tier, the shared-filesystem tier and session manifests: no
crash, no hang, never a wrong byte (tpusync issue 17, and its fuzz acceptance line).

1. Whatever sits at a tier file's path -- a FIFO (a plain open would block forever), a
   directory, a symlink, another uid's file, one others may write -- is a counted miss at a
   block's path, a cold start (or a clear UnsafeFileError) at an index's or a slab's, and a
   dropped manifest at a manifest's; the tiers' own directories must be this uid's and not
   writable by others; files are created 0600 and directories 0700.
2. A write that fails (a real full tmpfs, a real read-only bind mount) is a TierFullError or a
   TierIOError naming the file and the cause, leaves no temporary file and changes nothing.
3. Every on-disk format decoder takes random and mutated bytes (hypothesis, and a time-boxed loop
   of mutations of real files: ``tpusync._src.testing.file_fuzz``; longer runs:
   ``scripts/fuzz_files.py``) raising nothing but its format error, and nothing damaged is served.

Everything is real: FIFOs (``os.mkfifo``), chown to another uid (as root), tmpfs and bind mounts
(as root; unmounted in fixture finalizers). A test that would hang on a FIFO at the parent
commit opens the FIFO's other end after a timeout, so it fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mounts import mount_tmpfs, unmount
from paths import REPO
from tools import tools_required

from tpusync import DevicePool
from tpusync._src.kv import sessions as _sessions
from tpusync._src.tiers.disk import file_format as disk_module
from tpusync._src.tiers.shared_fs import file_format as sfs_module
from tpusync.errors import (
    BlocksMissingError,
    PoolFormatError,
    TierFullError,
    TierIOError,
    TpuSyncError,
    UnsafeFileError,
)
from tpusync.kv import DiskTier, DramTier, KVCacheStore, KVStoreConfig
from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout, SharedFsPool

OTHER_UID = 4242
TIMEOUT = 60.0
HANG_S = 10.0
BS, HEADS, DIM, NB = 4, 2, 8, 32
BF16 = np.dtype(ml_dtypes.bfloat16)

# Skipped without root only outside CI: there (tests/helpers/tools.py) the test runs, and fails.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 and not tools_required(), reason="needs root (chown, mount)"
)

PAYLOAD = 3000


def layout(model_id: str) -> PoolLayout:
    return PoolLayout(model_id, (ArrayLayout("kv", "uint8", (PAYLOAD,), 0, 1),))


def key_for(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def expected(key: bytes) -> bytes:
    """The payload stored under ``key``: random bytes seeded by the key (never zeros)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(1, 256, PAYLOAD, dtype=np.uint8).tobytes()


def fill(pool: HostPool, keys: list[bytes]) -> None:
    reservation = pool.reserve(keys)
    for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
        with pool.slot_memory(slot) as memory:
            memory[:PAYLOAD] = expected(key)
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def check_served(pool: HostPool, keys: list[bytes]) -> None:
    for key in keys:
        slot = pool.slot_of(key)
        assert slot is not None, f"{key.hex()} is not in the DRAM pool"
        with pool.slot_memory(slot) as memory:
            assert bytes(memory[:PAYLOAD]) == expected(key), f"{key.hex()}: wrong bytes"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def without_hanging(call: Callable[[], Any], fifos: list[Path]) -> Any:
    """Runs ``call``; if it is still running after HANG_S (blocked opening one of ``fifos``),
    opens their writing ends to let it go, and fails the test."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(HANG_S)
        pytest.fail(f"hung opening a FIFO at {[str(f) for f in fifos]}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def plant(kind: str, path: Path, good: bytes, away: Path | None = None) -> None:
    """Replaces the file at ``path`` (whose good content is ``good``) by something unsafe; a
    symlink points to a copy in ``away`` (default: beside it)."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "symlink":  # to a whole, valid copy: following it would serve it
        copy = (away or path.parent) / f"elsewhere-{path.name}"
        copy.write_bytes(good)
        os.chmod(copy, 0o600)
        path.symlink_to(copy)
    elif kind == "other-uid":
        path.write_bytes(good)
        os.chmod(path, 0o600)
        os.chown(path, OTHER_UID, OTHER_UID)
    elif kind == "group-writable":
        path.write_bytes(good)
        os.chmod(path, 0o664)
    else:
        raise AssertionError(kind)


# --- mounts ----------------------------------------------------------------------------------


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=30)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """mounts(name, size) mounts a fresh tmpfs (mode 0700) at tmp_path/name; mounts(path,
    read_only=True) bind-mounts ``path`` read-only onto itself. All are unmounted at the end."""
    if os.geteuid() != 0:
        pytest.fail("these tests mount filesystems and need root (CI runs as root)")
    made: list[Path] = []

    def mount(target: str | Path, size: str = "1m", *, read_only: bool = False) -> Path:
        if read_only:
            where = Path(target)
            result = _run("mount", "--bind", str(where), str(where))
            if not result.returncode:
                made.append(where)
                result = _run("mount", "-o", "remount,bind,ro", str(where))
        else:
            where = tmp_path / str(target)
            where.mkdir()
            mount_tmpfs(where, f"size={size}")
            made.append(where)
            return where
        if result.returncode:
            pytest.fail(f"cannot bind-mount {where} read-only: {result.stderr.strip()}")
        return where

    yield mount
    for where in reversed(made):
        unmount(where)


def fill_up(directory: Path, rng: np.random.Generator) -> Path:
    """Writes random bytes into ``directory``/filler until its filesystem is full."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            data = rng.integers(1, 256, chunk, dtype=np.uint8).tobytes()
            while True:
                try:
                    os.write(fd, data)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return path


# --- a KV store on small device pools ------------------------------------------------------


def device_pools(rng: np.random.Generator) -> list[DevicePool]:
    return [
        DevicePool(
            jax.device_put(
                rng.integers(1, 1 << 16, (NB, BS, HEADS, DIM), dtype=np.uint16).view(BF16)
            ),
            name=f"kv{i}",
        )
        for i in range(2)
    ]


def open_store(config: KVStoreConfig, pools: list[DevicePool], opened: list) -> KVCacheStore:
    store = KVCacheStore(config, pools)
    opened.append(store)
    return store


@pytest.fixture
def opened() -> Iterator[list[KVCacheStore]]:
    """Stores the test opened, closed at the end (before the mounts they use go)."""
    stores: list[KVCacheStore] = []
    yield stores
    for store in reversed(stores):
        store.close()


def tokens_of(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 50_000, n).tolist()


# === 1. odd files at a tier's paths =========================================================


@pytest.fixture
def shared_tier(tmp_path: Path) -> Iterator[tuple[SharedFsPool, HostPool, list[bytes]]]:
    keys = [key_for(i) for i in range(3)]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    with (
        HostPool(layout("trust"), 3) as source,
        SharedFsPool(layout("trust"), shared, io_threads=1) as tier,
    ):
        fill(source, keys)
        tier.put(keys, source)
        yield tier, source, keys


@pytest.mark.parametrize(
    "kind",
    [
        "fifo",
        "directory",
        "symlink",
        pytest.param("other-uid", marks=needs_root),
        "group-writable",
    ],
)
def test_odd_file_at_a_shared_fs_block_path_is_a_counted_miss(shared_tier, kind, caplog):
    """A FIFO at a block's path used to hang get() forever; a symlink to a valid copy was
    served. Each is a miss counted as corrupt, never data, never a hang; removable ones are
    removed (not what a symlink points to), so a put repairs the name."""
    tier, source, keys = shared_tier
    path = Path(tier.path_of(keys[0]))
    plant(kind, path, path.read_bytes())
    with HostPool(tier.layout, 3) as target:
        with pytest.raises(BlocksMissingError) as info:
            without_hanging(lambda: tier.get(keys, target), [path])
        assert info.value.loaded == [False, True, True]
        assert info.value.corrupt == 1 and tier.stats.checksum_failures == 1
        assert target.contains(keys[:1]) == [False]
        check_served(target, keys[1:])
        if kind == "symlink":
            assert path.with_name(f"elsewhere-{path.name}").exists()  # never followed
        if kind == "directory":
            assert path.is_dir()  # left alone (tpusync removes no trees): a miss each time
            return
        assert not os.path.lexists(path)
        assert tier.put(keys, source) == 1
        tier.get(keys[:1], target)
        check_served(target, keys)


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A disk pool of 12 blocks in 3 slabs of 4, closed; its files stay in the directory."""
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    with HostPool(layout("trust"), 12) as source:
        fill(source, [key_for(i) for i in range(12)])
        with DiskPool(layout("trust"), 12, directory, slab_slots=4, direct_io=False) as disk:
            disk.put([key_for(i) for i in range(12)], source)
    return directory


def open_disk(directory: Path, **kwargs: Any) -> DiskPool:
    return DiskPool(layout("trust"), 12, directory, slab_slots=4, direct_io=False, **kwargs)


def in_slab(directory: Path, slab: int) -> list[bytes]:
    """The keys whose records say they live in slab ``slab`` (read from the index file)."""
    data = (directory / disk_module.INDEX_NAME).read_bytes()
    records = np.frombuffer(data, disk_module.RECORD_DTYPE, 12, disk_module.HEADER_BYTES)
    return [
        bytes(r["key"])[: r["key_len"]]
        for s, r in enumerate(records)
        if s // 4 == slab and r["state"] == disk_module.COMMITTED
    ]


@pytest.mark.parametrize(
    "kind", ["fifo", "symlink", pytest.param("other-uid", marks=needs_root), "group-writable"]
)
def test_odd_slab_file_drops_only_its_blocks(disk_dir, kind, caplog):
    """An odd file at a slab's path is a damaged slab: with on_mismatch="error" a clear
    UnsafeFileError naming it (nothing changed), else its blocks are dropped (logged), the
    others served, and the slab made anew. A FIFO there used to hang the open."""
    slab = disk_dir / "slab-000001.tpd"
    lost, kept = in_slab(disk_dir, 1), in_slab(disk_dir, 0) + in_slab(disk_dir, 2)
    plant(kind, slab, slab.read_bytes())
    with pytest.raises(UnsafeFileError, match=r"slab-000001\.tpd"):
        without_hanging(lambda: open_disk(disk_dir, on_mismatch="error"), [slab])
    assert os.path.lexists(slab)
    with caplog.at_level(logging.WARNING, "tpusync.tiers"):
        disk = without_hanging(lambda: open_disk(disk_dir), [slab])
    with disk, HostPool(layout("trust"), 12) as target:
        assert "slab-000001.tpd" in caplog.text and "4 blocks are dropped" in caplog.text
        assert sorted(disk.keys()) == sorted(kept)
        disk.get(kept, target)
        check_served(target, kept)
        with HostPool(layout("trust"), 12) as source:
            fill(source, lost)
            assert disk.put(lost, source) == 4
        target.delete(kept)
        disk.get(lost, target)
        check_served(target, lost)
    assert mode_of(slab) == 0o600


def test_directory_at_a_slab_path_is_a_clear_error(disk_dir):
    slab = disk_dir / "slab-000002.tpd"
    slab.unlink()
    slab.mkdir()
    for mode in ("error", "recreate"):
        with pytest.raises(UnsafeFileError, match=r"slab-000002\.tpd.*directory"):
            open_disk(disk_dir, on_mismatch=mode)
    assert slab.is_dir()


@pytest.mark.parametrize(
    "kind", ["fifo", "symlink", pytest.param("other-uid", marks=needs_root), "group-writable"]
)
def test_odd_index_file_means_a_cold_start(disk_dir, kind, caplog):
    """As a damaged index does: a cold start (logged) with "recreate", a clear UnsafeFileError
    naming the index with "error" (which changes nothing)."""
    index = disk_dir / disk_module.INDEX_NAME
    plant(kind, index, index.read_bytes())
    with pytest.raises(UnsafeFileError, match=disk_module.INDEX_NAME):
        without_hanging(lambda: open_disk(disk_dir, on_mismatch="error"), [index])
    assert os.path.lexists(index) and (kind != "symlink" or index.is_symlink())
    with caplog.at_level(logging.WARNING, "tpusync.tiers"):
        disk = without_hanging(lambda: open_disk(disk_dir), [index])
    with disk, HostPool(layout("trust"), 12) as source:
        assert not disk.attached and disk.used == 0 and "cold pool" in caplog.text
        assert stat.S_ISREG(os.lstat(index).st_mode) and mode_of(index) == 0o600
        fill(source, [key_for(0)])
        assert disk.put([key_for(0)], source) == 1
    if kind == "symlink":
        assert index.with_name(f"elsewhere-{index.name}").exists()


def test_directory_at_the_index_path_is_a_clear_error(disk_dir):
    index = disk_dir / disk_module.INDEX_NAME
    index.unlink()
    index.mkdir()
    with pytest.raises(UnsafeFileError, match=rf"{disk_module.INDEX_NAME}.*directory"):
        open_disk(disk_dir)


@pytest.mark.parametrize(
    "kind", ["fifo", "directory", "symlink", pytest.param("other-uid", marks=needs_root)]
)
def test_odd_lock_file_is_a_clear_error(disk_dir, kind):
    lock = disk_dir / disk_module.LOCK_NAME
    plant(kind, lock, b"1\n")
    with pytest.raises(UnsafeFileError, match=disk_module.LOCK_NAME):
        without_hanging(lambda: open_disk(disk_dir), [lock])


@needs_root
@pytest.mark.parametrize("problem", ["group-writable", "world-writable", "other-uid"])
def test_unsafe_tier_directories_are_refused(tmp_path, problem):
    """The disk directory and the shared-FS root must be this uid's, not writable by others
    (hosts sharing a shared-FS root run as one uid); the error names the path and the fix."""
    for name in ("disk", "shared"):
        directory = tmp_path / name
        directory.mkdir(mode=0o700)
        if problem == "other-uid":
            os.chown(directory, OTHER_UID, OTHER_UID)
        else:
            os.chmod(directory, 0o770 if problem == "group-writable" else 0o1777)
    fix = "chmod go-w" if problem != "other-uid" else "owned by uid"
    with pytest.raises(UnsafeFileError, match=fix) as info:
        DiskPool(layout("trust"), 4, tmp_path / "disk")
    assert str(tmp_path / "disk") in str(info.value)
    with pytest.raises(UnsafeFileError, match="mkdir -m 0700") as info:
        SharedFsPool(layout("trust"), tmp_path / "shared")
    assert str(tmp_path / "shared") in str(info.value) and fix in str(info.value)
    assert os.listdir(tmp_path / "disk") == [] and os.listdir(tmp_path / "shared") == []


def test_tier_directories_reached_through_a_symlink_are_refused(tmp_path):
    """A symlink's holder could repoint it between the check and the opens of the pool's files
    (they go by path): the link is refused, naming its target to give instead; the target
    itself is taken (readable by others is fine, writable is not)."""
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeFileError, match=f"found a symlink to {real}"):
        DiskPool(layout("trust"), 4, link)
    with pytest.raises(UnsafeFileError, match=f"found a symlink to {real}"):
        SharedFsPool(layout("trust"), link)
    assert os.listdir(real) == []
    with DiskPool(layout("trust"), 4, real):
        pass
    with SharedFsPool(layout("trust"), real):
        pass
    os.chmod(real, 0o777)
    with pytest.raises(UnsafeFileError, match=str(real)):
        DiskPool(layout("trust"), 4, real)


def test_shared_fs_layout_and_fanout_directories_are_checked(shared_tier):
    tier, source, keys = shared_tier
    fanout = Path(tier.path_of(keys[0])).parent
    os.chmod(fanout, 0o777)
    other = SharedFsPool(tier.layout, tier.directory, io_threads=1)  # a new process's view
    try:
        with pytest.raises(UnsafeFileError, match=str(fanout)):
            other.put(keys, source, overwrite=True)
    finally:
        other.close()
    os.chmod(fanout.parent, 0o777)
    with pytest.raises(UnsafeFileError, match=str(fanout.parent)):
        SharedFsPool(tier.layout, tier.directory)


def test_new_files_are_0600_and_directories_0700(tmp_path, rng, opened, shm_names):
    disk, shared = tmp_path / "disk", tmp_path / "shared"
    shm = tmp_path / "shm"
    for directory in (disk, shared, shm):
        directory.mkdir(mode=0o700)
    config = KVStoreConfig(
        model_id="trust",
        block_size=BS,
        dram=DramTier(16, name=shm_names(), shm_dir=str(shm), populate=False),
        tiers=(DiskTier(disk, 16, durability="none"),),
    )
    store = open_store(config, device_pools(rng), opened)
    store.offload_session("s", tokens_of(rng, 3 * BS + 1), [0, 1, 2, 3])
    store.flush()
    with HostPool(layout("trust"), 2) as source, SharedFsPool(layout("trust"), shared) as tier:
        fill(source, [key_for(0)])
        tier.put([key_for(0)], source)
    files = [p for d in (disk, shared, shm) for p in d.rglob("*") if not p.is_dir()]
    dirs = [p for d in (shared, shm) for p in d.rglob("*") if p.is_dir()]
    names = {p.name for p in files}
    assert {"tpusync-disk.index", "tpusync-disk.lock", "slab-000000.tpd", "layout.json"} <= names
    assert any(p.suffix == ".blk" for p in files) and any(p.suffix == ".json" for p in files)
    assert len(dirs) >= 3  # the sessions directory, the layout's, a fan-out one
    pool_file = next(p for p in files if p.suffix == ".pool")  # the DRAM tier's: not mine
    assert {oct(mode_of(p)) for p in files if p != pool_file} == {oct(0o600)}
    assert {oct(mode_of(p)) for p in dirs} == {oct(0o700)}


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "group-writable"])
def test_odd_session_manifest_is_dropped(tmp_path, rng, opened, kind, caplog):
    """An odd file at a manifest's path is a damaged manifest: dropped (logged) on open, never
    read (a FIFO used to hang the store's open)."""
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    config = KVStoreConfig(model_id="trust", block_size=BS, dram=DramTier(16, populate=False),
                           tiers=(DiskTier(disk, 16),))  # fmt: skip
    pools = device_pools(rng)
    store = open_store(config, pools, opened)
    store.offload_session("s", tokens_of(rng, 2 * BS), [0, 1])
    store.close()
    (manifest,) = (disk / "sessions").glob("*.json")
    plant(kind, manifest, manifest.read_bytes(), away=disk)
    with caplog.at_level(logging.WARNING, "tpusync.kv"):
        again = without_hanging(lambda: open_store(config, pools, opened), [manifest])
    assert again.sessions() == []
    assert str(manifest) in caplog.text
    if kind == "symlink":
        assert (disk / f"elsewhere-{manifest.name}").exists()
    assert os.path.lexists(manifest) == (kind == "directory")


@needs_root
@pytest.mark.parametrize("problem", ["world-writable", "other-uid"])
def test_unsafe_sessions_directory_is_refused_and_nothing_stays_open(
    tmp_path, rng, opened, shm_names, problem
):
    """A named DRAM pool's sessions directory sits in /dev/shm, which everyone may write: one
    another user made (or made writable) is refused, naming it, with the tiers closed again."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    name = shm_names()
    sessions = shm / f"tpusync-{name}.sessions"
    sessions.mkdir(mode=0o700)
    if problem == "other-uid":
        os.chown(sessions, OTHER_UID, OTHER_UID)
    else:
        os.chmod(sessions, 0o777)
    config = KVStoreConfig(
        model_id="trust",
        block_size=BS,
        dram=DramTier(16, name=name, shm_dir=str(shm), populate=False),
    )
    pools = device_pools(rng)
    with pytest.raises(UnsafeFileError, match=str(sessions)):
        KVCacheStore(config, pools)
    os.chown(sessions, os.geteuid(), os.getegid())
    os.chmod(sessions, 0o700)
    open_store(config, pools, opened)  # the pool was closed: its lock is free


# === 2. failed writes: a real full tmpfs, a real read-only mount ============================


@pytest.mark.parametrize("where", ["named-dram", "disk"])
def test_offload_session_on_a_full_tmpfs_names_the_manifest(rng, mounts, opened, shm_names, where):
    """A session offloaded onto a full tmpfs used to raise a bare OSError without a path: it is
    a TierFullError naming the manifest and the cause, no temporary file is left, and nothing
    changes (the session it would replace stays, no block is saved, none is kept); with room
    again the same call works."""
    mnt = mounts("tmpfs", "1m")
    if where == "named-dram":
        dram = DramTier(16, name=shm_names(), shm_dir=str(mnt), populate=False)
        config = KVStoreConfig(model_id="trust", block_size=BS, dram=dram)
    else:
        config = KVStoreConfig(
            model_id="trust",
            block_size=BS,
            dram=DramTier(16, populate=False),
            tiers=(DiskTier(mnt, 8, durability="none", direct_io=False),),
        )
    store = open_store(config, device_pools(rng), opened)
    first = tokens_of(rng, 2 * BS + 1)
    store.offload_session("s", first, [0, 1, 2])
    store.flush()
    sessions = next(mnt.glob("*sessions"))
    before = sorted(os.listdir(sessions))
    used, kept = store.dram.used, dict(store._stack._kept)  # reach-in: what offload keeps
    filler = fill_up(mnt, rng)

    longer = first + tokens_of(rng, 2 * BS)
    for call in (
        lambda: store.offload_session("s", longer, [3, 4, 5, 6, 7]),
        lambda: store.offload_session("t", longer, [3, 4, 5, 6, 7]),
    ):
        with pytest.raises(TierFullError) as info:
            call()
        message = str(info.value)
        assert str(sessions) in message and ".json" in message
        assert "No space left on device" in message and "free" in message
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert sorted(os.listdir(sessions)) == before  # no temporary file, the old one intact
        assert store.sessions() == ["s"] and store.dram.used == used
        assert dict(store._stack._kept) == kept

    filler.unlink()
    store.offload_session("t", longer, [3, 4, 5, 6, 7])
    assert sorted(store.sessions()) == ["s", "t"]
    restored = store.restore_session("s", [10, 11, 12])
    assert restored.tokens.tolist() == first and restored.loaded_tokens == len(first)


def test_session_manifest_on_a_read_only_mount_is_a_tier_io_error(
    tmp_path, rng, mounts, opened, shm_names
):
    """EROFS (a real read-only bind mount of the sessions directory): offload and drop raise
    TierIOError naming the manifest, carrying the errno, and change nothing."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    dram = DramTier(16, name=shm_names(), shm_dir=str(shm), populate=False)
    config = KVStoreConfig(model_id="trust", block_size=BS, dram=dram)
    store = open_store(config, device_pools(rng), opened)
    tokens = tokens_of(rng, BS + 2)
    store.offload_session("s", tokens, [0, 1])
    sessions = next(shm.glob("*sessions"))
    before = sorted(os.listdir(sessions))
    mounts(sessions, read_only=True)
    with pytest.raises(TierIOError) as info:
        store.offload_session("t", tokens, [2, 3])
    assert str(sessions) in str(info.value) and "Read-only file system" in str(info.value)
    assert info.value.errno == errno.EROFS and isinstance(info.value, TpuSyncError)
    with pytest.raises(TierIOError, match="removing the session manifest"):
        store.drop_session("s")
    assert store.sessions() == ["s"] and sorted(os.listdir(sessions)) == before


def test_disk_pool_on_a_full_tmpfs_names_the_index(rng, mounts):
    """No room for a new index: TierFullError naming it, no temporary file left."""
    mnt = mounts("tmpfs", "256k")
    fill_up(mnt, rng)
    with pytest.raises(TierFullError, match=disk_module.INDEX_NAME) as info:
        DiskPool(layout("trust"), 64, mnt, direct_io=False)
    assert "free" in str(info.value)
    assert sorted(os.listdir(mnt)) == ["filler", disk_module.LOCK_NAME]


def test_shared_fs_put_on_a_full_tmpfs_leaves_no_temporary_file(rng, mounts):
    mnt = mounts("tmpfs", "256k")
    keys = [key_for(i) for i in range(4)]
    with HostPool(layout("trust"), 4) as source, SharedFsPool(layout("trust"), mnt) as tier:
        fill(source, keys)
        tier.put(keys[:1], source)
        fill_up(mnt, rng)
        with pytest.raises(TierFullError):
            tier.put(keys, source)
        leftovers = [p for p in mnt.rglob("*") if sfs_module.TEMP_MARK in p.name]
        assert leftovers == []
        with HostPool(layout("trust"), 4) as target:
            tier.get(keys[:1], target)
            check_served(target, keys[:1])


# === 3. fuzzing the decoders ===============================================================

FUZZ_S = 2.5
SEED = int(os.environ.get("TPUSYNC_TEST_SEED") or 0)


def test_fuzz_disk_pool_index_and_slabs(tmp_path):
    from tpusync._src.testing import file_fuzz

    counts = file_fuzz.fuzz_disk_pool(tmp_path, seconds=FUZZ_S, seed=SEED)
    print(dict(counts))
    assert counts["served"] and counts["miss"] and counts["refused"]


def test_fuzz_shared_fs_block_files(tmp_path):
    from tpusync._src.testing import file_fuzz

    counts = file_fuzz.fuzz_shared_fs(tmp_path, seconds=FUZZ_S, seed=SEED)
    print(dict(counts))
    assert counts["served"] and counts["miss"]


def test_fuzz_session_manifests(tmp_path):
    from tpusync._src.testing import file_fuzz

    counts = file_fuzz.fuzz_manifests(tmp_path, seconds=FUZZ_S, seed=SEED)
    print(dict(counts))
    assert counts["refused"] and counts["decoded"]


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=2 * 4096))
def test_index_header_decoder_takes_any_bytes(data):
    with contextlib.suppress(PoolFormatError):
        disk_module._decode_index_header(data, len(data))


@FAST
@given(st.binary(max_size=400), st.integers(0, 4095), st.integers(1, 255))
def test_block_header_decoder_takes_any_bytes(data, at, xor):
    good = bytearray(
        sfs_module.encode_block_header(key_for(1), bytes(16), 3000, 7, written_ns=1, writer="h:1")
    )
    good[at] ^= xor
    for candidate in (data, bytes(good)):
        try:
            header = sfs_module.decode_block_header(candidate)
        except (sfs_module._Corrupt, sfs_module._Foreign):
            continue
        assert 1 <= len(header.key) <= 32
        if candidate is not data:  # a change in the checked bytes is always refused
            assert at >= sfs_module.HEADER_USED and header.key == key_for(1)


@FAST
@given(st.one_of(st.binary(max_size=600), st.text(max_size=300).map(str.encode)))
def test_manifest_decoder_takes_any_bytes(data):
    with contextlib.suppress(_sessions.ManifestError):
        _sessions.decode_manifest(data, ("m", "ab"), 4)


def test_manifest_decoder_checks_every_field():
    record = _sessions.SessionRecord("x", np.arange(9, dtype=np.uint32), (b"a" * 16,) * 3)
    good = _sessions.encode_manifest(record, ("m", "fp"))
    assert _sessions.decode_manifest(good, ("m", "fp"), 4).tokens.tolist() == list(range(9))

    def edited(**fields: Any) -> bytes:
        body = {**json.loads(good)["body"], **fields}
        return json.dumps({"body": body, "digest": _sessions.manifest_digest(body)}).encode()

    for bad in (
        edited(tokens=[1.0] * 9),
        edited(tokens=[True] * 9),
        edited(tokens=[-1] * 9),
        edited(tokens=[1 << 32] * 9),
        edited(tokens=[10**30] * 9),
        edited(keys=["AB" * 16] * 3),
        edited(keys=["a b"] * 3),
        edited(keys=["ab" * 33] * 3),
        edited(keys=["ab"] * 2),  # 2 keys for 9 tokens in blocks of 4
        edited(version=True),
        edited(session_id=7),
        edited(session_id="\ud800"),
        edited(model_id="other"),
        b"[" * 100_000,
        b'{"body": {}, "digest": 1}',
    ):
        with pytest.raises(_sessions.ManifestError):
            _sessions.decode_manifest(bad, ("m", "fp"), 4)


def test_index_description_nested_too_deeply_is_a_cold_start(disk_dir, caplog):
    """A layout description of deeply nested JSON under a valid checksum raised
    RecursionError out of the open; it is a damaged index like any other."""
    index = disk_dir / disk_module.INDEX_NAME
    data = bytearray(index.read_bytes())
    start, crc_at = disk_module._INDEX_FIXED.size, disk_module.HEADER_BYTES - 4
    nested = b"[" * 2000 + b"]" * 2000
    data[start : start + len(nested)] = nested
    data[72:76] = len(nested).to_bytes(4, "little")
    data[crc_at:] = zlib.crc32(bytes(data[:crc_at])).to_bytes(4, "little") + data[crc_at + 4 :]
    index.write_bytes(bytes(data))
    with pytest.raises(PoolFormatError, match="layout description"):
        open_disk(disk_dir, on_mismatch="error")
    with caplog.at_level(logging.WARNING, "tpusync.tiers"), open_disk(disk_dir) as disk:
        assert not disk.attached and "cold pool" in caplog.text


def test_huge_sequence_number_in_a_record_is_dropped(disk_dir):
    """A committed record whose sequence number is near 2**64 made the next put overflow
    (OverflowError) after its slots were taken; such a record is damage, dropped on open."""
    index = disk_dir / disk_module.INDEX_NAME
    data = bytearray(index.read_bytes())
    data[disk_module.HEADER_BYTES + 24 : disk_module.HEADER_BYTES + 32] = b"\xff" * 8
    index.write_bytes(bytes(data))
    keys = [key_for(i) for i in range(12)]
    with open_disk(disk_dir) as disk, HostPool(layout("trust"), 12) as source:
        assert len(disk.keys()) == 11
        (gone,) = [k for k in keys if k not in disk.keys()]  # noqa: SIM118 (not a dict)
        fill(source, [gone])
        assert disk.put([gone], source) == 1
        source.delete([gone])
        disk.get(keys, source)
        check_served(source, keys)


def test_damaged_key_in_a_disk_record_serves_no_stored_key_wrongly(disk_dir):
    """A known limit, pinned down: disk index records carry no checksum of their own, so a
    record whose key bytes are damaged lists a key nobody stored, whose block (verified against
    the record's payload checksum) is a whole stored block; no key that was stored is ever
    served another block's bytes."""
    data = bytearray((disk_dir / disk_module.INDEX_NAME).read_bytes())
    data[disk_module.HEADER_BYTES + 32] ^= 0x80  # slot 0's first key byte
    (disk_dir / disk_module.INDEX_NAME).write_bytes(bytes(data))
    keys = [key_for(i) for i in range(12)]
    with open_disk(disk_dir) as disk, HostPool(layout("trust"), 13) as target:
        damaged = [k for k in disk.keys() if k not in keys]  # noqa: SIM118 (not a dict)
        assert len(damaged) == 1
        with pytest.raises(BlocksMissingError) as info:
            disk.get(keys, target)
        assert info.value.loaded.count(False) == 1
        check_served(target, [k for k, ok in zip(keys, info.value.loaded, strict=True) if ok])


def test_fuzz_script_runs(tmp_path):
    script = REPO / "scripts" / "fuzz_files.py"
    command = [sys.executable, str(script), "--seconds", "0.5", "--seed", "3"]
    result = subprocess.run(
        [*command, "--directory", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "disk" in result.stdout and "manifests" in result.stdout
