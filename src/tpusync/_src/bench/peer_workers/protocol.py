"""The line protocol between a benchmark and its child processes, peers' included: the child
answers each JSON line on its stdin with one JSON line on stdout marked with :data:`PREFIX`
(anything else a library prints there is noise), and exits at EOF on stdin. Plain Python, so a
peer's interpreter can run it without tpusync installed."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

PREFIX = "@tpsbench "


def reply(message: dict[str, Any]) -> None:
    """Writes one answer line."""
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Answers each JSON line on stdin with ``handle(request)`` (or the error it raised) until
    EOF."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply(handle(json.loads(line)))
        except Exception:
            reply({"error": traceback.format_exc()})


def config_from_argv(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """``--child KIND CONFIG`` -> (kind, config); anything else exits with a usage line."""
    if len(argv) != 4 or argv[1] != "--child":
        sys.exit(f"usage: {argv[0]} --child KIND JSON_CONFIG")
    return argv[2], json.loads(argv[3])
