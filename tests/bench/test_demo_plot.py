"""`tpusync demo --plot`: without matplotlib it is refused before the demo runs, naming
the extra to install; where it draws, no label overlaps another (rendered with Agg, the labels'
bounding boxes compared)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpusync._src.demo import PLOT_HINT, Row, ttft_figure

# the demo's rows, with TTFTs from a cold prefill down to a warm hit a hundred times faster
ROWS = [
    Row("cold prefill", "-", 2.31, 0, 0, None, None),
    Row("warm, full hit", "dram", 0.021, 8176, 64 << 20, 12.5, True),
    Row("warm, DRAM evicted", "disk", 0.094, 8176, 64 << 20, 2.1, True),
    Row("warm, DRAM+disk evicted", "shared_fs", 0.12, 8176, 64 << 20, 1.7, True),
    Row("warm, only on store node", "node", 0.088, 8176, 64 << 20, 2.4, True),
    Row("decode process, over TCP", "registry", 0.105, 8176, 64 << 20, 1.9, True),
    Row("agent resume", "session", 0.019, 8184, 64 << 20, None, True),
    Row("new process, /dev/shm", "dram", 0.025, 8176, 64 << 20, 10.2, True),
]


def test_no_label_of_the_ttft_plot_overlaps_another() -> None:
    """Every text drawn (scenario labels, values on the bars, ticks, title) lies inside the
    figure and clear of every other: 6 of the 8 scenario labels used to run into each other."""
    pytest.importorskip("matplotlib")  # tpusync[test] installs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = ttft_figure(ROWS, 8192)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    axis = figure.axes[0]
    labels = [t for t in axis.get_yticklabels() if t.get_text()]
    assert [t.get_text() for t in labels][:2] == ["cold prefill", "warm, full hit (dram)"]
    assert len(labels) == len(ROWS)
    low, high = sorted(axis.get_xlim())
    ticks = [t for t in axis.get_xticklabels() if low <= t.get_position()[0] <= high]  # drawn
    texts = [
        t
        for t in [*labels, *axis.texts, *ticks, axis.title, axis.xaxis.label]
        if t.get_visible() and t.get_text()
    ]
    assert len([t for t in axis.texts if t.get_text()]) == len(ROWS)  # a value on each bar
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    whole = figure.bbox
    for text, box in boxes:
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1, f"{text!r} leaves the figure"
        assert whole.y0 <= box.y0 and box.y1 <= whole.y1, f"{text!r} leaves the figure"
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"


def test_plot_without_matplotlib_is_refused_before_the_demo_runs(tmp_path: Path) -> None:
    """The real command in a process where matplotlib cannot be imported: a usage error that
    names the extra, before any of the demo's minutes."""
    blocked = (
        "import sys; sys.modules['matplotlib'] = None; from tpusync._src.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    plot = tmp_path / "ttft.png"
    done = subprocess.run(
        [sys.executable, "-c", blocked, "demo", "--plot", str(plot), "--tokens", "32"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--plot: needs matplotlib, which is not installed: `{PLOT_HINT}`" in done.stderr
    assert PLOT_HINT == "pip install 'tpusync[demo]'"
    assert done.stdout == "" and not plot.exists()  # nothing ran
