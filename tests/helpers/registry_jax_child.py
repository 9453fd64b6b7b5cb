"""One process of a 2-process jax.distributed job exercising JaxRegistry (run by
tests/cluster/test_registry.py): ``python registry_jax_child.py <process_id> <coordinator port>``.

Process 0 registers and publishes, process 1 looks up; barriers of the coordination service
order the steps. Process 1 sees the lease of "short" lapse through a second registry whose clock
runs ``LATER`` seconds ahead (no sleep). The last stdout line is a JSON object of what this
process saw.
"""

from __future__ import annotations

import json
import sys
import time

import jax

BARRIER_MS = 20_000
SHORT_TTL = 5.0  # outlives the steps before the lapse, even on a loaded machine
LATER = 10.0  # past SHORT_TTL, within the other leases (30 s)


def holders_json(registry, keys):
    return [[[h.node_id, h.tier] for h in held] for held in registry.holders(keys)]


def main() -> None:
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=pid,
        initialization_timeout=20,
        heartbeat_timeout_seconds=5,
        shutdown_timeout_seconds=5,
    )
    from jax._src.distributed import global_state

    from tpusync.cluster import JaxRegistry, NodeInfo, longest_common_prefix, longest_prefix

    client = global_state.client
    registry = JaxRegistry(prefix="test/reg")
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    out: dict[str, object] = {"pid": pid}

    def barrier(name: str) -> None:
        client.wait_at_barrier(f"tpusync-{name}", BARRIER_MS)

    if pid == 0:
        registry.register(NodeInfo("p0/a", ("127.0.0.1:7000",), group="g", shard_rank=0), 30)
        registry.register(NodeInfo("p0/b", ("127.0.0.1:7001",), group="g", shard_rank=1), 30)
        registry.publish("p0/a", keys, "dram")
        registry.publish("p0/b", keys[:2], "disk")
        registry.register(NodeInfo("short"), SHORT_TTL)
        registry.publish("short", keys[:1], "shm")
    barrier("published")
    if pid == 1:
        out["holders"] = holders_json(registry, keys)
        out["nodes"] = [n.node_id for n in registry.nodes()]
        out["longest"] = longest_prefix(registry, keys)[0]
        out["common"] = longest_common_prefix(registry, [keys, keys])
        out["common_ab"] = longest_common_prefix(registry, [keys, keys[:2]])
        later = JaxRegistry(prefix="test/reg", clock=lambda: time.time() + LATER)
        out["holders_after_lapse"] = holders_json(later, keys[:1])
        out["short_heartbeat"] = later.heartbeat("short", 1.0)
        out["swept"] = later.sweep()
        later.close()
    barrier("looked")
    if pid == 0:
        registry.withdraw("p0/a", keys[:1])
        registry.unregister("p0/b")
    barrier("withdrawn")
    if pid == 1:
        out["holders_final"] = holders_json(registry, keys)
        out["nodes_final"] = [n.node_id for n in registry.nodes()]
    barrier("done")
    registry.close()
    jax.distributed.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
