"""A child process for tests/test_kv_model.py and tests/test_kv_reliability.py: a ToyEngine over
a KVCacheStore in a fresh process (a "restarted server").

    python tests/kv_child.py SPEC.json

SPEC (JSON)::

    {"model": {ModelConfig fields}, "store": {"model_id": ..., "dram": {DramTier fields},
     "disk": {DiskTier fields} | null, "shared_fs": {SharedFsTier fields} | null},
     "ops": [[op, {args}], ...], "exit": "close" | "abrupt"}

Ops (each appends one entry to the results):

* ``generate``: prompt, n_new, use_cache, save, boundary, keep_blocks, as (a name for pause) ->
  tokens, logits (hex of the float32 bytes), cached_tokens, lookup_tiers, loaded_tokens.
* ``pause``: session, request (the name given to a generate with keep_blocks) -> released.
* ``resume``: session, next_token, n_new -> the same fields as generate.
* ``sessions`` -> the offloaded session ids; ``stats`` -> store.stats().
* ``save_loop``: refs (an .npz written by the parent: ``p<i>`` holds prompt i's tokens and
  ``kv<i>`` its reference KV, shape (pools, blocks, *block)), seed. Prints ``ready`` and saves,
  loads and purges forever (the parent SIGKILLs it).

The results are printed as one line ``RESULT <json>``. ``exit: "close"`` closes the store (which
flushes write-back); ``"abrupt"`` leaves with ``os._exit(0)`` right after printing, closing
nothing (blocks in a named /dev/shm pool must survive that).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import numpy as np

import tpusync
from tpusync.kv import DiskTier, DramTier, KVStoreConfig, SharedFsTier
from tpusync.testing.engine import Request, ToyEngine
from tpusync.testing.model import ModelConfig


def store_config(spec: dict[str, Any]) -> KVStoreConfig:
    disk = spec.get("disk")
    shared = spec.get("shared_fs")
    return KVStoreConfig(
        model_id=spec["model_id"],
        block_size=spec["block_size"],
        dram=DramTier(**spec["dram"]),
        disk=DiskTier(**disk) if disk else None,
        shared_fs=SharedFsTier(**shared) if shared else None,
    )


def request_json(request: Request) -> dict[str, Any]:
    return {
        "tokens": request.tokens.astype(int).tolist(),
        "logits": np.asarray(request.prefill_logits, np.float32).tobytes().hex(),
        "cached_tokens": int(request.cached_tokens),
        "lookup_tiers": list(request.lookup_tiers),
        "loaded_tokens": None if request.load is None else int(request.load.loaded_tokens),
    }


def save_loop(engine: ToyEngine, refs_path: str, seed: int) -> None:
    """Saves (real model KV, from the parent's reference), loads and purges until killed."""
    store = engine.store
    assert store is not None
    refs = np.load(refs_path)
    prompts = [refs[f"p{i}"] for i in range(len(refs.files) // 2)]
    kvs = [refs[f"kv{i}"] for i in range(len(prompts))]
    rng = np.random.default_rng(seed)
    blocks = engine.allocate(max(kv.shape[1] for kv in kvs))
    print("ready", flush=True)
    step = 0
    while True:
        i = int(rng.integers(len(prompts)))
        n = kvs[i].shape[1]
        op = rng.random()
        if op < 0.6:
            for pool, kv in zip(engine.kv, kvs[i], strict=True):
                tpusync.transfer(kv, pool, dst_blocks=blocks[:n]).result()
            store.save(prompts[i], blocks[:n])
        else:
            hit = store.lookup(prompts[i])
            if hit.num_blocks:
                store.load(hit, blocks[: hit.num_blocks])
            else:
                store.release(hit)
        step += 1
        if step % 25 == 0:
            store.purge()  # everything is written afresh, again and again


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    config = ModelConfig(**spec["model"])
    engine = ToyEngine(config, store_config(spec["store"]))
    store = engine.store
    assert store is not None
    kept: dict[str, Request] = {}
    results: list[Any] = []
    for op, args in spec["ops"]:
        if op == "generate":
            request = engine.generate(
                np.asarray(args["prompt"], np.int32),
                args.get("n_new", 1),
                use_cache=args.get("use_cache", True),
                save=args.get("save", True),
                boundary=args.get("boundary"),
                keep_blocks=args.get("keep_blocks", False),
            )
            if "as" in args:
                kept[args["as"]] = request
            results.append(request_json(request))
        elif op == "pause":
            engine.pause(args["session"], kept[args["request"]])
            results.append({"paused": args["session"]})
        elif op == "resume":
            results.append(
                request_json(engine.resume(args["session"], args["next_token"], args["n_new"]))
            )
        elif op == "sessions":
            results.append(store.sessions())
        elif op == "stats":
            results.append(store.stats())
        elif op == "save_loop":
            save_loop(engine, args["refs"], args["seed"])
        else:
            raise SystemExit(f"kv_child: unknown op {op!r}")
    if spec.get("exit", "close") == "abrupt":
        print("RESULT " + json.dumps(results), flush=True)
        os._exit(0)
    engine.close()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
