"""`tpusync serve`: run a store node that lends this host's DRAM to other nodes.

    tpusync serve --dram 64GiB --secret-file /etc/tpusync/secret [--host 0.0.0.0 --port 7400]
                  [--registry-port 7401 | --registry tcp://host:port | redis://host:6379/0]
                  [--name NAME] [--layouts N] [--disk DIR --disk-size 500GiB]
                  [--tls-cert C --tls-key K [--tls-ca CA]]

The secret file holds the cluster's shared secret: hex text (``secrets.token_hex(32)``) or raw
bytes, at least 16 bytes either way. Off loopback the node serves TLS only (``--tls-cert`` and
``--tls-key``), unless ``--insecure``. It runs until SIGTERM or SIGINT, then unregisters and
exits 0. ``--ready-json`` (or ``--json``) prints one JSON line (its addresses) once it listens,
for scripts. ``tpusync health HOST:PORT --secret-file F`` probes it (each port: data plane,
embedded registry).

No peer can stop it (every fault a peer causes costs that peer its connection). A loop of ours
that dies of a bug is restarted; one that keeps dying (more than 5 times in a minute) makes the
command exit 1 with the traceback, so that its supervisor (systemd, Kubernetes) restarts it: a
process that stayed up without accepting would never be restarted.

Before it listens it checks that this host can give what it is asked to lend: ``--dram`` against
the memory available (and, with ``--name``, the room in ``--shm-dir``, a directory of this user
or root that others may write only if it is sticky, as /dev/shm), ``--disk`` exists, is
writable, and is this user's alone (not a symlink, not writable by group or others),
``--disk-size`` (which needs ``--disk``) against its free room. The secret file must be this
user's, mode 0600 (:func:`tpusync.kv.load_secret`). A refused argument (a bad size, path or flag)
exits 2 with a message naming the flag, and prints no ready line; other failures exit 1
(the convention of every `tpusync` command, see :mod:`tpusync._src.cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import ssl
import sys
import threading
import traceback
from typing import Any

from tpusync._src.cli_common import RUNTIME_ERROR, USAGE_ERROR, DefaultsHelpFormatter, port_number
from tpusync._src.cli_common import flag_message as _flag_message
from tpusync._src.cluster.registry import RedisRegistry, RemoteRegistry
from tpusync._src.cluster.registry.server import is_loopback
from tpusync._src.cluster.store_node import StoreNode
from tpusync._src.kv.config_dict import client_tls
from tpusync._src.kv.secret import load_secret
from tpusync.errors import InvalidArgumentError, TierFullError, TpuSyncError, UnsafeFileError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
# StoreNode's arguments as this command's flags, for the messages of a refused argument
_FLAGS = {
    "dram_bytes": "--dram",
    "disk_bytes": "--disk-size",
    "disk_dir": "--disk",
    "shm_dir": "--shm-dir",
    "max_layouts": "--layouts",
    "registry_port": "--registry-port",
    "node_id": "--node-id",
    "ttl_s": "--ttl",
    "lease_max_s": "--lease-max",
    "name": "--name",
    "port": "--port",
    "host": "--host",
}


def flag_message(message: str) -> str:
    """``message`` with StoreNode's argument names as this command's flags."""
    return _flag_message(message, _FLAGS)


def parse_size(text: str, argument: str = "--dram") -> int:
    """``"64GiB"``, ``"512M"``, ``"1.5g"`` or a byte count, as bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgumentError(
            f"{argument}: expected a size like 512MiB or 64GiB, got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def read_secret(path: str) -> bytes:
    """The shared secret in ``path``: hex text, or raw bytes (:func:`tpusync.kv.load_secret`)."""
    return load_secret(path, argument="--secret-file")


def _server_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_cert and not args.tls_key:
        return None
    if not (args.tls_cert and args.tls_key):
        raise InvalidArgumentError("--tls-cert, --tls-key: give both (or neither)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgumentError(
            f"--tls-cert, --tls-key: cannot load {args.tls_cert} with {args.tls_key} (PEM "
            f"certificate chain and its private key): {exc}"
        ) from None
    return context


def _registry(args: argparse.Namespace, secret: bytes) -> Any:
    url = args.registry
    if url is None:
        return None
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisRegistry(url)
    if url.startswith("tcp://"):
        tls = _client_tls(args.tls_ca) if args.tls_ca else None
        return RemoteRegistry(
            url.removeprefix("tcp://"), secret=secret, tls=tls, insecure=args.insecure
        )
    raise InvalidArgumentError(
        f"--registry: expected tcp://host:port or redis://host:port/db, got {url!r}"
    )


def _client_tls(ca_file: str) -> ssl.SSLContext:
    return client_tls(ca_file, "--tls-ca")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpusync serve",
        description="Run a store node: lend this host's DRAM to other nodes as a lower tier.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--dram", default="1GiB", help="DRAM to lend")
    parser.add_argument("--secret-file", required=True, help="the cluster's shared secret")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=port_number, default=0, help="data-plane port (0: a free one)"
    )
    parser.add_argument("--layouts", type=int, default=1, help="models sharing the DRAM")
    parser.add_argument(
        "--name",
        help="keep the DRAM in /dev/shm under this name (it survives restarts, and clients on "
        "this host, as this user, read blocks from it instead of over TCP)",
    )
    parser.add_argument("--shm-dir", default="/dev/shm", help="where named pools live")
    parser.add_argument("--disk", help="also lend local disk: a directory for its block files")
    parser.add_argument("--disk-size", help="disk to lend with --disk (e.g. 500GiB)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--registry", help="publish to tcp://host:port or redis://host:port/db")
    where.add_argument(
        "--registry-port",
        type=port_number,
        help="host the embedded registry on this port (0: a free one)",
    )
    parser.add_argument("--node-id", help="this node's id in the registry")
    parser.add_argument("--ttl", type=float, default=10.0, help="registry lease seconds")
    parser.add_argument(
        "--lease-max",
        type=float,
        help="the longest a peer may hold a lease on blocks, renewals included, and take to "
        "read a get or send a put (seconds; default 600)",
    )
    parser.add_argument("--tls-cert", help="certificate chain (PEM) for TLS")
    parser.add_argument("--tls-key", help="private key (PEM) for TLS")
    parser.add_argument("--tls-ca", help="CA bundle to verify a tcp:// registry")
    parser.add_argument(
        "--insecure", action="store_true", help="allow plaintext off loopback (trusted nets)"
    )
    parser.add_argument(
        "--ready-json",
        "--json",
        dest="ready_json",
        action="store_true",
        help="once listening, print its addresses as one JSON line instead of the banner",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not is_loopback(args.host) and not args.insecure and not args.tls_cert:
            raise InvalidArgumentError(
                f"--host: {args.host} is not a loopback address: serve TLS with --tls-cert and "
                "--tls-key, or pass --insecure to send blocks in the clear (trusted networks)"
            )
        if args.disk_size is not None and args.disk is None:
            raise InvalidArgumentError(
                f"--disk-size: {args.disk_size} given without --disk; add --disk DIR (a "
                "directory of this user's for the block files) or leave --disk-size out"
            )
        secret = read_secret(args.secret_file)
        node = StoreNode(
            parse_size(args.dram),
            secret=secret,
            host=args.host,
            port=args.port,
            max_layouts=args.layouts,
            name=args.name,
            shm_dir=args.shm_dir,
            registry=_registry(args, secret),
            registry_port=args.registry_port,
            disk_dir=args.disk,
            disk_bytes=parse_size(args.disk_size or "0", "--disk-size") if args.disk else 0,
            node_id=args.node_id,
            ttl_s=args.ttl,
            lease_max_s=args.lease_max,
            tls=_server_tls(args),
            insecure=args.insecure,
        )
    except (InvalidArgumentError, TierFullError, UnsafeFileError) as exc:  # a flag refused
        print(f"tpusync serve: {flag_message(str(exc))}", file=sys.stderr)
        return USAGE_ERROR
    except (TpuSyncError, OSError, ssl.SSLError) as exc:
        print(f"tpusync serve: {flag_message(str(exc))}", file=sys.stderr)
        return RUNTIME_ERROR
    # Process-wide state changes only once it serves (a refused start leaves the caller's
    # handlers and logging as they were), and the signal handlers are put back after.
    logging.basicConfig(level=logging.INFO, format="tpusync serve: %(message)s")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    try:
        failure = _serve(node, args, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        loop, error = failure
        trace = "".join(traceback.format_exception(error)).rstrip()
        print(
            f"tpusync serve: {loop} kept dying; exiting so that a supervisor restarts this "
            f"process. Its last traceback:\n{trace}",
            file=sys.stderr,
            flush=True,
        )
        return RUNTIME_ERROR
    return 0


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _serve(
    node: StoreNode, args: argparse.Namespace, stop: threading.Event
) -> tuple[str, BaseException] | None:
    """Serves until ``stop`` is set (a signal) or a loop of the node is given up on; returns
    that failure (the loop and its last exception), or None."""
    failures: list[tuple[str, BaseException]] = []

    def failed(loop: str, exc: BaseException) -> None:
        failures.append((loop, exc))
        stop.set()

    node.on_failure(failed)
    with node:
        ready = {"address": node.address, "registry": node.registry_address}
        if args.ready_json:
            print(json.dumps(ready), flush=True)
        else:
            print(
                f"tpusync serve: lending {args.dram} at {node.address}"
                + (f", registry at {node.registry_address}" if node.registry_address else ""),
                flush=True,
            )
        while not stop.wait(1.0):  # a timed wait: signal handlers run in between
            pass
        used = sum(p.used for p in node.server.pools)
        print(f"tpusync serve: stopping ({used} blocks held)", file=sys.stderr, flush=True)
    return failures[0] if failures else None
