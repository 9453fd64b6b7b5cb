"""Two hosts on one: the cores that stand for the sending host and the receiving host when a
benchmark runs both ends of a TCP transfer on this machine.

Over loopback the receiving thread is woken from the sender's core, and on a small machine the
kernel often leaves it there: the two ends then take turns on one core while another idles, in
some runs and not others (docs/connectors/vllm.md, "Two hosts on one"). Between hosts the sender
has cores of its own, so a figure "as between hosts" pins each end to its own cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["SplitEnds", "pin_process", "pinned_thread"]


@dataclass(frozen=True)
class SplitEnds:
    """The CPU the sending end runs on and the CPU the receiving thread runs on."""

    sender: int
    receiver: int

    @classmethod
    def here(cls) -> SplitEnds | None:
        """The last CPU this process may use for the sender, the first for the receiver; None
        with a single CPU (nothing to split)."""
        cpus = sorted(os.sched_getaffinity(0))
        return cls(cpus[-1], cpus[0]) if len(cpus) >= 2 else None

    def describe(self) -> str:
        return f"sender on CPU {self.sender}, receiver on CPU {self.receiver}"


def pin_process(pid: int, cpus: set[int]) -> None:
    """Runs every thread of process ``pid`` on ``cpus`` (threads it starts later inherit the
    setting from the thread that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def pinned_thread(cpu: int | None) -> Iterator[None]:
    """Runs the calling thread on ``cpu`` inside the block (None: leaves it where it is), and
    gives it back the CPUs it had after."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
