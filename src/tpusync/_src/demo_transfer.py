"""`tpusync demo --transfer`: offload scattered KV blocks of a paged cache to host memory and back.

Embedded defaults, CPU, no servers: builds a paged KV cache (per layer, K and V apart), saves a
scattered set of blocks to a host pool of slots with one ``transfer_batch``, loads them back into
other blocks, on the native and the pure-JAX path, checks every bit, and prints a table beside the
machine's memory-copy rate measured in the same run. ``--json`` prints the table as one JSON
object on stdout (the rest goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from tpusync._src.cli_common import DefaultsHelpFormatter, int_at_least
from tpusync._src.info import info
from tpusync._src.memory.copy_limit import memory_limit_gbps
from tpusync._src.memory.device_pool import DevicePool
from tpusync._src.memory.host_buffer import HostBuffer
from tpusync._src.transfer import Transfer, transfer_batch


@dataclass
class DemoConfig:
    layers: int = 4
    num_blocks: int = 1024
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    blocks_moved: int = 384
    repeats: int = 5
    seed: int = 0


def memory_limit(nbytes: int, repeats: int) -> tuple[float, str]:
    """The memory-copy limit for ``nbytes`` (GB/s) and the method that gave it."""
    found = memory_limit_gbps(nbytes, repeats)
    return found.gbps, found.method


def run(config: DemoConfig, results: dict[str, Any] | None = None) -> bool:
    """Runs the demo, prints its table, returns whether every bit matched; fills ``results``
    (when given) with the table's rows and the memory limit, for ``--json``."""
    print(info())
    rng = np.random.default_rng(config.seed)
    block_shape = (config.block_size, config.kv_heads, config.head_dim)
    shape = (config.num_blocks, *block_shape)
    dtype = np.dtype(config.dtype)
    bits = np.dtype(f"uint{dtype.itemsize * 8}")
    originals = [
        rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits, endpoint=True).view(dtype)
        for _ in range(2 * config.layers)
    ]
    # A host pool of slots: each slot holds one block of every (layer, K/V) array, so one slot
    # is one cached token block of the whole model.
    slots = HostBuffer((config.blocks_moved, 2 * config.layers, *block_shape), dtype)
    # Blocks saved and the blocks they are loaded into are disjoint, so every repeat moves the
    # same bytes and the final check can compare against the original arrays.
    shuffled = rng.permutation(config.num_blocks)
    chosen = shuffled[: config.blocks_moved]
    targets = shuffled[config.blocks_moved : 2 * config.blocks_moved]
    slot_ids = np.arange(config.blocks_moved)
    nbytes = 0
    rows = []
    all_match = True
    for path in ("native", "jax"):
        pools = [DevicePool(jax.device_put(a, may_alias=False)) for a in originals]
        save = [Transfer(p, slots.array[:, i], chosen, slot_ids) for i, p in enumerate(pools)]
        load = [Transfer(slots.array[:, i], p, slot_ids, targets) for i, p in enumerate(pools)]
        timings: dict[str, list[float]] = {"save (device->host)": [], "load (host->device)": []}
        for repeat in range(config.repeats + 1):
            start = time.perf_counter()
            nbytes = transfer_batch(save, path=path).result(timeout=120)
            saved = time.perf_counter() - start
            start = time.perf_counter()
            transfer_batch(load, path=path).result(timeout=120)
            loaded = time.perf_counter() - start
            if repeat:  # the first round compiles and warms up
                timings["save (device->host)"].append(saved)
                timings["load (host->device)"].append(loaded)
        match = all(
            np.array_equal(np.asarray(p.array)[targets].view(bits), originals[i][chosen].view(bits))
            for i, p in enumerate(pools)
        )
        all_match &= match
        for name, values in timings.items():
            seconds = statistics.median(values)
            rows.append((name, path, nbytes, seconds, match))
    limit, method = memory_limit(nbytes, config.repeats)
    print(
        f"\n{config.layers} layers x K,V; {config.blocks_moved} of {config.num_blocks} blocks of "
        f"{block_shape} {dtype}, scattered; median of {config.repeats}"
    )
    header = f"{'direction':<22}{'path':<8}{'MiB':>8}{'ms':>9}{'GB/s':>8}{'x limit':>10}  bits"
    print(header)
    print("-" * len(header))
    for name, path, moved, seconds, match in rows:
        gbps = moved / seconds / 1e9
        print(
            f"{name:<22}{path:<8}{moved / 2**20:>8.1f}{seconds * 1e3:>9.2f}{gbps:>8.2f}"
            f"{gbps / limit:>10.2f}  {'equal' if match else 'DIFFERENT'}"
        )
    print(f"memory limit (one contiguous copy on all cores, best: {method}): {limit:.2f} GB/s")
    if results is not None:
        results.update(memory_limit_gbps=limit, memory_limit_method=method,
                       rows=[_row_dict(row, limit) for row in rows])  # fmt: skip
    return all_match


def _row_dict(row: tuple[str, str, int, float, bool], limit: float) -> dict[str, Any]:
    direction, path, moved, seconds, match = row
    gbps = moved / seconds / 1e9
    return {
        "direction": direction,
        "path": path,
        "bytes": moved,
        "seconds": seconds,
        "gbps": gbps,
        "x_limit": gbps / limit,
        "bits_equal": match,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpusync demo --transfer",
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--layers", type=int_at_least(1), default=DemoConfig.layers, help="model layers (K, V)"
    )
    parser.add_argument(
        "--repeats", type=int_at_least(1), default=DemoConfig.repeats, help="timed rounds"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the table as JSON (the rest to stderr)"
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        ok = run(DemoConfig(layers=args.layers, repeats=args.repeats), results)
        print("all bits equal" if ok else "MISMATCH: some bits differ")
    if args.json:
        print(json.dumps({"ok": ok, **results}))
    return 0 if ok else 1
