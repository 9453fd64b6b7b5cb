"""Issue 19: the DRAM tier in ``tiers/dram/`` and ``KVCacheStore``'s handles and sessions in
their own kv modules, with the old spellings kept (``tiers/host_pool.py`` warns for one release)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tpusync.kv
import tpusync.kv.store
import tpusync.tiers
import tpusync.tiers.dram

SRC = Path(__file__).resolve().parents[1] / "src" / "tpusync"


def test_the_old_host_pool_path_warns_and_re_exports_the_dram_tier() -> None:
    code = (
        "import tpusync.tiers as t, tpusync.tiers.dram as d, tpusync.tiers.host_pool as m; "
        "assert m.HostPool is t.HostPool is d.HostPool; assert m.Reservation is t.Reservation; "
        "assert m.Pinned is t.Pinned; assert m.pool_path is d.pool_path; "
        "assert m.DEFAULT_SHM_DIR == d.DEFAULT_SHM_DIR"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "tpusync.tiers.host_pool is deprecated" in result.stderr
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_the_dram_tier_is_one_subpackage() -> None:
    assert tpusync.tiers.HostPool.__module__ == "tpusync.tiers.dram.pool"
    assert tpusync.tiers.Reservation is tpusync.tiers.dram.Reservation
    assert tpusync.tiers.Pinned is tpusync.tiers.dram.Pinned


def test_kv_store_names_are_the_same_objects_from_kv_and_kv_store() -> None:
    for name in tpusync.kv.store.__all__:
        assert getattr(tpusync.kv, name) is getattr(tpusync.kv.store, name), name


def test_the_split_modules_are_under_800_lines() -> None:
    paths = [
        *sorted((SRC / "tiers" / "dram").glob("*.py")),
        *sorted((SRC / "tiers" / "disk").glob("*.py")),
        *sorted((SRC / "kv").glob("*.py")),
    ]
    long = {p.name: n for p in paths if (n := len(p.read_text().splitlines())) > 800}
    assert long == {}
