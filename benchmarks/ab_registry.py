"""Registry lookups of two builds, alternating: the figure issue 19's A/B flagged.

Each round runs one child per side, in turn, with that side's tpusync first on the path: the
child serves a MemoryRegistry holding one live node's 512 keys (24 bytes each) from a
RegistryServer in a grandchild, and counts ``longest_prefix`` lookups of them through a
RemoteRegistry in ``--window-s`` windows (the network benchmark's registry row). Prints the
median per side and the change; writes JSON.

    python benchmarks/ab_registry.py BEFORE_SITE AFTER_SITE [--rounds 9] [--window-s 0.5]
        [--json FILE]

A side is a directory holding the ``tpusync`` package (a wheel unzipped there)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, multiprocessing as mp, secrets, sys, time

def serve(secret, keys, queue):
    from tpusync.cluster import MemoryRegistry, NodeInfo, RegistryServer
    registry = MemoryRegistry()
    registry.register(NodeInfo("node-1", "127.0.0.1", 1), 600.0)
    registry.publish("node-1", keys, "dram")
    server = RegistryServer(registry, secret=secret)
    queue.put(server.port)
    time.sleep(600)

if __name__ == "__main__":
    import hashlib
    from tpusync.cluster import RemoteRegistry, longest_prefix
    window, windows = float(sys.argv[1]), int(sys.argv[2])
    keys = [hashlib.blake2b(f"k{i}".encode(), digest_size=24).digest() for i in range(512)]
    secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    server = ctx.Process(target=serve, args=(secret, keys, queue), daemon=True)
    server.start()
    try:
        port = queue.get(timeout=60)
        remote = RemoteRegistry(f"127.0.0.1:{port}", secret=secret)
        assert longest_prefix(remote, keys)[0] == 512
        rates = []
        for _ in range(windows):
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < window:
                longest_prefix(remote, keys)
                n += 1
            rates.append(n / (time.perf_counter() - start))
        remote.close()
        print(json.dumps(rates))
    finally:
        server.kill()
        server.join(10)
"""


def run_side(site: str, script: str, window: float, windows: int) -> float:
    env = dict(os.environ, PYTHONPATH=site, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, script, str(window), str(windows)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{site}: the child failed:\n{done.stderr[-2000:]}")
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--window-s", type=float, default=0.5)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"before": [], "after": []}
    work = tempfile.mkdtemp(prefix="tpusync-ab-")
    script = os.path.join(work, "lookups.py")  # a file: spawn re-imports the child's main
    with open(script, "w") as f:
        f.write(CHILD)
    try:
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                site = getattr(args, side)
                rates[side].append(run_side(site, script, args.window_s, args.windows))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()),
                  flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work)
    med = {k: statistics.median(v) for k, v in rates.items()}
    change = (med["after"] / med["before"] - 1) * 100
    print(f"RemoteRegistry -> RegistryServer, 512-key lookups/s, median of {args.rounds}: "
          f"before {med['before']:.0f}, after {med['after']:.0f} ({change:+.1f}%)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "median": med, "change_percent": change}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
