"""The DRAM tier in ``tiers/dram/`` and ``KVCacheStore``'s handles and sessions in
their own kv modules."""

from __future__ import annotations

from paths import REPO

import tpusync._src.kv.store
import tpusync._src.tiers.dram
import tpusync.kv
import tpusync.tiers

SRC = REPO / "src" / "tpusync" / "_src"


def test_the_dram_tier_is_one_subpackage() -> None:
    """All of DRAM (its pool, file format, opening, shm files, mapped pages, admin) sits in
    ``tiers/dram/`` (issue 55); the slot handles belong to the interface the tiers share."""
    assert tpusync.tiers.HostPool.__module__ == "tpusync._src.tiers.dram.pool"
    dram = {p.stem for p in (SRC / "tiers" / "dram").glob("*.py")}
    assert {"pool_file", "_pool_open", "_shm_files", "shm_admin", "slot_pages"} <= dram
    root = {p.stem for p in (SRC / "tiers").glob("*.py")}
    assert not root & {"pool_file", "_pool_open", "_shm_files", "shm_admin", "slot_pages"}
    assert tpusync.tiers.Reservation.__module__ == "tpusync._src.tiers.slots"
    assert tpusync.tiers.Pinned.__module__ == "tpusync._src.tiers.slots"
    methods = [n for n, v in vars(tpusync.tiers.SlotPool).items() if callable(v) and n[0] != "_"]
    assert len(methods) >= 10
    assert all(callable(getattr(tpusync.tiers.HostPool, n, None)) for n in methods), methods


def test_the_lower_tier_interface_imports_no_concrete_tier() -> None:
    """``tiers/base.py`` states what a lower tier needs of a DRAM pool (``SlotPool``) instead
    of importing ``HostPool``; the import-linter contract ``base-abstract`` checks it too."""
    text = (SRC / "tiers" / "base.py").read_text()
    for medium in ("dram", "disk", "shared_fs"):
        assert f"tpusync._src.tiers.{medium}" not in text, medium


def test_kv_store_names_are_the_same_objects_from_kv_and_kv_store() -> None:
    for name in tpusync._src.kv.store.__all__:
        assert getattr(tpusync.kv, name) is getattr(tpusync._src.kv.store, name), name
