"""`tpusync shm list/remove` and the functions behind them, on real pool files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import tpusync
from tpusync._src.tiers.dram.shm_admin import list_pools, remove_pool
from tpusync.errors import InvalidArgumentError, PoolBusyError
from tpusync.tiers import HostPool, PoolLayout


def _pool(shm_dir: Path, name: str) -> HostPool:
    pools = [tpusync.DevicePool(jax.device_put(np.ones((4, 8, 128), np.float32)))]
    pool = HostPool(PoolLayout.from_pools("admin-test", pools), 3, name=name, shm_dir=str(shm_dir))
    pool.put_from_device([b"k" * 16, b"j" * 16], pools, [0, 1])
    return pool


def test_list_shows_owner_fingerprint_and_usage(tmp_path: Path) -> None:
    live = _pool(tmp_path, "live")
    gone = _pool(tmp_path, "gone")
    gone.close()
    (tmp_path / "tpusync-junk.pool").write_bytes(b"not a pool at all")
    try:
        infos = {p.name: p for p in list_pools(str(tmp_path))}
        assert set(infos) == {"live", "gone", "junk"}
        assert infos["live"].owner_alive and infos["live"].owner_pid == os.getpid()
        assert not infos["gone"].owner_alive
        for name in ("live", "gone"):
            info = infos[name]
            assert info.used == 2 and info.slots == 3 and info.model_id == "admin-test"
            assert info.fingerprint == live.layout.fingerprint.hex()
        assert infos["junk"].error and infos["junk"].used is None
    finally:
        live.close()


def test_remove_refuses_a_live_owner_unless_forced(tmp_path: Path) -> None:
    live = _pool(tmp_path, "busy")
    try:
        with pytest.raises(PoolBusyError, match="in use by a live process"):
            remove_pool("busy", shm_dir=str(tmp_path))
        assert (tmp_path / "tpusync-busy.pool").exists()
        remove_pool("busy", force=True, shm_dir=str(tmp_path))
        assert not (tmp_path / "tpusync-busy.pool").exists()
    finally:
        live.close()
    with pytest.raises(InvalidArgumentError, match="no pool 'busy'"):
        remove_pool("busy", shm_dir=str(tmp_path))


def test_cli_list_and_remove(tmp_path: Path) -> None:
    _pool(tmp_path, "cli").close()
    run = [sys.executable, "-m", "tpusync", "shm", "--dir", str(tmp_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    listed = subprocess.run([*run, "list"], capture_output=True, text=True, timeout=120, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "cli" in listed.stdout and "gone" in listed.stdout and "2/3" in listed.stdout
    removed = subprocess.run(
        [*run, "remove", "cli"], capture_output=True, text=True, timeout=120, env=env
    )
    assert removed.returncode == 0 and not (tmp_path / "tpusync-cli.pool").exists()
    again = subprocess.run(
        [*run, "remove", "cli"], capture_output=True, text=True, timeout=120, env=env
    )
    assert again.returncode == 1 and "no pool 'cli'" in again.stderr
