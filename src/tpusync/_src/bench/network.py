"""GB/s of tpusync's block data plane between two processes, against the TCP limit and
jax.experimental.transfer; striping over two rate-limited paths; registry lookups per second.

* Loopback: a BlockServer in a child process serves a HostPool of ``--total-mib`` of 2 MiB blocks
  (random bytes); the benchmark process pulls them all into a local HostPool with a BlockClient
  (``client.pull(keys, target)``, every block verified against its checksum as it lands), with
  1, 2 and 4 connections, without and with TLS (a self-signed certificate made by ``openssl``),
  and pushes the same blocks to a store node's server (``StoreServer``, in a third child) through
  a ``StoreNodePool``, which the node verifies before it stores them.
  Interleaved with those pulls, round by round: the TCP limit for as many streams (no framing,
  no checksums, nothing stored), the best of a C sender/receiver thread pair per stream
  (:func:`~tpusync._src.bench.limits.loopback_tcp`, a few chunk and buffer settings) and one iperf3
  process per stream (:class:`~tpusync._src.bench.limits.Iperf3PerStream`, its defaults and
  ``-w 256K -l 1M``); and ``jax.experimental.transfer`` (the peer that runs here) pulling the
  same bytes, as one pytree of 2 MiB arrays, from a TransferServer in another child process;
  and, where its environment is set up (``benchmarks/peers/setup.sh``), Mooncake's transfer
  engine over TCP reading the same blocks between two processes of its own
  (:mod:`tpusync._src.bench.peer_workers.mooncake_pull`).
  Medians of ``--repeats`` after one warm-up each.
* Two paths (root only): two network namespaces joined by two veth pairs, each on its own /24
  subnet and shaped to ``--rate-mbit`` by ``tc tbf`` on both ends; the server runs in one
  namespace, a client child process in the other pulls ``--netns-mib`` over one path or striped
  over both (``"local>remote:port"`` addresses, 2 connections either way), plaintext
  (``insecure=True``) and TLS, beside iperf3 over one path and over both at once.
* Registry: longest-prefix lookups (``longest_prefix``) per second of a 512-block prefix of
  24-byte keys, all held by one live node: MemoryRegistry in process, RemoteRegistry against a
  RegistryServer in a child process over TCP, RedisRegistry (the peer) against a redis-server
  started here.

Targets (printed as ratios): tpusync loopback without TLS >= 0.8x the TCP limit and >= 2.5x
jax.experimental.transfer; two striped paths >= 1.8x one path. Every child process is stopped by
its pid (EOF on its stdin, then SIGTERM, then SIGKILL, each with a timeout) and the namespaces are
deleted, also on error. Prints tables; writes JSON.

    python benchmarks/network.py [--total-mib 1024] [--block-kib 2048] [--repeats 5]
        [--connections 1,2,4] [--netns-mib 256] [--rate-mbit 1000] [--skip-netns]
        [--lookup-s 0.5] [--peers-dir benchmarks/peers] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tpusync._src.bench.common import Run, median, print_table, spread
from tpusync._src.bench.external import peer_state, start_peer
from tpusync._src.bench.limits import TcpLimit
from tpusync._src.bench.network_peers import (
    REDIS_ROW,
    JaxPuller,
    bench_registry,
    iperf3_available,
    iperf3_gbps,
    iperf3_server,
)
from tpusync._src.bench.network_procs import (
    CHILDREN,
    Puller,
    client_context,
    make_certificate,
    start_child,
)

PATHS = (("10.71.1.1", "10.71.1.2"), ("10.72.1.1", "10.72.1.2"))  # (server, client) per veth
TARGETS = {"limit": 0.8, "jax": 2.5, "striped": 1.8}
MOONCAKE = "Mooncake transfer engine (tcp)"
PEER_ROWS = ("jax.experimental.transfer", MOONCAKE)
QUICK = ["--total-mib", "64", "--repeats", "3", "--connections", "1,4", "--netns-mib", "32",
         "--lookup-s", "0.2"]  # fmt: skip


def best_peer(gbps: dict[str, float]) -> str | None:
    """The faster of the peers that ran, or None."""
    ran = [name for name in PEER_ROWS if gbps.get(name)]
    return max(ran, key=gbps.__getitem__) if ran else None


def _conns(c: int) -> str:
    return f"{c} conn{'s' if c > 1 else ''}"


def bench_loopback(
    args: argparse.Namespace, cert: tuple[str, str] | None, log_dir: str, notes: list[str]
) -> dict[str, Any]:
    block_bytes = args.block_kib << 10
    blocks = (args.total_mib << 20) // block_bytes
    nbytes = blocks * block_bytes
    secret = secrets.token_bytes(32)
    conns = [int(c) for c in args.connections.split(",")]
    times: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        servers = [{"host": "127.0.0.1"}] + ([{"host": "127.0.0.1", "tls": True}] if cert else [])
        _, ready = start_child(
            stack,
            "block-server",
            "block-server",
            {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "servers": servers,
                "cert": cert,
            },
            log_dir,
        )
        ports = ready["ports"]
        puller = Puller(blocks, block_bytes, secret)
        stack.callback(puller.close)
        runs: dict[str, int] = {}  # name -> connections
        for tls in [False, True] if cert else [False]:
            port = ports[1] if tls else ports[0]
            for c in conns:
                name = f"tpusync{' TLS' if tls else ''} {_conns(c)}"
                context = client_context(cert) if tls and cert else None
                puller.add(name, [f"127.0.0.1:{port}"], c, context, insecure=False)
                runs[name] = c
        # pushes of the same blocks (the target's, once pulled) to a store node's server
        layout = puller.target.layout
        _, store = start_child(
            stack,
            "store-server",
            "store-server",
            {"secret": secret.hex(), "dram_bytes": (blocks + 8) * layout.slot_bytes + (16 << 20)},
            log_dir,
        )
        pushes: list[str] = []
        for c in conns:
            pushes.append(f"tpusync push {_conns(c)}")
            puller.add_pusher(pushes[-1], store["address"], c)
        limits = {c: TcpLimit(stack, c, nbytes) for c in conns}
        if not iperf3_available():
            notes.append("iperf3: not installed (apt-get install iperf3); the limit is C only")
        jax_puller = None
        try:
            jax_child, jax_ready = start_child(
                stack,
                "jax-server",
                "jax-server",
                {"blocks": blocks, "block_bytes": block_bytes},
                log_dir,
            )
            jax_puller = JaxPuller(jax_child, jax_ready["address"], blocks, block_bytes)
        except Exception as exc:
            notes.append(f"jax.experimental.transfer: n/a ({type(exc).__name__}: {exc})")
        mooncake = None
        if peer_state("mooncake", args.peers_dir) == "runs":
            config = {"blocks": blocks, "block_bytes": block_bytes, "seed": 7}
            mooncake, first = start_peer(stack, "mooncake", "mooncake_pull", "client", config,
                                         log_dir, args.peers_dir)  # fmt: skip
            notes.append(f"Mooncake {first['mooncake']}: transfer engine, tcp protocol, "
                         "P2P handshake, one batch_transfer_sync_read per pull")  # fmt: skip
        else:
            notes.append(f"Mooncake: {peer_state('mooncake', args.peers_dir)}")
        # warm-up (and a byte-for-byte check of what each path delivers)
        for name in runs:
            puller.verify(name)
        for name in pushes:  # the node stores only blocks it verified
            puller.push(name)
        for limit in limits.values():
            limit.sample(tries=20)  # the first tries may find an iperf3 server not listening
            limit.runs.clear()
        if jax_puller is not None:
            try:
                jax_puller.pull(verify=True)
            except Exception as exc:
                notes.append(f"jax.experimental.transfer: n/a ({type(exc).__name__}: {exc})")
                jax_puller = None
        for _ in range(args.repeats):
            for name, c in runs.items():  # tpusync and its limit alternate, count by count
                times.setdefault(name, []).append(nbytes / puller.pull(name) / 1e9)
                if " TLS" not in name:
                    limits[c].sample()
            for name in pushes:  # the target holds every block after the pulls
                times.setdefault(name, []).append(nbytes / puller.push(name) / 1e9)
            if jax_puller is not None:
                times.setdefault("jax.experimental.transfer", []).append(
                    nbytes / jax_puller.pull() / 1e9
                )
            if mooncake is not None:
                seconds = mooncake.request({"op": "pull"})["seconds"]
                times.setdefault(MOONCAKE, []).append(nbytes / seconds / 1e9)
            print(".", end="", flush=True)
        print(flush=True)
        for limit in limits.values():  # the iperf3 rows under their old names, for comparison
            for label, values in limit.runs.items():
                if label.startswith("iperf3"):
                    times[label] = values
    found = {str(c): limit.result() for c, limit in limits.items()}
    return {
        "bytes": nbytes,
        "block_bytes": block_bytes,
        "blocks": blocks,
        "gbps": {k: median(v) for k, v in times.items()},
        "gbps_runs": times,
        "limit_gbps": {c: f["limit_gbps"] for c, f in found.items()},
        "limit_method": {c: f["limit_method"] for c, f in found.items()},
        "limit_gbps_by_method": {c: f["gbps_by_method"] for c, f in found.items()},
        "limit_gbps_runs": {str(c): limit.runs for c, limit in limits.items()},
        "tls": cert is not None,
    }


@contextlib.contextmanager
def network_namespaces(rate_mbit: int) -> Iterator[tuple[str, str]]:
    """Two namespaces (server, client) joined by two veth pairs, one /24 each, every end shaped
    to ``rate_mbit`` with tbf; deleted on exit, also on error."""
    tag = f"{os.getpid() % 100000}"
    names = (f"tpsbench-s{tag}", f"tpsbench-c{tag}")
    created: list[str] = []
    burst = max(rate_mbit * 125_000 // 100, 256 << 10)  # 10 ms at the rate, at least 256 KiB

    def ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)

    try:
        for name in names:
            ip("netns", "add", name)
            created.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        for k, (server_ip, client_ip) in enumerate(PATHS, 1):
            ends = ((names[0], f"p{k}s", server_ip), (names[1], f"p{k}c", client_ip))
            ip("link", "add", ends[0][1], "netns", names[0], "type", "veth",
               "peer", "name", ends[1][1], "netns", names[1])  # fmt: skip
            for ns, dev, address in ends:
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"],
                    check=True, capture_output=True, text=True, timeout=30,
                )  # fmt: skip
        yield names
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def netns_unavailable(args: argparse.Namespace) -> str | None:
    if args.skip_netns:
        return "skipped (--skip-netns)"
    if os.geteuid() != 0:
        return "skipped: needs root (network namespaces, veth, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"skipped: {' and '.join(missing)} not installed (apt-get install iproute2)"
    return None


def bench_netns(
    args: argparse.Namespace, cert: tuple[str, str] | None, log_dir: str, notes: list[str]
) -> dict[str, Any]:
    block_bytes = args.block_kib << 10
    blocks = (args.netns_mib << 20) // block_bytes
    nbytes = blocks * block_bytes
    secret = secrets.token_bytes(32)
    times: dict[str, list[float]] = {}
    with network_namespaces(args.rate_mbit) as (ns_server, ns_client), contextlib.ExitStack() as st:
        servers: list[dict[str, Any]] = [{"host": "0.0.0.0", "insecure": True}]
        servers += [{"host": "0.0.0.0", "tls": True}] if cert else []
        _, ready = start_child(
            st,
            "netns-block-server",
            "block-server",
            {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "servers": servers,
                "cert": cert,
            },
            log_dir,
            netns=ns_server,
        )
        clients = {}
        for tls in [False, True] if cert else [False]:
            port = ready["ports"][1 if tls else 0]
            paths = [f"{local}>{remote}:{port}" for remote, local in PATHS]
            suffix = " TLS" if tls else ""
            clients[f"one path{suffix}"] = {"addresses": paths[:1], "connections": 2, "tls": tls}
            clients[f"two paths{suffix}"] = {"addresses": paths, "connections": 2, "tls": tls}
        client, _ = start_child(
            st,
            "netns-block-client",
            "block-client",
            {
                "secret": secret.hex(),
                "blocks": blocks,
                "block_bytes": block_bytes,
                "clients": clients,
                "cert": cert,
            },
            log_dir,
            netns=ns_client,
        )
        iperf = iperf3_available()
        iperf_targets = [(remote, 5201 + k, local) for k, (remote, local) in enumerate(PATHS)]
        if iperf:
            for _, port, _ in iperf_targets:
                iperf3_server(st, port, None, ns_server, log_dir)
        timeout = 60 + 4 * nbytes * 8 / (args.rate_mbit * 1e6)
        for name in clients:
            client.request({"verify": name}, timeout)
        if iperf:
            iperf3_gbps(iperf_targets, nbytes, 1, ns_client, tries=20)
        for _ in range(args.repeats):
            for name in clients:
                seconds = client.request({"pull": name}, timeout)["seconds"]
                times.setdefault(name, []).append(nbytes / seconds / 1e9)
            if iperf:
                for label, targets in (
                    ("iperf3 one path", iperf_targets[:1]),
                    ("iperf3 two paths", iperf_targets),
                ):
                    gbps = iperf3_gbps(targets, nbytes, 1, ns_client)
                    times.setdefault(label, []).append(gbps)
            print(".", end="", flush=True)
        print(flush=True)
    if not iperf:
        notes.append("iperf3 (netns): not installed; the link ceiling is not measured")
    return {
        "bytes": nbytes,
        "rate_mbit_per_path": args.rate_mbit,
        "gbps": {k: median(v) for k, v in times.items()},
        "gbps_runs": times,
    }


def loopback_table(args: argparse.Namespace, loop: dict[str, Any]) -> None:
    """Each connection count's tpusync rows beside the limit and the faster peer
    (jax.experimental.transfer, Mooncake)."""
    g, runs = loop["gbps"], loop["gbps_runs"]
    peer = best_peer(g)
    rows = []
    for c in [int(c) for c in args.connections.split(",")]:
        limit = loop["limit_gbps"][str(c)]
        method = loop["limit_method"][str(c)]
        for name in (
            f"tpusync {_conns(c)}",
            f"tpusync TLS {_conns(c)}",
            f"tpusync push {_conns(c)}",
        ):
            if name not in g:
                continue
            rows.append(
                [
                    name,
                    spread(runs[name]),
                    f"{limit:.2f} {method}",
                    g[name] / limit,
                    "-" if peer is None else f"{g[name] / g[peer]:.2f} ({peer})",
                ]
            )
    for name in PEER_ROWS:
        rows.append([name, spread(runs[name]), "", "", ""] if name in g
                    else [name, "skipped", "see notes", "", ""])  # fmt: skip
    print(
        f"\nloopback: {loop['bytes'] / 2**20:.0f} MiB of {loop['block_bytes'] >> 10} KiB blocks "
        f"per pull, two processes, median (min-max) of {args.repeats} (GB/s); tpusync verifies "
        "every block's checksum; limit: the best of C TCP and iperf3 (a process per stream) for "
        "as many connections"
    )
    print_table(["path", "GB/s", "limit", "x limit", "x peer"], rows, limit_columns=(3,))
    by_method = []
    for c, methods in loop["limit_gbps_by_method"].items():
        for method, value in sorted(methods.items(), key=lambda kv: -kv[1]):
            by_method.append([f"{c} stream{'s' if int(c) > 1 else ''}", method, value])
    print("\nTCP limit candidates (median GB/s)")
    print_table(["streams", "method", "GB/s"], by_method)


# -- report --------------------------------------------------------------------------------------


def _ratio(name: str, value: float | None, target: float) -> dict[str, Any]:
    return {
        "ratio": name,
        "value": value,
        "target": target,
        "met": None if value is None else value >= target,
    }


def report(
    args: argparse.Namespace,
    loop: dict[str, Any],
    net: dict[str, Any] | None,
    reg: dict[str, Any],
    notes: list[str],
) -> list[dict[str, Any]]:
    g = loop["gbps"]
    loopback_table(args, loop)

    ratios = []
    jax_gbps = g.get("jax.experimental.transfer")
    for c in [int(c) for c in args.connections.split(",")]:
        plain = g.get(f"tpusync {_conns(c)}")
        limit = loop["limit_gbps"].get(str(c))
        ratios.append(
            _ratio(
                f"tpusync {_conns(c)} / TCP limit (loopback)",
                plain / limit if plain and limit else None,
                TARGETS["limit"],
            )
        )
        ratios.append(
            _ratio(
                f"tpusync {_conns(c)} / jax.experimental.transfer",
                plain / jax_gbps if plain and jax_gbps else None,
                TARGETS["jax"],
            )
        )
    if net is not None:
        n = net["gbps"]
        print(
            f"\ntwo namespaces, veth paths shaped to {args.rate_mbit} Mbit/s each (tbf), "
            f"{net['bytes'] / 2**20:.0f} MiB per pull, 2 connections, median of {args.repeats} "
            "(GB/s)"
        )
        rows = []
        for name, value in n.items():
            runs = net["gbps_runs"][name]
            rows.append([name, spread(runs, 3), value * 8])
        print_table(["path", "GB/s", "Gbit/s"], rows)
        for suffix in ("", " TLS"):
            one, two = n.get(f"one path{suffix}"), n.get(f"two paths{suffix}")
            if one and two:
                ratios.append(
                    _ratio(f"two striped paths / one{suffix}", two / one, TARGETS["striped"])
                )
    else:
        ratios.append(_ratio("two striped paths / one", None, TARGETS["striped"]))

    r = reg["lookups_per_s"]
    print(
        f"\nregistry: longest-prefix lookups of {reg['blocks']} blocks ({reg['key_bytes']}-byte "
        f"keys, all held by one live node), median (min-max) of {args.repeats}; peer: Redis"
    )
    redis = r.get(REDIS_ROW)
    rows = [
        [
            name,
            spread(reg["lookups_per_s_runs"][name], 0),
            f"{1e3 / value:.3f}",
            f"{value * reg['blocks']:,.0f}",
            "-" if redis is None else value / redis,
        ]
        for name, value in r.items()
    ]
    print_table(["registry", "lookups/s", "ms/lookup", "keys/s", "x redis"], rows)

    print("\ntargets")
    rows = [
        [
            r["ratio"],
            "n/a" if r["value"] is None else f"{r['value']:.2f}x",
            f">= {r['target']}x",
            {None: "-", True: "yes", False: "NO"}[r["met"]],
        ]
        for r in ratios
    ]
    print_table(["ratio", "value", "target", "met"], rows)
    if notes:
        print("\nnotes")
        for note in notes:
            print(f"- {note}")
    return ratios


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per loopback pull")
    parser.add_argument("--block-kib", type=int, default=2048, help="block size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--connections", default="1,2,4", help="loopback connection counts")
    parser.add_argument("--netns-mib", type=int, default=256, help="bytes per rate-limited pull")
    parser.add_argument("--rate-mbit", type=int, default=1000, help="each veth path's rate")
    parser.add_argument("--skip-netns", action="store_true", help="skip the two-path part")
    parser.add_argument("--lookup-s", type=float, default=0.5, help="seconds per lookup window")
    parser.add_argument("--json", default=None, help="default: the results scheme")
    parser.add_argument(
        "--peers-dir", default=None, help="the peers' environments (default: benchmarks/peers)"
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser_ = parser()
    args = parser_.parse_args(argv)
    if args.child:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run every finally block
        CHILDREN[args.child[0]](json.loads(args.child[1]))
        return 0
    if args.rate_mbit > 2000:
        parser_.error("--rate-mbit: at most 2000 (the paths must be slower than the CPUs)")
    run = Run("network")
    notes: list[str] = []
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # every finally runs
    try:
        with tempfile.TemporaryDirectory(prefix="tpusync-bench-net-") as work:
            cert = make_certificate(work, ["127.0.0.1", *(server for server, _ in PATHS)])
            if cert is None:
                notes.append("TLS: openssl not installed; the TLS rows are skipped")
            print(f"loopback pulls ({args.total_mib} MiB) ", end="", flush=True)
            loop = bench_loopback(args, cert, work, notes)
            net = None
            why = netns_unavailable(args)
            if why is None:
                print(f"two-path pulls ({args.netns_mib} MiB) ", end="", flush=True)
                net = bench_netns(args, cert, work, notes)
            else:
                notes.append(f"two paths: {why}")
            print("registry lookups", flush=True)
            reg = bench_registry(args.repeats, args.lookup_s, work, notes)
    finally:
        signal.signal(signal.SIGTERM, previous)
    ratios = report(args, loop, net, reg, notes)
    elapsed = time.perf_counter() - start
    print(f"\n{elapsed:.0f} s in all")
    payload = {
        "repeats": args.repeats,
        "loopback": loop,
        "two_paths": net,
        "registry": reg,
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "targets": ratios,
        "notes": notes,
        "seconds": elapsed,
    }
    run.write(args.json, payload)
    return 0
