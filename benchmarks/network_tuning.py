"""What the data plane's two loopback settings are worth, each on and off in one run: GB/s and
the CPU seconds per GB of both processes for pulls over loopback.

* Read step: the receiver takes at most 128 KiB per read (``_core._recv_step``), against one
  read for as much of a payload as has arrived (the setting before it).
* Send buffer: the server's connection to a peer on this host sends through a fixed 256 KiB
  ``SO_SNDBUF`` (``frames.tune_for_peer``), against the kernel's autotuned buffer (a second
  server child with the tuning turned off).

A BlockServer child per send-buffer setting serves ``--total-mib`` of ``--block-kib`` random
blocks; this process pulls them all with 1 and 2 connections, every block verified. The four
combinations and the connection counts alternate, ``--repeats`` times; medians are printed.
Client CPU is this process's (``getrusage``), server CPU the child's (``/proc/PID/stat``).
Every child is stopped by its pid. Prints a markdown table; writes JSON.

    python benchmarks/network_tuning.py [--total-mib 1024] [--block-kib 2048] [--repeats 9]
        [--json benchmarks/results/network_tuning/COMMIT-MACHINE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import secrets
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, write_json

from tpusync._src.bench.common import result_path
from tpusync._src.bench.network_procs import CHILDREN, Puller, start_child

# this script runs its block servers itself: one of them with the ablation applied first
CHILD_PROGRAM = (sys.executable, os.path.abspath(__file__))

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = str(result_path("network_tuning", os.path.join(HERE, "results")))
WHOLE_PAYLOAD = 1 << 40  # a read step no payload reaches: as much as has arrived


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(kind: str, config_json: str) -> None:
    """A child of network_procs, with the send buffer left to the kernel when the ablation
    asks for it."""
    import json

    config = json.loads(config_json)
    if config.get("autotuned_send_buffer"):
        from tpusync._src.cluster.dataplane import _connection, server

        server.tune_for_peer = _connection.tune_for_peer = lambda sock: None
    CHILDREN[kind](config)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        run_child(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per pull")
    parser.add_argument("--block-kib", type=int, default=2048, help="block size")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args()
    from tpusync._native import core as _core

    block_bytes = args.block_kib << 10
    blocks = (args.total_mib << 20) // block_bytes
    gigabytes = blocks * block_bytes / 1e9
    secret = secrets.token_bytes(32)
    step = _core._set_recv_step(WHOLE_PAYLOAD)
    _core._set_recv_step(step)
    steps = {"whole": WHOLE_PAYLOAD, f"{step >> 10} KiB": step}
    runs: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    start = time.perf_counter()
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as work:
        servers = {}
        for buffer, autotuned in (("autotuned", True), ("256 KiB", False)):
            config = {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "servers": [{"host": "127.0.0.1"}],
                "cert": None,
                "autotuned_send_buffer": autotuned,
            }
            child, ready = start_child(
                stack, f"server-{buffer}", "block-server", config, work, program=CHILD_PROGRAM
            )
            servers[buffer] = (child.proc.pid, ready["ports"][0])
        puller = Puller(blocks, block_bytes, secret)
        stack.callback(puller.close)
        for buffer, (_, port) in servers.items():
            for connections in (1, 2):
                name = f"{buffer}/{connections}"
                puller.add(name, [f"127.0.0.1:{port}"], connections, None, insecure=False)
                puller.verify(name)  # warm-up, and a byte check of what arrives
        print(f"pulls of {args.total_mib} MiB ", end="", flush=True)
        try:
            for _ in range(args.repeats):
                for buffer, (pid, _) in servers.items():
                    for step_name, step_bytes in steps.items():
                        _core._set_recv_step(step_bytes)
                        for connections in (1, 2):
                            client0, server0 = _own_cpu_seconds(), _cpu_seconds(pid)
                            seconds = puller.pull(f"{buffer}/{connections}")
                            client = _own_cpu_seconds() - client0
                            server = _cpu_seconds(pid) - server0
                            runs.setdefault((step_name, buffer, connections), []).append(
                                (gigabytes / seconds, client / gigabytes, server / gigabytes)
                            )
                print(".", end="", flush=True)
        finally:
            _core._set_recv_step(step)
        print(flush=True)
    elapsed = time.perf_counter() - start
    rows: list[list[Any]] = []
    results = []
    for (step_name, buffer, connections), values in runs.items():
        gbps = median([v[0] for v in values])
        client, server = median([v[1] for v in values]), median([v[2] for v in values])
        rows.append(
            [
                step_name,
                buffer,
                connections,
                gbps,
                f"{min(v[0] for v in values):.2f}-{max(v[0] for v in values):.2f}",
                f"{client:.3f}",
                f"{server:.3f}",
            ]
        )
        results.append(
            {
                "read_step": step_name,
                "send_buffer": buffer,
                "connections": connections,
                "gbps": gbps,
                "gbps_runs": [v[0] for v in values],
                "client_cpu_s_per_gb": client,
                "server_cpu_s_per_gb": server,
            }
        )
    rows.sort(key=lambda r: (r[2], r[1], r[0]))
    print(
        f"\nloopback pulls of {args.total_mib} MiB of {args.block_kib} KiB blocks, median of "
        f"{args.repeats} (GB/s; CPU seconds per GB of each process)"
    )
    print_table(
        ["read step", "send buffer", "conns", "GB/s", "range", "client s/GB", "server s/GB"], rows
    )
    print(f"\n{elapsed:.0f} s in all")
    write_json(
        args.json,
        {
            "benchmark": "network_tuning",
            "repeats": args.repeats,
            "results": results,
            "args": vars(args),
            "seconds": elapsed,
        },
    )


if __name__ == "__main__":
    main()
