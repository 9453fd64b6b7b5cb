"""``tpusync bench [transfer|tiers|prefix|network|mac_cost|weights|vllm_ttft|vllm_disagg|
sglang_hicache|all] [--quick] [--json] [--plot DIR]`` (``vllm_ttft`` and ``vllm_disagg`` where
vLLM is installed, ``sglang_hicache`` where SGLang is):
runs the benchmarks against their physical limits, writes each result in the scheme
``<results>/<bench>/<commit>-<machine>.json`` and regenerates ``RESULTS.md`` beside them.
Without a name it lists the benchmarks and how long each takes, and runs none."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tpusync._src.bench import mac_cost, network, prefix, tiers, transfer, weights
from tpusync._src.bench.common import default_results_dir, result_path
from tpusync._src.bench.external import PEERS, default_peers_dir, peer_state
from tpusync._src.bench.network_procs import jax_transfer
from tpusync._src.bench.plot import INSTALL_HINT, have_matplotlib, plot_results
from tpusync._src.bench.results import write_results_md
from tpusync._src.cli_common import RUNTIME_ERROR, USAGE_ERROR, DefaultsHelpFormatter

__all__ = ["ABOUT", "BENCHES", "NEEDS", "have_sglang", "have_vllm", "main", "peers"]

# name -> (entry point taking argv, the --quick arguments, which shared flags it takes)
BENCHES: dict[str, tuple[Callable[[Sequence[str]], int], list[str], tuple[str, ...]]] = {
    "transfer": (transfer.main, transfer.QUICK, ("--total-mib", "--repeats", "--peers-dir")),
    "tiers": (tiers.main, tiers.QUICK, ("--total-mib", "--repeats")),
    "prefix": (prefix.main, prefix.QUICK, ("--repeats",)),
    "network": (network.main, network.QUICK, ("--total-mib", "--repeats", "--peers-dir")),
    "mac_cost": (mac_cost.main, mac_cost.QUICK, ("--total-mib", "--repeats")),
    "weights": (weights.main, weights.QUICK, ("--repeats",)),
}


# What each benchmark measures, and how long a full run of it took on a 2-core CPU VM (the
# records' date and time in benchmarks/results; --quick runs all of them in about 10 minutes).
ABOUT: dict[str, tuple[str, str]] = {
    "transfer": ("device <-> host GB/s of transfer() vs the memory limit and pure JAX", "3 min"),
    "tiers": ("DRAM, disk and shared-FS tier GB/s vs the memory limit and fio", "6 min"),
    "prefix": ("TTFT cold vs warm with the KV store, load GB/s vs the memory limit", "1-2 min"),
    "network": ("data-plane GB/s between processes vs the TCP limit; registry lookups", "4-5 min"),
    "mac_cost": ("what a keyed MAC of every block costs, DRAM and shared FS", "under 1 min"),
    "weights": ("RL weight sync: publish ~1.4 GiB, pull it on two meshes", "2-3 min"),
    "vllm_ttft": ("vLLM's TTFT served from tpusync's DRAM tier", "4-9 min"),
    "vllm_disagg": ("vLLM disaggregated prefill -> decode through a store node", "4-17 min"),
    "sglang_hicache": ("SGLang HiCache storage round trips through tpusync's backend", "1 min"),
}
# the benchmarks that run only where an engine is installed beside tpusync
NEEDS = {"vllm_ttft": "vLLM", "vllm_disagg": "vLLM", "sglang_hicache": "SGLang"}


def have_vllm() -> bool:
    """Whether vLLM is installed (a directory named vllm on the path, e.g. tests/vllm, is a
    namespace package without an origin: not vLLM)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


if have_vllm():  # the vLLM environment (.venv-vllm)
    from tpusync._src.bench import vllm_disagg, vllm_ttft

    BENCHES["vllm_ttft"] = (vllm_ttft.main, vllm_ttft.QUICK, ("--repeats",))
    BENCHES["vllm_disagg"] = (vllm_disagg.main, vllm_disagg.QUICK, ("--repeats",))


def have_sglang() -> bool:
    """Whether SGLang is installed (a directory named sglang on the path, e.g. tests/sglang, is
    a namespace package without an origin: not SGLang)."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin is not None


if have_sglang():  # the SGLang environment (.venv-sglang)
    from tpusync._src.bench import sglang_hicache

    BENCHES["sglang_hicache"] = (sglang_hicache.main, sglang_hicache.QUICK, ("--repeats",))


def peers(peers_dir: str | Path | None = None) -> dict[str, str]:
    """Each peer a benchmark compares with: "runs" or why it is skipped."""
    redis_ok = importlib.util.find_spec("redis") is not None and shutil.which("redis-server")
    found = {
        "pure-JAX engine (transfer, tiers)": "runs",
        "jax.experimental.transfer (network)": "runs"
        if jax_transfer is not None
        else "skipped: this jax has no jax.experimental.transfer",
        "Redis (registry lookups)": "runs"
        if redis_ok
        else "skipped: needs redis-server and the redis package (tpusync[cluster])",
    }
    for key, peer in PEERS.items():
        found[peer.title] = peer_state(key, peers_dir)
    found["vLLM's prefix cache and ExampleConnector (vllm_ttft)"] = (
        "runs" if have_vllm() else "skipped: needs vLLM installed beside tpusync"
    )
    found["LMCache (vllm_ttft)"] = "skipped: its vLLM connector needs CUDA"
    found["SGLang's file backend (sglang_hicache)"] = (
        "runs" if have_sglang() else "skipped: needs SGLang installed beside tpusync"
    )
    found["SGLang's shm backend (sglang_hicache)"] = "skipped: stores nothing in SGLang 0.5.23"
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpusync bench",
        description="Benchmarks against their physical limits, measured in the same run.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "bench",
        nargs="?",
        choices=[*BENCHES, "all"],
        help="the benchmark to run, or all of them; without one: the list, with durations",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repeats (minutes, not hours)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the results as JSON (tables go to stderr)"
    )
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts to DIR (needs matplotlib)")
    parser.add_argument(
        "--results-dir",
        metavar="DIR",
        default=str(default_results_dir()),
        help="where results and RESULTS.md go",
    )
    parser.add_argument("--total-mib", type=int, help="bytes per operation (not prefix)")
    parser.add_argument("--repeats", type=int, help="rounds per figure")
    parser.add_argument(
        "--peers-dir",
        metavar="DIR",
        default=str(default_peers_dir()),
        help="the peers' environments, made by benchmarks/peers/setup.sh of a source checkout",
    )
    return parser


def _argv(name: str, args: argparse.Namespace, target: Path) -> list[str]:
    _, quick, shared = BENCHES[name]
    argv = list(quick) if args.quick else []
    for flag in shared:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]  # argparse: the last one given wins
    return [*argv, "--json", str(target)]


def _run(name: str, args: argparse.Namespace, results_dir: Path) -> dict[str, Any]:
    entry = BENCHES[name][0]
    target = result_path(name, results_dir)
    print(f"== tpusync bench {name}", flush=True)
    code = entry(_argv(name, args, target))
    if code:
        raise RuntimeError(f"{name} exited with {code}")
    record = json.loads(target.read_text())
    record["peers"] = peers(args.peers_dir)
    target.write_text(json.dumps(record, indent=2))
    return record


def _print_list() -> None:
    print("tpusync bench NAME [--quick] [--plot DIR] runs one benchmark; `all` runs every one.")
    print("A full run of each took (2-core CPU VM; --quick: about 10 minutes for all):\n")
    width = max(map(len, ABOUT))
    for name, (what, duration) in ABOUT.items():
        missing = "" if name in BENCHES else f" [needs {NEEDS[name]} installed beside tpusync]"
        print(f"  {name:<{width}}  {duration:>11}  {what}{missing}")
    print(f"\nresults go to {default_results_dir()} (--results-dir)")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``tpusync bench``; returns its exit code (0 done, 2 usage, 1 a benchmark failed)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.bench is None:  # asked what there is: hours of benchmarks are never a default
        _print_list()
        return 0
    for flag in ("total_mib", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected a positive number, got {value}")
    if args.plot and not have_matplotlib():
        parser.error(f"--plot: needs matplotlib, which is not installed: `{INSTALL_HINT}`")
    results_dir = Path(args.results_dir)
    names = list(BENCHES) if args.bench == "all" else [args.bench]
    records: dict[str, Any] = {}
    out = sys.stderr if args.json else sys.stdout
    status = 0
    with contextlib.redirect_stdout(out):
        for name in names:
            try:
                records[name] = _run(name, args, results_dir)
            except (Exception, SystemExit) as exc:  # one failed benchmark: the others still run
                print(f"tpusync bench {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                status = RUNTIME_ERROR if not isinstance(exc, SystemExit) else USAGE_ERROR
        print("\npeers")
        for peer, state in peers(args.peers_dir).items():
            print(f"  {peer}: {state}")
        if args.plot:
            for name, record in records.items():
                for path in plot_results(name, record, args.plot):
                    print(f"wrote {path}")
        if results_dir.is_dir():  # not where every benchmark failed before writing any
            print(f"wrote {write_results_md(results_dir)}", flush=True)
    if args.json:
        print(json.dumps(records, indent=2))
    return status
