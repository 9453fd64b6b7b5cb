"""Which slots' pages a process has mapped (tpusync._src.tiers.dram.slot_pages): one call per run of
neighbouring slots, never a slot twice, the background walk's steps."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._src.tiers.dram.slot_pages import SlotPages

SLOT, OFFSET = 4096 + 64, 8192


def _recorder() -> tuple[list[tuple[int, int]], SlotPages]:
    calls: list[tuple[int, int]] = []
    return calls, SlotPages(50, SLOT, OFFSET, lambda start, length: calls.append((start, length)))


@settings(max_examples=80, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 49), max_size=30), max_size=6))
def test_each_slot_is_mapped_once_a_run_per_call(batches: list[list[int]]) -> None:
    calls, pages = _recorder()
    seen: set[int] = set()
    for batch in batches:
        before = len(calls)
        pages.ensure(np.array(batch, dtype=np.int64))
        fresh = sorted(set(batch) - seen)
        runs = np.split(np.array(fresh), np.flatnonzero(np.diff(fresh) != 1) + 1) if fresh else []
        assert calls[before:] == [(OFFSET + int(run[0]) * SLOT, len(run) * SLOT) for run in runs]
        seen |= set(batch)
    assert pages.all_mapped == (len(seen) == 50)


def test_a_tail_maps_only_the_last_slots_payload() -> None:
    calls, pages = _recorder()
    pages.ensure(np.array([3, 4, 9]), tail_bytes=100)
    assert calls == [(OFFSET + 3 * SLOT, SLOT + 100), (OFFSET + 9 * SLOT, 100)]


def test_a_pool_mapped_at_creation_maps_nothing() -> None:
    calls: list[tuple[int, int]] = []
    pages = SlotPages(8, SLOT, 0, lambda s, n: calls.append((s, n)), mapped=True)
    pages.ensure(np.arange(8))
    assert pages.all_mapped and calls == []


def test_a_failed_call_leaves_its_slots_unmapped() -> None:
    calls: list[tuple[int, int]] = []

    def fails_once(start: int, length: int) -> None:
        calls.append((start, length))
        if len(calls) == 1:
            raise OSError("no")

    pages = SlotPages(4, SLOT, 0, fails_once)
    with pytest.raises(OSError):
        pages.ensure(np.array([1, 2]))
    pages.ensure(np.array([1, 2]))  # asked again: mapped now
    pages.ensure(np.array([1, 2]))
    assert calls == [(SLOT, 2 * SLOT)] * 2


@pytest.mark.parametrize(
    ("step", "limit", "want"),
    [
        (3 * SLOT, None, [[0, 1, 2], [3, 4, 5], [6]]),
        (3 * SLOT, 5 * SLOT, [[0, 1, 2], [3, 4]]),
        (1, None, [[i] for i in range(7)]),  # a step below a slot: one slot at a time
        (SLOT, 1, [[0]]),  # a limit below a slot: the first slot still
    ],
)
def test_the_walk_goes_in_steps_up_to_its_limit(
    step: int, limit: int | None, want: list[list[int]]
) -> None:
    pages = SlotPages(7, SLOT, 0, lambda s, n: None)
    assert [s.tolist() for s in pages.steps(step, limit)] == want
