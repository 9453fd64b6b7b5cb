"""Writes the golden pool files in tests/data (run once per format version, then commit).

    python tests/data/make_golden.py [hostpool] [diskpool] [sharedfs]   (default: all three)

Each file holds blocks whose bytes are a function of their key (``golden_block``), so a test can
check every byte a later build reads back. A format change must bump the format version and add
new golden files; the old ones stay, so that the tests show what still reads.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import tpusync
from tpusync._src.tiers.dram.pool_file import FORMAT_VERSION as HOST_POOL_VERSION
from tpusync.tiers import DiskPool, HostPool, PoolLayout, SharedFsPool

HERE = Path(__file__).parent
BLOCK_SHAPE = (8, 16)  # float32: 512 bytes per array per block
KEYS = [bytes([i]) * 16 for i in (1, 2, 3)]


def golden_block(key: bytes, array: int) -> np.ndarray:
    rng = np.random.default_rng([key[0], array])
    return rng.integers(1, 2**32, size=BLOCK_SHAPE, dtype=np.uint32).view(np.float32)


def golden_pools(n_blocks: int = 4) -> list[tpusync.DevicePool]:
    zeros = np.zeros((n_blocks, *BLOCK_SHAPE), np.float32)
    return [tpusync.DevicePool(jax.device_put(zeros)) for _ in range(2)]


def golden_layout() -> PoolLayout:
    return PoolLayout.from_pools("golden", golden_pools(), names=["k", "v"])


def write_host_pool(target: Path) -> None:
    pools = golden_pools()
    for a, pool in enumerate(pools):
        host = np.stack([golden_block(k, a) for k in KEYS])
        tpusync.transfer(host, pool, dst_blocks=range(len(KEYS))).result()
    with tempfile.TemporaryDirectory() as shm_dir:
        pool = HostPool(golden_layout(), 4, name="golden", shm_dir=shm_dir)
        pool.put_from_device(KEYS, pools, range(len(KEYS)))
        pool.close()
        shutil.copyfile(Path(shm_dir) / "tpusync-golden.pool", target)


def filled_host_pool() -> HostPool:
    """An anonymous DRAM pool holding the golden blocks (the source of the other formats)."""
    pools = golden_pools()
    for a, pool in enumerate(pools):
        host = np.stack([golden_block(k, a) for k in KEYS])
        tpusync.transfer(host, pool, dst_blocks=range(len(KEYS))).result()
    source = HostPool(golden_layout(), 4)
    source.put_from_device(KEYS, pools, range(len(KEYS)))
    return source


def write_disk_pool(target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    source = filled_host_pool()
    with DiskPool(golden_layout(), 4, target, direct_io=False) as disk:
        disk.put(KEYS, source)
    (target / "tpusync-disk.lock").unlink(missing_ok=True)  # recreated on open


def write_shared_fs(target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    source = filled_host_pool()
    with SharedFsPool(golden_layout(), target) as shared:
        shared.put(KEYS, source)


def main(formats: list[str]) -> None:
    """Writes the golden files of this build's version of each of ``formats`` (the older
    versions' files stay)."""
    writers = {
        "hostpool": lambda: write_host_pool(HERE / f"hostpool-v{HOST_POOL_VERSION}.pool"),
        "diskpool": lambda: write_disk_pool(HERE / "diskpool-v1"),
        "sharedfs": lambda: write_shared_fs(HERE / "sharedfs-v1"),
    }
    for name in formats or list(writers):
        writers[name]()
    print("wrote", *sorted(p.name for p in HERE.glob("*-v*")), file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1:])
