"""Two builds of tpusync, one benchmark, alternating runs: is B slower than A?

Each side is a directory holding ``site/`` (an unpacked wheel of that build, put first on
``PYTHONPATH``) and ``benchmarks/`` (that build's own benchmark scripts, so each side runs the
API it has). Rounds alternate the order (A B, B A, A B, ...) so that drift on a noisy machine
falls on both sides. Every figure a run's JSON holds (GB/s and per-second rates: higher is
better; seconds: lower is better) is collected per round; the table shows the median of the
rounds per side and B's change, and flags a figure of our code that is worse by more than the
threshold. Rounds are also compared in pairs (A and B of one round run back to back): the median
of the per-round changes cancels drift between rounds, and the spread of those changes (half
their interquartile range) is the noise a change must stand out of; the flag uses the paired
change. Figures of the limits measured beside ours (memcpy, fio, iperf3, raw disk) are shown
for context and never flagged.

    python benchmarks/ab.py --a /work/ab/before --b /work/ab/after --rounds 5 \\
        transfer -- --total-mib 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit_of, write_json

IDENTITY_FIELDS = ("tier", "block_kib", "block_mib", "tokens", "connections", "block_bytes")
LIMIT_MARKERS = (
    "limit",
    "fio",
    "iperf",
    "memcpy",
    "copyto",
    "raw_",
    "kv_bytes",
    "jax.experimental",
)


def direction(key: str) -> int:
    """+1 when a larger value is better, -1 when smaller is, 0 when the key is not a figure."""
    if key.endswith("_runs") or key in ("seconds", "repeats"):
        return 0
    if "gbps" in key or "per_s" in key:
        return 1
    if key.endswith("_s"):
        return -1
    return 0


def figures(tree: object, path: str = "", sign: int = 0) -> dict[str, tuple[float, int]]:
    """Every figure in a benchmark's JSON: ``{label: (value, direction)}``."""
    found: dict[str, tuple[float, int]] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in ("machine", "args", "notes", "targets", "seconds") or key.endswith("_runs"):
                continue
            here = direction(key) or sign
            label = f"{path}/{key}" if path else key
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and here:
                found[label] = (float(value), here)
            elif isinstance(value, (dict, list)):
                found.update(figures(value, label, here))
    elif isinstance(tree, list):
        for i, item in enumerate(tree):
            if isinstance(item, dict):
                ids = [f"{f}={item[f]}" for f in IDENTITY_FIELDS if f in item]
                label = f"{path}[{','.join(ids) or i}]"
                found.update(figures(item, label, sign))
    return found


def run_side(side: Path, bench: str, args: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tpusync-ab-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(side / "site")}
        command = [sys.executable, str(side / "benchmarks" / f"{bench}.py"), *args]
        command += ["--json", str(out)]
        done = subprocess.run(
            command, env=env, cwd=tmp, timeout=timeout_s, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"{side.name} {bench} failed ({done.returncode}):\n{done.stderr}")
        return json.loads(out.read_text())


def is_limit(label: str) -> bool:
    return any(marker in label for marker in LIMIT_MARKERS)


def compare(
    runs: dict[str, list[dict[str, tuple[float, int]]]], threshold: float
) -> list[dict[str, object]]:
    rows = []
    labels = [label for label in runs["a"][0] if all(label in r for r in runs["a"] + runs["b"])]
    for label in labels:
        sign = runs["a"][0][label][1]
        a = statistics.median(r[label][0] for r in runs["a"])
        b = statistics.median(r[label][0] for r in runs["b"])
        change = (b / a - 1.0) * sign if a else 0.0  # > 0: B is better
        pairs = [
            (rb[label][0] / ra[label][0] - 1.0) * sign
            for ra, rb in zip(runs["a"], runs["b"], strict=True)
            if ra[label][0]
        ]
        paired = statistics.median(pairs) if pairs else 0.0
        spread = 0.0
        if len(pairs) >= 4:
            quartiles = statistics.quantiles(pairs, n=4)
            spread = (quartiles[2] - quartiles[0]) / 2
        limit = is_limit(label)
        rows.append(
            {
                "figure": label,
                "a": a,
                "b": b,
                "b_better_by": change,
                "paired_b_better_by": paired,
                "paired_spread": spread,
                "limit": limit,
                "worse": (not limit) and paired < -threshold,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="the baseline side's directory")
    parser.add_argument("--b", type=Path, required=True, help="the candidate side's directory")
    parser.add_argument("--rounds", type=int, default=5, help="runs per side (median of these)")
    parser.add_argument("--threshold", type=float, default=0.05, help="worse by more is flagged")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per benchmark run")
    parser.add_argument("--json", default=None, help="where to write the comparison")
    parser.add_argument("bench", help="benchmark name, e.g. transfer, tiers, prefix_cache")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: its arguments")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    runs: dict[str, list[dict[str, tuple[float, int]]]] = {"a": [], "b": []}
    start = time.monotonic()
    for round_ in range(args.rounds):
        order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
        for side in order:
            result = run_side(getattr(args, side), args.bench, bench_args, args.timeout_s)
            runs[side].append(figures(result))
        print(f"round {round_ + 1}/{args.rounds} done ({time.monotonic() - start:.0f} s)")
    rows = compare(runs, args.threshold)
    print(f"\n{args.bench}: median of {args.rounds} alternating runs per side")
    print(f"{'figure':<56}{'A':>11}{'B':>11}{'B vs A':>9}{'paired':>9}{'+-':>7}")
    for row in rows:
        mark = "  WORSE" if row["worse"] else ("  (limit)" if row["limit"] else "")
        print(
            f"{row['figure'][:55]:<56}{row['a']:>11.4g}{row['b']:>11.4g}"
            f"{row['b_better_by']:>+9.1%}{row['paired_b_better_by']:>+9.1%}"
            f"{row['paired_spread']:>7.1%}{mark}"
        )
    worse = [r for r in rows if r["worse"]]
    print(
        f"{len(worse)} of {sum(not r['limit'] for r in rows)} figures worse by more than "
        f"{args.threshold:.0%} (paired)"
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": f"ab:{args.bench}",
                "a": str(args.a),
                "b": str(args.b),
                "a_commit": commit_of(args.a / "benchmarks"),
                "b_commit": commit_of(args.b / "benchmarks"),
                "rounds": args.rounds,
                "bench_args": bench_args,
                "threshold": args.threshold,
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
