"""The cores standing for two hosts on one (tpusync._src.bench.cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from tpusync._src.bench.cores import SplitEnds, pin_process, pinned_thread
from tpusync._src.testing.processes import stop_process


def _ends() -> SplitEnds:
    ends = SplitEnds.here()
    assert ends is not None, "these tests need two CPUs"  # CI's machines have them
    return ends


def test_the_two_ends_get_different_cpus_this_process_may_use() -> None:
    ends = _ends()
    allowed = os.sched_getaffinity(0)
    assert ends.sender != ends.receiver and {ends.sender, ends.receiver} <= allowed
    assert "CPU" in ends.describe()


def test_a_thread_is_pinned_inside_the_block_and_given_its_cpus_back() -> None:
    ends = _ends()
    before = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def other_thread() -> None:
        seen["other"] = os.sched_getaffinity(0)

    with pinned_thread(ends.receiver):
        seen["inside"] = os.sched_getaffinity(0)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(10)
    assert seen["inside"] == {ends.receiver}
    assert seen["other"] == {ends.receiver}  # started inside: it inherits the setting
    assert os.sched_getaffinity(0) == before
    with pinned_thread(None):
        assert os.sched_getaffinity(0) == before


def test_the_block_gives_the_cpus_back_when_it_raises() -> None:
    before = os.sched_getaffinity(0)
    try:
        with pinned_thread(_ends().sender):
            raise KeyError("x")
    except KeyError:
        pass
    assert os.sched_getaffinity(0) == before


def test_every_thread_of_a_process_is_pinned() -> None:
    ends = _ends()
    child = subprocess.Popen(
        [sys.executable, "-c", "import threading, sys; "
         "[threading.Thread(target=sys.stdin.read, daemon=True).start() for _ in range(3)]; "
         "print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        pin_process(child.pid, {ends.sender})
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) >= 4
        assert all(os.sched_getaffinity(int(t)) == {ends.sender} for t in tids)
        pin_process(child.pid, os.sched_getaffinity(0))
        assert all(os.sched_getaffinity(int(t)) == os.sched_getaffinity(0) for t in tids)
    finally:
        stop_process(child)
        if child.stdin is not None:
            child.stdin.close()
