"""What the scripts left outside the package share (ab.py, network_tuning.py, the GPU
benchmarks): the helpers now live in :mod:`tpusync._src.bench.common`; ``write_json`` writes to the
path it is given, as ab.py expects."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

from tpusync._src.bench.common import commit_of, free_port, median, print_table, stop_process
from tpusync._src.bench.transfer import parser as _transfer_parser

__all__ = [
    "commit_of",
    "free_port",
    "median",
    "print_table",
    "stop_process",
    "transfer_arguments",
    "write_json",
]


def transfer_arguments(doc: str, json_default: str) -> Any:
    """The command line both transfer benchmarks (CPU and GPU) take."""
    return _transfer_parser(doc, json_default).parse_args()


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Writes a benchmark's results with the machine, the time, the load and the commit."""
    payload = {
        "commit": commit_of(os.path.dirname(os.path.abspath(__file__))),
        "machine": {
            "platform": platform.platform(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_end": list(os.getloadavg()),
        **payload,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
