"""A hostile local user: another uid on the same host can write /dev/shm and /tmp and
guess pool names. It pre-creates pool files, symlinks, session directories and tier files where
a tenant's tpusync will look; each must be refused or replaced, never attached, and no block it
forged may be served.

The attacker is a real second uid (65534, "nobody"): as root, ``setpriv --reuid 65534 --regid
65534 --clear-groups`` runs ``/bin/sh`` and ``dd`` (our venv may not be reachable by it), fed
from files in a 0755 scratch directory.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from run_names import RUN_TAG, run_name

from tpusync._src.tiers.dram import pool_path
from tpusync.errors import UnsafeFileError
from tpusync.kv import DiskTier, DramTier, KVCacheStore, KVStoreConfig, SharedFsTier
from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout, SharedFsPool

ATTACKER = 65534
SHM = Path("/dev/shm")
TIMEOUT = 30


def as_attacker(script: str) -> None:
    """Runs ``script`` in /bin/sh as uid/gid 65534 with umask 0 (files it makes are 0666)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("these tests run as root with setpriv (util-linux): CI has both")
    subprocess.run(
        ["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups",
         "/bin/sh", "-c", f"umask 0; {script}"],
        check=True, timeout=TIMEOUT, capture_output=True,
    )  # fmt: skip


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory the attacker can read (0755), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"{RUN_TAG}-attack-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def name() -> Iterator[str]:
    """A unique pool name; whatever the test or the attacker left under it in /dev/shm goes."""
    pool_name = run_name("hostile")
    yield pool_name
    for entry in SHM.glob(f"*{pool_name}*"):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def make_layout(model: str = "hostile") -> PoolLayout:
    return PoolLayout(model, (ArrayLayout("kv", "uint8", (4096,), 0, 1),))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def fill(pool: HostPool, keys: list[bytes], rng: np.random.Generator) -> list[np.ndarray]:
    """Puts random non-zero payloads under ``keys`` (through a reservation, as tiers do)."""
    reservation = pool.reserve(keys)
    payloads = []
    for slot in reservation.slots:
        data = rng.integers(1, 256, pool.layout.slot_bytes, dtype=np.uint8)
        np.frombuffer(pool.slot_memory(int(slot)), np.uint8)[:] = data
        payloads.append(data)
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    return payloads


def forged_pool_bytes(scratch: Path, rng: np.random.Generator) -> tuple[Path, bytes]:
    """A valid pool file (made by us elsewhere) holding a block under key(0), copied where the
    attacker can read it; returns that copy and the forged payload."""
    shm_dir = scratch / "made"
    shm_dir.mkdir(mode=0o700)
    with HostPool(make_layout(), 4, name="forged", shm_dir=str(shm_dir)) as pool:
        payload = fill(pool, [key(0)], rng)[0]
    source = scratch / "forged.pool"
    shutil.copyfile(pool_path("forged", str(shm_dir)), source)
    source.chmod(0o644)
    shutil.rmtree(shm_dir)
    return source, payload.tobytes()


def assert_foreign(path: Path) -> None:
    info = path.lstat()
    assert info.st_uid == ATTACKER, "the attacker's file was replaced or removed"


# --- named pools in /dev/shm -------------------------------------------------------------------


def test_a_pool_file_another_uid_created_is_refused_not_attached(
    scratch: Path, name: str, rng: np.random.Generator
) -> None:
    source, forged = forged_pool_bytes(scratch, rng)
    target = pool_path(name)
    as_attacker(f"dd if={source} of={target} bs=65536 status=none")
    assert target.stat().st_mode & 0o777 == 0o666
    for on_mismatch in ("error", "recreate"):
        with pytest.raises(UnsafeFileError, match=f"owned by uid {ATTACKER}"):
            HostPool(make_layout(), 4, name=name, on_mismatch=on_mismatch)
    assert_foreign(target)
    # Through the KV store too: the forged block under key(0) is never served.
    config = KVStoreConfig("hostile", block_size=16, dram=DramTier(4, name=name))
    with pytest.raises(UnsafeFileError, match=str(target)):
        store_over(config)
    assert target.read_bytes().count(forged) == 1  # still there, and still not ours


def test_a_pool_file_of_ours_that_others_may_write_is_refused(
    scratch: Path, name: str, rng: np.random.Generator
) -> None:
    """Made 0666 by someone with our uid (or chmod'ed): another user could rewrite blocks and
    their checksums, so it is refused and left for the user to fix."""
    with HostPool(make_layout(), 4, name=name) as pool:
        fill(pool, [key(1)], rng)
    target = pool_path(name)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    target.chmod(0o666)
    with pytest.raises(UnsafeFileError, match="chmod go-w"):
        HostPool(make_layout(), 4, name=name)
    target.chmod(0o600)
    with HostPool(make_layout(), 4, name=name) as pool:
        assert pool.contains([key(1)]) == [True]


def test_a_symlink_planted_at_a_pool_path_is_never_followed(scratch: Path, name: str) -> None:
    victim = scratch / "victim-file"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    target = pool_path(name)
    as_attacker(f"ln -s {victim} {target}")
    with pytest.raises(UnsafeFileError, match="symlink"):
        HostPool(make_layout(), 4, name=name)
    assert victim.read_bytes() == b"precious"
    assert target.is_symlink()


def test_a_session_directory_another_uid_planted_is_refused(name: str) -> None:
    sessions = SHM / f"tpusync-{name}.sessions"
    as_attacker(f"mkdir -m 0777 {sessions} && echo '{{}}' > {sessions}/planted.json")
    config = KVStoreConfig("hostile", block_size=16, dram=DramTier(4, name=name))
    with pytest.raises(UnsafeFileError, match=str(sessions)):
        store_over(config)
    assert_foreign(sessions)
    assert not pool_path(name).exists(), "the refused store left its DRAM pool behind"


# --- disk and shared-FS tiers ------------------------------------------------------------------


def test_a_tier_directory_another_uid_created_is_refused(scratch: Path) -> None:
    """The attacker guessed where the tenant's tiers go (under a shared /tmp) and made them
    first: the store refuses them, with or without create=True."""
    open_dir = scratch / "open"
    open_dir.mkdir()
    open_dir.chmod(0o1777)  # like /tmp
    disk, shared = open_dir / "kv-disk", open_dir / "kv-shared"
    as_attacker(f"mkdir -m 0777 {disk} {shared}")
    for create in (False, True):
        config = KVStoreConfig(
            "hostile", block_size=16, dram=DramTier(4), tiers=(DiskTier(disk, 8, create=create),)
        )
        with pytest.raises(UnsafeFileError, match=f"{disk}: owned by uid {ATTACKER}"):
            store_over(config)
        config = KVStoreConfig(
            "hostile",
            block_size=16,
            dram=DramTier(4),
            tiers=(SharedFsTier(shared, create=create),),
        )
        with pytest.raises(UnsafeFileError, match=f"{shared}: owned by uid {ATTACKER}"):
            store_over(config)
    assert list(disk.iterdir()) == [] and list(shared.iterdir()) == []


def test_tier_files_another_uid_planted_are_never_read_as_ours(
    scratch: Path, rng: np.random.Generator
) -> None:
    """The tenant's directories were briefly open to others (0777): the attacker planted a disk
    index and a shared-FS block file. After the tenant fixes the mode, the planted index is
    refused or replaced (never attached) and the planted block is a miss."""
    layout = make_layout()
    disk_dir, shared_dir = scratch / "disk", scratch / "shared"
    for directory in (disk_dir, shared_dir):
        directory.mkdir(mode=0o700)
    keys = [key(10 + i) for i in range(4)]
    with HostPool(layout, 8) as dram:
        payloads = fill(dram, keys, rng)
        with DiskPool(layout, 8, disk_dir, slab_slots=4) as disk:
            assert disk.put(keys, dram) == len(keys)
        with SharedFsPool(layout, shared_dir) as shared:
            assert shared.put(keys, dram) == len(keys)
    index = next(p for p in disk_dir.rglob("*") if p.is_file() and "index" in p.name)
    block = next(p for p in shared_dir.rglob("*") if p.is_file() and p.stat().st_size >= 4096)
    planted = {}
    for victim in (index, block):
        copy = scratch / f"planted-{victim.name}"
        data = bytearray(victim.read_bytes())
        data[-64] ^= 0xFF  # a forged byte the attacker wants served
        copy.write_bytes(bytes(data))
        copy.chmod(0o644)
        planted[victim] = copy
    block_dirs = {block.parent, *block.parent.parents} - set(shared_dir.parents)
    opened = [disk_dir, index.parent, *block_dirs]
    for directory in opened:
        directory.chmod(0o777)
    as_attacker(
        " && ".join(f"rm -f {victim} && cp {copy} {victim}" for victim, copy in planted.items())
    )
    for directory in opened:
        directory.chmod(0o700)
    assert_foreign(index) and assert_foreign(block)  # type: ignore[func-returns-value]
    with HostPool(layout, 8) as target:
        try:
            disk = DiskPool(layout, 8, disk_dir, slab_slots=4)
        except UnsafeFileError as error:
            assert str(index) in str(error) or str(disk_dir) in str(error)
        else:
            with disk:
                assert index.lstat().st_uid == os.geteuid(), "attached the planted index"
        with SharedFsPool(layout, shared_dir) as shared:
            served = shared.contains(keys)
            try:
                shared.get(keys, target)
            except Exception as error:  # the planted block is a miss, never data
                loaded = getattr(error, "loaded", None)
                assert loaded is not None, error
            else:
                loaded = [True] * len(keys)
            for i, k in enumerate(keys):
                if loaded[i] and target.contains([k])[0]:
                    slot = target.slot_of(k)
                    assert slot is not None
                    view = target.slot_memory(slot)
                    same = np.array_equal(np.frombuffer(view, np.uint8), payloads[i])
                    view.release()
                    assert same, "served a forged block"
            assert not all(loaded), (served, "the planted block was served")


def store_over(config: KVStoreConfig) -> None:
    """Builds a store over small random pools (and closes it if it was built)."""
    import jax.numpy as jnp

    from tpusync import DevicePool

    pool = DevicePool(jnp.ones((8, config.block_size, 2, 4), jnp.float32))
    KVCacheStore(config, [pool]).close()
