"""Golden files: pools written by earlier builds of each format version still read, byte-exact.

Regenerate only with a format version bump: ``python tests/data/make_golden.py``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from paths import DATA

from tpusync.tiers import DiskPool, HostPool, SharedFsPool

sys.path.insert(0, str(DATA))
import make_golden as golden


def test_host_pool_v1_reads(tmp_path: Path) -> None:
    shutil.copyfile(DATA / "hostpool-v1.pool", tmp_path / "tpusync-golden.pool")
    pools = golden.golden_pools()
    pool = HostPool(
        golden.golden_layout(), 4, name="golden", shm_dir=str(tmp_path), on_mismatch="error"
    )
    try:
        assert pool.attached and sorted(pool.keys()) == sorted(golden.KEYS)
        pool.get_to_device(golden.KEYS, pools, [3, 2, 1])
        for a, device_pool in enumerate(pools):
            got = np.asarray(device_pool.array)
            for key, block in zip(golden.KEYS, [3, 2, 1], strict=True):
                np.testing.assert_array_equal(
                    got[block].view(np.uint32), golden.golden_block(key, a).view(np.uint32)
                )
    finally:
        pool.close()


def _check_loaded(pool: HostPool) -> None:
    pools = golden.golden_pools()
    pool.get_to_device(golden.KEYS, pools, [0, 1, 2])
    for a, device_pool in enumerate(pools):
        got = np.asarray(device_pool.array)
        for block, key in enumerate(golden.KEYS):
            np.testing.assert_array_equal(
                got[block].view(np.uint32), golden.golden_block(key, a).view(np.uint32)
            )


def test_disk_pool_v1_reads(tmp_path: Path) -> None:
    shutil.copytree(DATA / "diskpool-v1", tmp_path / "disk")
    target = HostPool(golden.golden_layout(), 4)
    with DiskPool(golden.golden_layout(), 4, tmp_path / "disk", on_mismatch="error") as disk:
        assert sorted(disk.keys()) == sorted(golden.KEYS)
        disk.get(golden.KEYS, target)
    _check_loaded(target)


def test_shared_fs_v1_reads(tmp_path: Path) -> None:
    shutil.copytree(DATA / "sharedfs-v1", tmp_path / "shared")
    target = HostPool(golden.golden_layout(), 4)
    with SharedFsPool(golden.golden_layout(), tmp_path / "shared") as shared:
        assert sorted(shared.keys()) == sorted(golden.KEYS)
        shared.get(golden.KEYS, target)
    _check_loaded(target)
