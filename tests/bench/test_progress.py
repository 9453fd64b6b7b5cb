"""Progress reports on long work: a redrawn line on a terminal, log lines elsewhere."""

from __future__ import annotations

import io
import logging

import pytest

from tpusync._src.memory import progress as progress_module
from tpusync._src.memory.progress import Progress


def test_terminal_progress_redraws_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", screen)
    with Progress("prefaulting", 4 << 30) as progress:
        for _ in range(4):
            progress.advance(1 << 30)
    text = screen.getvalue()
    assert text.startswith("\rprefaulting [") and "4.00/4.00 GiB" in text
    assert text.endswith(" s\n") and text.count("\n") == 1


def test_log_progress_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tpusync"), Progress("copying", 2 << 30) as p:
        p.advance(2 << 30)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "tpusync: copying (2.00 GiB)..."
    assert messages[1].startswith("tpusync: copying done in ")


def test_a_large_host_pool_reports_its_prefault(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """HostPool prefaulting above PROGRESS_MIN_BYTES reports progress (lowered here so that
    the test maps 64 MiB, not a GiB); below it, it stays silent."""
    from tpusync._src.tiers.dram import _prefault
    from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

    layout = PoolLayout("progress", (ArrayLayout("k", "uint8", (1 << 20,), 0, 1),))
    monkeypatch.setattr(_prefault, "PROGRESS_MIN_BYTES", 32 << 20)
    with caplog.at_level(logging.INFO, logger="tpusync"):
        HostPool(layout, 16).close()  # 16 MiB: silent
        assert not caplog.records
        HostPool(layout, 64).close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("tpusync: prefaulting host pool (0.06 GiB)")
    assert messages[-1].startswith("tpusync: prefaulting host pool done in ")
