"""Multi-controller JAX: a prefix saved by one process of a ``jax.distributed`` job is loaded by
the other, found through the ``jax`` registry backend (the job's coordination service).

Two real processes with 4 fake CPU devices each form one 8-device job; the KV pools are sharded
over the 4 devices of each process and replicated across the two (mesh ``("replica", 2) x
("tp", 4)``, ``P(None, "tp")``). See tests/helpers/kv_multicontroller_child.py for the steps.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import kv_multicontroller_child as child
import numpy as np

# An editable install rebuilds the extension on import: let it happen here, not in both
# children at once (two concurrent rebuilds of one build directory fail).
import tpusync  # noqa: F401

DEADLINE_S = 25.0


def test_a_prefix_saved_by_one_jax_process_is_loaded_by_the_other(
    tmp_path: Path, rng: np.random.Generator, path: str
) -> None:
    seed = int(rng.integers(2**31))
    port = child.free_port()
    secret = secrets.token_bytes(32)
    procs = [child.start(pid, port, seed, path, secret, tmp_path) for pid in range(2)]
    outputs = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        for pid, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # the finally block kills both
                code = None
            err = (tmp_path / f"mc{pid}.err").read_text(errors="replace")
            assert code == 0, f"process {pid} failed ({code}), seed {seed}:\n{_why(err)}"
            lines = (tmp_path / f"mc{pid}.out").read_text().strip().splitlines()
            assert lines, f"process {pid} printed nothing:\n{_why(err)}"
            outputs.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            child.stop(proc)
    prefill, decode = outputs
    n_blocks = len(child.SAVED_BLOCKS)
    n_pools = 2 * child.LAYERS
    heads = [str(h) for h in range(child.KV_HEADS)]
    for seen in outputs:  # one job of 8 devices; each process addresses its 4, a whole replica
        assert (seen["devices"], seen["local_devices"]) == (8, 4)
        assert seen["fully_addressable"] is False
    for seen in outputs:  # every write, save and load ran on the engine under test
        assert seen["engine_calls"][path] > 0
        assert seen["engine_calls"][{"native": "jax", "jax": "native"}[path]] == 0
    assert prefill["layout_shards"] == [child.KV_HEADS] * n_pools  # a slot holds all 4 shards
    assert prefill["stored_blocks"] == n_blocks
    assert prefill["holders"] == [["replica-0"]] * n_blocks  # published through the registry

    # The decode process found every full block only in the cluster tier and loaded them all.
    assert decode["lookup_tiers"] == ["cluster"] * n_blocks
    assert decode["cached_tokens"] == decode["loaded_tokens"] == n_blocks * child.BLOCK_SIZE
    assert decode["promoted_blocks"] == n_blocks
    assert decode["cluster_stats"]["hits"] == n_blocks
    # Bit for bit, per addressable shard: equal to the seed's KV, to what process 0 wrote (its
    # own digests), and every other block untouched.
    assert decode["mismatches"] == [
        [i, h, 0] for i in range(n_pools) for h in range(child.KV_HEADS)
    ]
    assert decode["untouched_mismatches"] == [
        [i, h, 0] for i in range(n_pools) for h in range(child.KV_HEADS)
    ]
    assert decode["loaded"] == prefill["written"]
    assert decode["changed_from_before"] == [heads] * n_pools  # the load really wrote them

    assert decode["misses"] == {
        "never_saved": 0,
        "weight_version": 0,
        "tenant": 0,
        "diverges_at_block_1": 1,  # the longest common prefix only
    }
    assert (prefill["leases_expired"], prefill["rejected"]) == (0, 0)
    assert decode["nodes_after_close"] == []  # closing the prefill store unregistered it


def _why(stderr: str) -> str:
    """A child's Python traceback if it has one (the coordination service's abort follows it
    and would bury it), else the end of its stderr."""
    at = stderr.find("Traceback (most recent call last)")
    return stderr[at : at + 4000] if at >= 0 else stderr[-4000:]
