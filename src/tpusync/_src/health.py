"""`tpusync health`: probe a tpusync server the way a supervisor's health check would.

    tpusync health HOST:PORT --secret-file F [--tls-ca PEM] [--timeout 5] [--insecure] [--json]

It connects, runs the authenticated handshake (TLS with ``--tls-ca``, the CA bundle that
verifies the server's certificate) and asks the server for its health, all within
``--timeout`` seconds. Exit 0: the server authenticated the probe and answered that all its loops
run (one line on stdout). Exit 1: it is not healthy, with one line on stderr saying which step
failed (nothing listens; no hello; no answer to the handshake; a wrong secret; TLS on one side
only; a loop that kept dying). Exit 2: a usage error (a malformed address, an unreadable secret
file or CA bundle). ``--json`` prints the result as one JSON line on stdout instead, whatever it is.

Every server kind answers it: a store node's data port and its embedded registry (``tpusync
serve``), a ``RegistryServer``, a ``BlockServer``, a weights ``Publisher``.
"""

from __future__ import annotations

import argparse
import json
import sys

from tpusync._src.cli_common import RUNTIME_ERROR, USAGE_ERROR, DefaultsHelpFormatter
from tpusync._src.cli_common import flag_message as _flag_message
from tpusync._src.cluster.probe import probe_health
from tpusync._src.kv.config_dict import client_tls
from tpusync._src.kv.secret import load_secret
from tpusync.errors import InvalidArgumentError

_FLAGS = {"timeout_s": "--timeout", "address": "HOST:PORT"}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpusync health",
        description="Probe a tpusync server (store node, registry, block server, weights "
        "publisher): a real authenticated handshake and a health request. Exit 0 healthy, "
        "1 not healthy (one line says why), 2 a usage error.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("address", metavar="HOST:PORT", help="the server's address")
    parser.add_argument("--secret-file", required=True, help="the cluster's shared secret")
    parser.add_argument("--tls-ca", help="CA bundle (PEM) that verifies a TLS server")
    parser.add_argument(
        "--insecure", action="store_true", help="allow plaintext off loopback (trusted nets)"
    )
    parser.add_argument("--timeout", type=_seconds, default=5.0, help="seconds for the whole probe")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        secret = load_secret(args.secret_file, argument="--secret-file")
        tls = client_tls(args.tls_ca, "--tls-ca") if args.tls_ca else None
        health = probe_health(
            args.address,
            secret=secret,
            tls=tls,
            insecure=args.insecure,
            timeout_s=args.timeout,
        )
    except InvalidArgumentError as exc:
        message = _flag_message(str(exc), _FLAGS).replace(
            "pass tls=ssl.SSLContext(...) (server side: with its certificate; client side: "
            "trusting it), or insecure=True",
            "give --tls-ca, or --insecure",
        )
        print(f"tpusync health: {message}", file=sys.stderr)
        return USAGE_ERROR
    if args.json:
        print(json.dumps({
            "address": health.address,
            "healthy": health.healthy,
            "reason": health.reason,
            "seconds": round(health.seconds, 6),
            "report": health.report,
        }))  # fmt: skip
    elif health.healthy:
        print(f"{health.address}: healthy: {health.reason} ({health.seconds * 1e3:.1f} ms)")
    else:
        print(f"tpusync health: {health.address}: not healthy: {health.reason}", file=sys.stderr)
    return 0 if health.healthy else RUNTIME_ERROR
