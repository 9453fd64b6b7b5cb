"""Instructions per pull and per push of two builds, counted by valgrind (callgrind).

Timings of a loopback pull swing 10-15% between runs of one build on a shared VM; the number of
instructions the code executes does not. For each side (a directory holding the ``tpusync``
package, a wheel unzipped there) and each count of operations K in ``--ops`` (two values), a
server and a client process run under ``valgrind --tool=callgrind``: the server holds
``--mib`` of 2 MiB random blocks (a ``BlockServer``, or a store node's ``StoreServer`` for the
push), the client pulls every block into a ``HostPool`` (``BlockClient.pull``, each block
verified as it lands) or pushes them (``StoreNodePool.put``) K times. What the processes do
besides (imports, setup, shutdown) is the same for both values of K, so the difference of the
totals divided by the difference of K is one operation's instructions, per process. Counts are
user-space instructions (``Ir``); the kernel's copies are the same bytes on both sides.

    python benchmarks/callgrind_ab.py BEFORE_SITE AFTER_SITE [--mib 64] [--ops 1,3]
        [--json FILE]

Needs valgrind. Slow (each process runs about 50x slower than natively): minutes per side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json

BLOCK_BYTES = 2 << 20
LEASE_TTL_S = 3600.0  # far beyond a pull under valgrind
SECRET_HEX = "5a" * 32  # a fixed secret: both sides do the same work

SERVER = r"""
import json, sys
import numpy as np
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

kind, blocks, block_bytes, ttl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
secret = bytes.fromhex(sys.argv[5])
if kind == "pull":
    from tpusync.cluster import BlockServer
    layout = PoolLayout("callgrind", (ArrayLayout("kv", "uint8", (block_bytes,), 0, 1),))
    pool = HostPool(layout, blocks)
    keys = [i.to_bytes(4, "little") * 6 for i in range(blocks)]
    reservation = pool.reserve(keys)
    for i, slot in enumerate(reservation.slots.tolist()):
        with pool.slot_memory(slot) as memory:
            memory[:block_bytes] = np.random.default_rng([7, i]).bytes(block_bytes)
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    server = BlockServer(pool, secret=secret, host="127.0.0.1", lease_ttl_s=ttl)
    port = server.port
else:
    from tpusync.cluster import StoreServer
    pool = None
    server = StoreServer((blocks + 4) * block_bytes, secret=secret, lease_ttl_s=ttl)
    port = int(server.address.rsplit(":", 1)[1])
print(json.dumps({"port": port}), flush=True)
sys.stdin.read()
server.close()
if pool is not None:
    pool.close()
"""

CLIENT = r"""
import json, sys
import numpy as np
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

kind, blocks, block_bytes, ttl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
secret, port, ops = bytes.fromhex(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
layout = PoolLayout("callgrind", (ArrayLayout("kv", "uint8", (block_bytes,), 0, 1),))
keys = [i.to_bytes(4, "little") * 6 for i in range(blocks)]
target = HostPool(layout, blocks)
if kind == "pull":
    from tpusync.cluster import BlockClient
    client = BlockClient(addresses=[f"127.0.0.1:{port}"], connections=1, secret=secret,
                         timeout_s=600.0, lease_ttl_s=ttl)
    for _ in range(ops):
        target.delete(keys)
        loaded = client.pull(keys, target)
        assert all(loaded), "a block was not pulled"
else:
    from tpusync.cluster import StoreNodePool
    reservation = target.reserve(keys)
    for i, slot in enumerate(reservation.slots.tolist()):
        with target.slot_memory(slot) as memory:
            memory[:block_bytes] = np.random.default_rng([7, i]).bytes(block_bytes)
    target.commit(reservation, target.hash_slots(reservation.slots))
    client = StoreNodePool(f"127.0.0.1:{port}", layout=layout, secret=secret, connections=1,
                           timeout_s=600.0)
    for _ in range(ops):
        client.delete(keys)
        stored = client.put(keys, target)
        assert stored == len(keys), "a block was not stored"
client.close()
target.delete(keys)
target.close()
print(json.dumps({"ok": True}), flush=True)
"""


def total_instructions(out_file: Path) -> int:
    """The ``summary:`` (or ``totals:``) Ir of one callgrind output file."""
    text = out_file.read_text(errors="replace")
    found = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{out_file}: no instruction total")
    return int(found.group(1))


def counted(out_pattern: Path) -> int:
    """Sum over every file callgrind wrote for one process (one per thread with
    --separate-threads=no is one file; a forked child would add more)."""
    files = sorted(out_pattern.parent.glob(out_pattern.name + "*"))
    if not files:
        raise RuntimeError(f"callgrind wrote no {out_pattern}*")
    return sum(total_instructions(f) for f in files)


def valgrind(out: Path) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--quiet",
        f"--callgrind-out-file={out}",
        "--dump-instr=no",
        "--compress-strings=no",
    ]


def run_once(site: Path, kind: str, mib: int, ops: int, work: Path) -> dict[str, float]:
    """One server and one client under callgrind doing ``ops`` operations; their totals."""
    blocks = mib * (1 << 20) // BLOCK_BYTES
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PYTHONHASHSEED": "0",
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    common = [kind, str(blocks), str(BLOCK_BYTES), str(LEASE_TTL_S), SECRET_HEX]
    server_out, client_out = work / f"server-{ops}.out", work / f"client-{ops}.out"
    start = time.perf_counter()
    server = subprocess.Popen(
        [*valgrind(server_out), sys.executable, "-c", SERVER, *common],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"{site}: the {kind} server exited without a port")
        port = json.loads(line)["port"]
        subprocess.run(
            [*valgrind(client_out), sys.executable, "-c", CLIENT, *common, str(port), str(ops)],
            env=env,
            check=True,
            timeout=3600,
            stdout=subprocess.DEVNULL,
        )
        server.stdin.close()
        server.wait(timeout=600)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
    if server.returncode != 0:
        raise RuntimeError(f"{site}: the {kind} server exited with {server.returncode}")
    return {
        "server_ir": counted(server_out),
        "client_ir": counted(client_out),
        "wall_s": time.perf_counter() - start,
    }


def measure(site: Path, kind: str, mib: int, ops: tuple[int, int]) -> dict[str, object]:
    """Instructions of one operation on ``site``, client and server, from two values of K."""
    with tempfile.TemporaryDirectory(prefix="tpusync-callgrind-") as tmp:
        runs = {k: run_once(site, kind, mib, k, Path(tmp)) for k in ops}
    low, high = runs[ops[0]], runs[ops[1]]
    per_op = {
        side: (high[f"{side}_ir"] - low[f"{side}_ir"]) / (ops[1] - ops[0])
        for side in ("client", "server")
    }
    return {
        "runs": {str(k): v for k, v in runs.items()},
        "client_ir_per_op": per_op["client"],
        "server_ir_per_op": per_op["server"],
        "ir_per_op": per_op["client"] + per_op["server"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a directory holding build A's tpusync")
    parser.add_argument("after", type=Path, help="a directory holding build B's tpusync")
    parser.add_argument("--mib", type=int, default=64, help="bytes moved per operation")
    parser.add_argument("--ops", default="1,3", help="two operation counts K, the second larger")
    parser.add_argument("--kinds", default="pull,push")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("callgrind_ab: needs valgrind (apt-get install valgrind)")
    ops = tuple(int(k) for k in args.ops.split(","))
    if len(ops) != 2 or ops[0] >= ops[1]:
        sys.exit("callgrind_ab: --ops takes two counts, the second larger (for example 1,3)")
    results: dict[str, dict[str, object]] = {}
    for kind in args.kinds.split(","):
        for label, site in (("before", args.before), ("after", args.after)):
            print(f"{kind} {label}: running under callgrind ...", flush=True)
            results.setdefault(kind, {})[label] = measure(site.resolve(), kind, args.mib, ops)
    print(f"\nuser-space instructions per {args.mib} MiB operation (millions; lower is better)")
    print(f"{'operation':<8} {'process':<8} {'before':>12} {'after':>12} {'after vs before':>16}")
    for kind, sides in results.items():
        for process in ("client", "server", "total"):
            key = "ir_per_op" if process == "total" else f"{process}_ir_per_op"
            a, b = sides["before"][key], sides["after"][key]
            change = (a - b) / a * 100
            print(f"{kind:<8} {process:<8} {a / 1e6:>12.2f} {b / 1e6:>12.2f} {change:>+15.1f}%")
    document = {
        "benchmark": "callgrind_ab",
        "args": {
            "mib": args.mib,
            "ops": list(ops),
            "before": str(args.before),
            "after": str(args.after),
        },
        "results": results,
    }
    if args.json is not None:
        write_json(args.json, document)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
