"""benchmarks/ab.py's comparison: medians per side, per-round pairs that cancel drift, flags."""

from __future__ import annotations

import importlib.util

from paths import REPO

_spec = importlib.util.spec_from_file_location("ab", REPO / "benchmarks" / "ab.py")
assert _spec is not None and _spec.loader is not None
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def runs_of(a: list[float], b: list[float], label: str = "load_gbps") -> dict:
    sign = ab.direction(label)
    return {"a": [{label: (x, sign)} for x in a], "b": [{label: (x, sign)} for x in b]}


def test_a_drifting_machine_is_no_change_when_each_round_matches() -> None:
    """The machine slows down round by round; B equals A within every round."""
    drift = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0]
    (row,) = ab.compare(runs_of(drift, drift), threshold=0.03)
    assert row["paired_b_better_by"] == 0.0 and row["paired_spread"] == 0.0
    assert not row["worse"]


def test_a_loss_in_every_round_is_flagged_and_a_gain_is_not() -> None:
    a = [10.0, 11.0, 9.0, 10.5, 9.5]
    (slower,) = ab.compare(runs_of(a, [x * 0.9 for x in a]), threshold=0.03)
    assert abs(slower["paired_b_better_by"] + 0.1) < 1e-9 and slower["worse"]
    (faster,) = ab.compare(runs_of(a, [x * 1.1 for x in a]), threshold=0.03)
    assert abs(faster["paired_b_better_by"] - 0.1) < 1e-9 and not faster["worse"]


def test_seconds_are_better_lower_and_limits_are_never_flagged() -> None:
    a = [2.0, 2.0, 2.0, 2.0]
    (row,) = ab.compare(runs_of(a, [2.2] * 4, "load_s"), threshold=0.03)
    assert row["worse"] and row["paired_b_better_by"] < 0
    assert ab.figures({"results": [{"tokens": 8, "load_s": 1.0}]}) == {
        "results[tokens=8]/load_s": (1.0, -1)
    }
    (limit,) = ab.compare(runs_of([20.0] * 4, [10.0] * 4, "memcpy_gbps"), threshold=0.03)
    assert limit["limit"] and not limit["worse"]
