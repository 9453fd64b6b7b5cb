"""`tpusync demo`: prefix caching end to end — a long prompt cold, then warm from every tier.

Embedded defaults, CPU, no servers; temporary directories and the /dev/shm pool are removed
after. A small JAX transformer with a paged KV cache (``tpusync.testing``) serves one long prompt
cold and saves its KV; then the same prompt is served warm from DRAM, from local disk, from a
shared-filesystem directory and from a store node (a `tpusync serve` process lending its DRAM,
written through over TCP); a decode process that knows only the registry's address pulls the
prefix from this one over TCP (disaggregated prefill -> decode); an agent session is paused (its
KV offloaded) and resumed into other blocks; finally a new process attaches to the /dev/shm pool
the first one left and serves the prompt from it. Compilation is excluded on both sides (a
throwaway request of the same shapes runs first; JAX's persistent compilation cache makes later
runs start faster). Every warm output is compared with the cold one: greedy tokens equal, logits
equal bit for bit.

    tpusync demo [--tokens 8192] [--new-tokens 8] [--plot ttft.png] [--shm-dir DIR] [--json]
                 [--transfer]

``--json`` prints the results as one JSON object on stdout (the progress lines go to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpusync._src.cli_common import DefaultsHelpFormatter, have_matplotlib, int_at_least
from tpusync._src.cluster import serving
from tpusync._src.cluster.dataplane import BlockServer
from tpusync._src.cluster.registry import NodeInfo, RemoteRegistry
from tpusync._src.cluster.tier_specs import RegistryTier, StoreNodeTier
from tpusync._src.demo_transfer import main as transfer_main
from tpusync._src.demo_transfer import memory_limit
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.tier_specs import DiskTier, DramTier, SharedFsTier
from tpusync._src.testing import model as M
from tpusync._src.testing.engine import ToyEngine
from tpusync._src.testing.model import init_kv_pools
from tpusync._src.testing.processes import run_json_child, start_store_node, stop_process
from tpusync._src.tiers.dram import pool_path, sessions_path
from tpusync._src.tiers.layout import PoolLayout

MODEL_ID = "tpusync-demo-model"
PLOT_HINT = "pip install 'tpusync[demo]'"  # the extra that brings matplotlib
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpusync" / "jax"


@dataclass
class Row:
    scenario: str
    tier: str
    ttft_s: float
    reused_tokens: int
    loaded_bytes: int
    load_gbps: float | None
    matches: bool | None  # None: the reference itself


def _setup_jax(cache_dir: str | None) -> None:
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _model_config(tokens: int, new_tokens: int) -> Any:
    # 8 KV heads of 32: a block is 16 tokens x 16 KiB per (layer, K/V) array, 128 KiB in all.
    base = M.ModelConfig(n_kv_heads=8, head_dim=32)
    per_seq = M.blocks_needed(base, tokens + 2 * new_tokens + base.block_size)
    return M.ModelConfig(
        n_kv_heads=8,
        head_dim=32,
        max_blocks_per_seq=per_seq,
        num_blocks=2 * per_seq + 16,
    )


def _store_config(
    blocks: int,
    shm_name: str | None,
    shm_dir: str,
    disk: Path | None,
    shared: Path | None,
    block_size: int,
    extra_tiers: tuple[Any, ...] = (),
) -> Any:
    tiers: list[Any] = []
    if disk:
        tiers.append(DiskTier(disk, capacity_blocks=2 * blocks + 16, create=True))
    if shared:
        tiers.append(SharedFsTier(shared, create=True))
    return KVStoreConfig(
        model_id=MODEL_ID,
        block_size=block_size,
        dram=DramTier(capacity_blocks=2 * blocks + 16, name=shm_name, shm_dir=shm_dir),
        tiers=(*tiers, *extra_tiers),
    )


def _digest(logits: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(logits).tobytes(), digest_size=16).hexdigest()


def _prompt(tokens: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, tokens).astype(np.int32)


def _load_row(scenario: str, request: Any, cold: Any) -> Row:
    load = request.load
    return Row(
        scenario,
        request.lookup_tiers[0] if request.lookup_tiers else "-",
        request.ttft_s,
        request.cached_tokens,
        load.bytes if load else 0,
        load.gbps if load else None,
        bool(
            np.array_equal(request.tokens, cold.tokens)
            and np.array_equal(request.prefill_logits, cold.prefill_logits)
        ),
    )


def run(
    tokens: int,
    new_tokens: int,
    cache_dir: str | None,
    plot: str | None,
    seed: int = 0,
    results: dict[str, Any] | None = None,
    shm_dir: str = "/dev/shm",
) -> bool:
    """Runs the demo, prints its table, returns whether every output matched; fills
    ``results`` (when given) with the table's rows and the memory limit, for ``--json``. The
    named DRAM pool lives in ``shm_dir`` and is removed at the end."""
    _setup_jax(cache_dir)
    config = _model_config(tokens, new_tokens)
    blocks = -(-tokens // config.block_size)
    work = Path(tempfile.mkdtemp(prefix="tpusync-demo-"))
    shm_name = f"demo-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    rows: list[Row] = []
    ok = True
    secret = secrets.token_bytes(32)
    node_process = None
    try:
        layout = PoolLayout.from_pools(MODEL_ID, init_kv_pools(config))
        print("starting a store node (`tpusync serve`, hosting the registry) ...")
        # at least the 1 MiB a store node lends, for the shortest prompts
        lent = max(2 * blocks * layout.slot_bytes, 1 << 20)
        node_process, node = start_store_node(work, secret, lent)
        node_tier = StoreNodeTier(node["address"], secret=secret)  # each store opens its own
        store_config = _store_config(
            blocks,
            shm_name,
            shm_dir,
            work / "disk",
            work / "shared",
            config.block_size,
            (node_tier,),
        )
        engine = ToyEngine(config, store_config)
        kv_mib = blocks * engine.block_bytes() / 2**20
        print(
            f"model: {config.n_layers} layers, {config.n_kv_heads} KV heads of {config.head_dim}, "
            f"block {config.block_size} tokens = {engine.block_bytes() // 1024} KiB of KV; "
            f"prompt {tokens} tokens = {kv_mib:.0f} MiB of KV"
        )
        print(f"tiers: DRAM in {shm_dir} (named), local disk, shared FS under", work)
        print(f"       and the store node's DRAM at {node['address']} (written through over TCP)")
        print("compiling (a throwaway request of the same shapes; excluded from TTFT) ...")
        start = time.perf_counter()
        engine.warmup(tokens, new_tokens, cold=True)
        print(f"  {time.perf_counter() - start:.1f} s")
        prompt = _prompt(tokens, config.vocab_size, seed)
        print("cold prefill, then save ...")
        cold = engine.generate(prompt, new_tokens, use_cache=False, boundary=tokens - 1)
        engine.store.flush()
        rows.append(Row("cold prefill", "-", cold.ttft_s, 0, 0, None, None))

        print("warm requests ...")
        rows.append(_load_row("warm, full hit", engine.generate(prompt, new_tokens), cold))
        engine.store.evict(prompt, tier="dram")
        rows.append(_load_row("warm, DRAM evicted", engine.generate(prompt, new_tokens), cold))
        engine.store.evict(prompt, tier="dram")
        engine.store.evict(prompt, tier="disk")
        rows.append(_load_row("warm, DRAM+disk evicted", engine.generate(prompt, new_tokens), cold))
        for tier in ("dram", "disk", "shared_fs"):
            engine.store.evict(prompt, tier=tier)
        rows.append(
            _load_row("warm, only on store node", engine.generate(prompt, new_tokens), cold)
        )

        print("disaggregated: a decode process given only the registry address ...")
        registry = RemoteRegistry(node["registry"], secret=secret)
        with BlockServer(engine.store.dram, secret=secret) as server:
            serving.publish_to(engine.store, registry, NodeInfo("demo-prefill", (server.address,)))
            engine.store.flush()
            decode = _run_child(
                tokens,
                new_tokens,
                cache_dir,
                None,
                shm_dir,
                prompt_seed=seed,
                model=config,
                blocks=blocks,
                registry=node["registry"],
                secret=secret,
            )
        rows.append(_child_row("decode process, over TCP", decode, cold))

        print("agent session: pause after the first tokens, resume in other blocks ...")
        whole = engine.generate(prompt, 2 * new_tokens, save=False)
        first = engine.generate(prompt, new_tokens, keep_blocks=True, save=False)
        engine.pause("agent-1", first)
        resumed = engine.resume("agent-1", int(first.tokens[-1]), new_tokens)
        rows.append(
            Row(
                "agent resume",
                "session",
                resumed.ttft_s,
                resumed.cached_tokens,
                len(first.kv_tokens) * engine.block_bytes() // config.block_size,
                None,
                bool(np.array_equal(np.concatenate([first.tokens, resumed.tokens]), whole.tokens)),
            )
        )
        stats = engine.store.stats()
        engine.close()  # the named pool stays in /dev/shm for the next process
        registry.close()

        print(f"restart: a new process attaches to the pool in {shm_dir} ...")
        child = _run_child(
            tokens,
            new_tokens,
            cache_dir,
            shm_name,
            shm_dir,
            prompt_seed=seed,
            model=config,
            blocks=blocks,
        )
        rows.append(_child_row("new process, /dev/shm", child, cold))
        limit, method = memory_limit(int(kv_mib * 2**20), 5)
        ok = all(r.matches is not False for r in rows)
        _print_table(rows, limit, method, tokens)
        _print_stats(stats)
        if results is not None:
            results.update(
                prompt_tokens=tokens,
                memory_limit_gbps=limit,
                memory_limit_method=method,
                rows=[dataclasses.asdict(r) for r in rows],
                stats=stats,
            )
        if plot:
            _plot(rows, plot, tokens)
    finally:
        if node_process is not None:
            stop_process(node_process)
        shutil.rmtree(work, ignore_errors=True)
        pool_path(shm_name, shm_dir).unlink(missing_ok=True)
        shutil.rmtree(sessions_path(shm_name, shm_dir), ignore_errors=True)
    return ok


def _child_row(scenario: str, child: dict[str, Any], cold: Any) -> Row:
    return Row(
        scenario,
        child["tier"],
        child["ttft_s"],
        child["cached_tokens"],
        child["loaded_bytes"],
        child["load_gbps"],
        child["tokens"] == cold.tokens.tolist() and child["logits"] == _digest(cold.prefill_logits),
    )


def _run_child(
    tokens: int,
    new_tokens: int,
    cache_dir: str | None,
    shm_name: str | None,
    shm_dir: str,
    *,
    prompt_seed: int,
    model: Any,
    blocks: int,
    registry: str | None = None,
    secret: bytes | None = None,
) -> dict[str, Any]:
    spec = {
        "tokens": tokens,
        "new_tokens": new_tokens,
        "cache_dir": cache_dir,
        "shm_name": shm_name,
        "shm_dir": shm_dir,
        "seed": prompt_seed,
        "registry": registry,
        "secret": None if secret is None else secret.hex(),
    }
    return run_json_child("tpusync._src.demo", spec)


def _child(spec: dict[str, Any]) -> None:
    """The restarted server (attaches to the named pool) or the decode process (finds the
    prefix through the registry): warms up, serves the prompt."""
    _setup_jax(spec["cache_dir"])
    tokens, new_tokens = spec["tokens"], spec["new_tokens"]
    config = _model_config(tokens, new_tokens)
    blocks = -(-tokens // config.block_size)
    extra: tuple[Any, ...] = ()
    closers: list[Any] = []
    if spec.get("registry"):
        secret = bytes.fromhex(spec["secret"])
        registry = RemoteRegistry(spec["registry"], secret=secret)
        extra = (RegistryTier(registry, secret=secret, exclude="demo-decode"),)
        closers = [registry]  # the store closes the tier it opened
    store_config = _store_config(
        blocks, spec["shm_name"], spec["shm_dir"], None, None, config.block_size, extra
    )
    engine = ToyEngine(config, store_config)
    engine.warmup(tokens, new_tokens, cold=False)
    request = engine.generate(_prompt(tokens, config.vocab_size, spec["seed"]), new_tokens)
    engine.close()
    for closer in closers:
        closer.close()
    load = request.load
    print(
        json.dumps(
            {
                "tier": request.lookup_tiers[0] if request.lookup_tiers else "-",
                "ttft_s": request.ttft_s,
                "cached_tokens": request.cached_tokens,
                "loaded_bytes": load.bytes if load else 0,
                "load_gbps": load.gbps if load else None,
                "tokens": request.tokens.tolist(),
                "logits": _digest(request.prefill_logits),
                "attach_ms": engine.store.dram.attach_seconds * 1e3 if spec["shm_name"] else 0,
            }
        )
    )


def _print_table(rows: list[Row], limit: float, method: str, tokens: int) -> None:
    cold = rows[0].ttft_s
    print(f"\nTime to first token, {tokens}-token prompt (compilation excluded on both sides)")
    header = (
        f"{'scenario':<26}{'served from':<13}{'TTFT ms':>10}{'vs cold':>9}{'reused':>8}"
        f"{'KV MiB':>8}{'load GB/s':>11}  output"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        change = "" if r is rows[0] else f"{(r.ttft_s / cold - 1) * 100:+.1f}%"
        gbps = f"{r.load_gbps:.2f}" if r.load_gbps else "-"
        match = "reference" if r.matches is None else ("equal" if r.matches else "DIFFERENT")
        print(
            f"{r.scenario:<26}{r.tier:<13}{r.ttft_s * 1e3:>10.1f}{change:>9}{r.reused_tokens:>8}"
            f"{r.loaded_bytes / 2**20:>8.1f}{gbps:>11}  {match}"
        )
    print(f"memory limit (one contiguous copy of as many bytes on all cores, best: {method}): "
          f"{limit:.2f} GB/s")  # fmt: skip
    print("'equal': greedy tokens equal and the first token's logits equal bit for bit")


def _print_stats(stats: dict[str, Any]) -> None:
    store = stats["store"]
    print(
        f"store: {store['hit_blocks']} blocks hit, {store['saved_blocks']} saved, "
        f"{store['demotions']} demoted, {store['promotions']} promoted, "
        f"{store['writeback_written']} written back"
    )
    for name, tier in stats["tiers"].items():
        print(
            f"  {name:<10} hits {tier['hits']:>5}  misses {tier['misses']:>4}  checksum failures "
            f"{tier['checksum_failures']}  used {tier['used']}"
        )


def ttft_figure(rows: list[Row], tokens: int) -> Any:
    """The TTFT bars of ``rows`` as a matplotlib figure (Agg): one horizontal bar per scenario,
    its label on a line of its own (labels under vertical bars ran into each other), the cold
    reference first. Raises ImportError without matplotlib (``main`` checks before the run).
    A Figure of its own, outside pyplot's global state: nothing to close, no GUI backend."""
    from matplotlib.figure import Figure  # optional heavy dependency (tpusync[demo]): --plot

    figure = Figure(figsize=(8, 1.2 + 0.4 * len(rows)))
    axis = figure.subplots()
    names = [f"{r.scenario} ({r.tier})" if r.tier != "-" else r.scenario for r in rows]
    bars = axis.barh(
        names, [r.ttft_s * 1e3 for r in rows], color=["#888"] + ["#2a7"] * (len(rows) - 1)
    )
    axis.invert_yaxis()  # in the table's order, top to bottom
    axis.set_xscale("log")
    axis.set_xlabel("time to first token (ms, log)")
    axis.set_title(f"tpusync prefix cache: {tokens}-token prompt, CPU")
    axis.bar_label(bars, fmt="%.0f", padding=3)
    axis.margins(x=0.15)  # room for the value after the longest bar
    figure.tight_layout()
    return figure


def _plot(rows: list[Row], path: str, tokens: int) -> None:
    ttft_figure(rows, tokens).savefig(path, dpi=120)
    print(f"plot written to {path}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpusync demo",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--tokens", type=int_at_least(32), default=8192, help="prompt length")
    parser.add_argument(
        "--new-tokens", type=int_at_least(1), default=8, help="tokens generated per request"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the TTFT bars (matplotlib)")
    parser.add_argument(
        "--shm-dir",
        default="/dev/shm",
        help="where the named DRAM pool lives (a tmpfs; removed at the end)",
    )
    parser.add_argument(
        "--compile-cache",
        default=str(DEFAULT_CACHE),
        help="JAX persistent compilation cache directory ('' to disable)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the results as JSON (progress to stderr)"
    )
    parser.add_argument(
        "--transfer",
        action="store_true",
        help="run the transfer demo instead (GB/s table; `--transfer --help` lists its options)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--transfer" in argv:  # its own options, and its own --help
        return transfer_main([a for a in argv if a != "--transfer"])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        parser.error(f"--plot: {Path(args.plot).parent} is not a directory")
    if args.plot and not have_matplotlib():  # before minutes of demo, not after
        parser.error(f"--plot: needs matplotlib, which is not installed: `{PLOT_HINT}`")
    if not Path(args.shm_dir).is_dir():
        parser.error(f"--shm-dir: {args.shm_dir} is not a directory")
    start = time.perf_counter()
    results: dict[str, Any] = {}
    # with --json, stdout carries only the JSON: the progress and the table go to stderr
    progress = sys.stderr if args.json else sys.stdout
    with contextlib.redirect_stdout(progress):
        ok = run(
            args.tokens,
            args.new_tokens,
            args.compile_cache or None,
            args.plot,
            0,
            results,
            args.shm_dir,
        )
        print(f"demo finished in {time.perf_counter() - start:.0f} s")
        print("all outputs equal" if ok else "MISMATCH: some outputs differ")
    if args.json:
        print(json.dumps({"ok": ok, **results, "elapsed_s": time.perf_counter() - start}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
