"""The vLLM connector's DRAM load without vLLM: does an OpenMP region just before it slow it?

The connector's store over 8 CPU tensors in vLLM's layout (``[num_blocks, 8 KV heads, 32
tokens, 128]`` bf16, the ``vllm_ttft`` model's), random bytes; the full blocks of a 1k, 4k and
8k-token prompt are saved once, then looked up and loaded into other blocks, timed (medians).
Cases: a quiet process; right after a torch matmul on 2 OpenMP threads (whose workers spin
after it, as they do after each op of a vLLM step); the same with the copy on the caller's
OpenMP team (``tpusync._src.memory.openmp_team``, as the connector loads by default); and each
with the copy engine on one thread (``TPUSYNC_COPY_THREADS=1``, in a child process). Beside
each size: the memory limit (one contiguous streaming copy on all cores) of the same bytes,
measured in the same run.

    .venv-vllm/bin/python benchmarks/vllm_load_contention.py [--repeats 15] [--json FILE]

Needs torch (the vLLM environment has it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time

BLOCK = 32
LAYERS = 8
TOKENS = (1024, 4096, 8192)
CASES = ("quiet", "after OpenMP", "after OpenMP, on its team")


def _measure(repeats: int) -> dict[str, dict[str, float]]:
    """GB/s of each case and the bytes loaded, by prompt size."""
    import torch

    from tpusync._src.bench.common import median
    from tpusync._src.memory.openmp_team import openmp_team
    from tpusync._src.memory.torch_tensors import TorchPool, prefault_cpu_tensors
    from tpusync.kv import KVCacheStore, KVStoreConfig

    num_blocks = 2 * max(TOKENS) // BLOCK + 16
    buffer = torch.empty((LAYERS, num_blocks, 8, BLOCK, 128), dtype=torch.bfloat16)
    layers = {f"layer.{i}": buffer[i] for i in range(LAYERS)}
    prefault_cpu_tensors(layers.values())
    buffer.view(torch.int16).random_()
    config = KVStoreConfig.from_dict(
        {"dram": {"capacity_blocks": num_blocks}, "block_size": BLOCK, "model_id": "bench",
         "block_axis": 0, "token_axis": 2}
    )  # fmt: skip
    torch.set_num_threads(2)
    matrix = torch.randn(256, 256)
    out: dict[str, dict[str, float]] = {}
    with KVCacheStore(config, [TorchPool(t, name=n) for n, t in layers.items()]) as store:
        for tokens in TOKENS:
            n = (tokens - 1) // BLOCK
            hashes = [hashlib.sha256(f"{tokens}/{i}".encode()).digest() for i in range(n)]
            store.save_engine_blocks_async(hashes, list(range(n))).result()
            for case in CASES:
                times = []
                for _ in range(repeats):
                    if case != "quiet":
                        float((matrix @ matrix).sum())
                    found = store.lookup_engine_blocks(hashes)
                    with openmp_team() if case.endswith("team") else contextlib.nullcontext():
                        start = time.perf_counter()
                        done = store.load(found, list(range(n, 2 * n)))
                        times.append(time.perf_counter() - start)
                    if done.loaded_blocks != n:
                        raise SystemExit(f"{tokens} tokens: {done.loaded_blocks} of {n} loaded")
                loaded = n * store.layout.payload_bytes
                out.setdefault(str(tokens), {"loaded_bytes": loaded})[case] = loaded / median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.repeats)))
        return 0
    from tpusync._src.bench.common import Run, print_table
    from tpusync._src.memory.copy_limit import MemoryLimit

    run = Run("vllm_load_contention")
    rates = {}
    for threads in ("default", "1"):
        env = dict(os.environ)
        if threads == "1":
            env["TPUSYNC_COPY_THREADS"] = "1"
        child = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
        done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            sys.exit(f"vllm_load_contention: the measuring child failed:\n{done.stderr}")
        rates[threads] = json.loads(done.stdout.strip().splitlines()[-1])
    rows, results = [], []
    for tokens in TOKENS:
        loaded = int(rates["default"][str(tokens)]["loaded_bytes"])
        limit = MemoryLimit(loaded)
        limit.sample(repeats=7)
        gbps = limit.result().gbps
        limit.close()
        record = {"tokens": tokens, "loaded_bytes": loaded, "limit_gbps": gbps}
        for threads, by_size in rates.items():
            for case in CASES:
                rate = by_size[str(tokens)][case]
                name = f"{case}, copy threads {threads}"
                record[name] = rate / 1e9
                rows.append([tokens, name, rate / 1e9, rate / 1e9 / gbps])
        results.append(record)
    print_table(["tokens", "load", "GB/s", "x limit"], rows)
    run.write(args.json, {"repeats": args.repeats, "block_size": BLOCK, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
