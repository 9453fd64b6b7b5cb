"""A child process for tests/kv/test_kv_model.py and tests/kv/test_kv_reliability.py: a
ToyEngine over a KVCacheStore in a fresh process (a "restarted server").

    python tests/helpers/kv_child.py SPEC.json

SPEC (JSON)::

    {"model": {ModelConfig fields}, "store": {"model_id": ..., "dram": {DramTier fields},
     "disk": {DiskTier fields} | null, "shared_fs": {SharedFsTier fields} | null},
    (the tiers' directories are created unless the spec says ``"create": false``)
     "ops": [[op, {args}], ...], "exit": "close" | "abrupt", "jax_cache": dir | null}

``jax_cache`` is a persistent compilation cache directory: the children of one test session
compile the model once instead of each child compiling it again.

Ops (each appends one entry to the results):

* ``generate``: prompt, n_new, use_cache, save, boundary, keep_blocks, as (a name for pause) ->
  tokens, logits (hex of the float32 bytes), cached_tokens, lookup_tiers, loaded_tokens.
* ``pause``: session, request (the name given to a generate with keep_blocks) -> released.
* ``resume``: session, next_token, n_new -> the same fields as generate.
* ``sessions`` -> the offloaded session ids; ``stats`` -> store.stats().

``store.remote`` (``{"address", "secret_hex"}``) reads another process's DRAM tier through a
``RemotePool``; ``store.cluster`` (``{"registry", "secret_hex"}``) reads whatever live nodes the
registry lists, through a ``RegistryPool`` (disaggregated prefill -> decode).
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
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
from run_names import run_name

import tpusync
from tpusync._src.testing.engine import Request, ToyEngine
from tpusync._src.testing.model import ModelConfig
from tpusync.kv import DiskTier, DramTier, KVStoreConfig, SharedFsTier

# The small model every KV test uses: a compile costs well under a second on 2 cores.
MODEL: dict[str, int] = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "d_ff": 128,
    "vocab_size": 256,
    "block_size": 16,
    "num_blocks": 256,
    "max_blocks_per_seq": 64,
    "max_chunk": 128,
}
SHM_DIR = "/dev/shm"
CHILD_TIMEOUT_S = 120.0

# --- the parent's side ---------------------------------------------------------------------


def child_env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def jax_cache_dir(workdir: Path) -> Path:
    """The persistent compilation cache of this pytest session: beside the tests' tmp_paths
    (``workdir`` is one of them), so every child of the session shares it."""
    path = workdir.parent / "kv-child-jax-cache"
    path.mkdir(exist_ok=True)
    return path


def write_spec(spec: dict[str, Any], workdir: Path) -> Path:
    spec = {"jax_cache": str(jax_cache_dir(workdir)), **spec}
    path = workdir / f"spec-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(spec))
    return path


def run(spec: dict[str, Any], workdir: Path, *, timeout: float = CHILD_TIMEOUT_S) -> list[Any]:
    """Runs one child to its end (killed by pid past ``timeout``); returns its results."""
    child = subprocess.Popen(
        [sys.executable, __file__, str(write_spec(spec, workdir))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(child)
        raise AssertionError(f"kv_child did not finish within {timeout} s") from None
    if child.returncode != 0:
        raise AssertionError(f"kv_child failed (exit {child.returncode}):\n{err[-6000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"kv_child printed no result:\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def start(spec: dict[str, Any], workdir: Path) -> subprocess.Popen[str]:
    """Starts a child that prints ``ready`` and runs until killed (a ``save_loop``)."""
    child = subprocess.Popen(
        [sys.executable, __file__, str(write_spec(spec, workdir))],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # "ready", or EOF if the child died first
    if line.strip() != "ready":
        stop(child)
        raise AssertionError(f"kv_child did not start (said {line!r}, exit {child.returncode})")
    return child


def stop(child: subprocess.Popen[str]) -> None:
    """SIGKILLs a child by pid (if still running) and reaps it."""
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=30)


def remove_named_pool(name: str, shm_dir: str = SHM_DIR) -> None:
    """Removes a named pool, its sessions and any temporary file of an interrupted creation."""
    base = Path(shm_dir)
    (base / f"tpusync-{name}.pool").unlink(missing_ok=True)
    shutil.rmtree(base / f"tpusync-{name}.sessions", ignore_errors=True)
    for temp in base.glob(f".tpusync-{name}.pool.tmp-*"):
        temp.unlink(missing_ok=True)


def unique_name(label: str) -> str:
    return run_name(label)


def logits_hex(logits: Any) -> str:
    return np.asarray(logits, np.float32).tobytes().hex()


# --- the child's side ----------------------------------------------------------------------


def store_config(spec: dict[str, Any], model: ModelConfig | None = None) -> KVStoreConfig:
    """The store of ``spec``; ``"remote": {"address", "secret_hex"}`` adds another process's
    DRAM tier, read through a RemotePool, ``"cluster": {"registry", "secret_hex"}`` the blocks
    other nodes list in a registry, and ``"node"`` (as ``"remote"``) a store node's DRAM as a
    writable tier. The store opens them all with its own layout (``model`` is not needed)."""
    from tpusync.cluster import PeerTier, RegistryTier, RemoteRegistry, StoreNodeTier

    tiers: list[Any] = []
    if spec.get("disk"):
        tiers.append(DiskTier(**{"create": True, **spec["disk"]}))
    if spec.get("shared_fs"):
        tiers.append(SharedFsTier(**{"create": True, **spec["shared_fs"]}))
    if spec.get("remote"):
        secret = bytes.fromhex(spec["remote"]["secret_hex"])
        tiers.append(PeerTier(spec["remote"]["address"], secret=secret, name="remote"))
    if spec.get("cluster"):  # only the registry's address: holders found through it
        secret = bytes.fromhex(spec["cluster"]["secret_hex"])
        registry = RemoteRegistry(spec["cluster"]["registry"], secret=secret)
        tiers.append(RegistryTier(registry, exclude="decode", secret=secret, name="cluster"))
    if spec.get("node"):  # a store node's DRAM, written through and read back
        secret = bytes.fromhex(spec["node"]["secret_hex"])
        tiers.append(StoreNodeTier(spec["node"]["address"], secret=secret, name="node"))
    return KVStoreConfig(
        model_id=spec["model_id"],
        block_size=spec.get("block_size", MODEL["block_size"]),
        dram=DramTier(**spec["dram"]),
        tiers=tuple(tiers),
    )


def request_json(request: Request) -> dict[str, Any]:
    return {
        "tokens": request.tokens.astype(int).tolist(),
        "logits": logits_hex(request.prefill_logits),
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
    if spec.get("jax_cache"):  # compiled code shared by the children of one test session
        jax.config.update("jax_compilation_cache_dir", spec["jax_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    config = ModelConfig(**spec["model"])
    engine = ToyEngine(config, store_config(spec["store"], config))
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
