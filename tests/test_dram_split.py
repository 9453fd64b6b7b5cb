"""Issue 19: the DRAM tier in ``tiers/dram/`` and ``KVCacheStore``'s handles and sessions in
their own kv modules."""

from __future__ import annotations

from pathlib import Path

import tpusync.kv
import tpusync.kv.store
import tpusync.tiers
import tpusync.tiers.dram

SRC = Path(__file__).resolve().parents[1] / "src" / "tpusync"


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
