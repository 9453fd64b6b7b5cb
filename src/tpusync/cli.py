"""The `tpusync` command: info and demo (more commands arrive with the tiers and cluster)."""

from __future__ import annotations

import argparse
import json
import sys


def _info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tpusync info", description="Paths and host limits.")
    parser.add_argument("--dir", help="directory to check O_DIRECT in (default: temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    from tpusync.info import info

    report = info(args.dir)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"info": _info, "demo": None}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: tpusync {info,demo} [options]\n\n"
            "  info   which engine each device gets and why; host limits\n"
            "  demo   offload and reload scattered KV blocks, verify bits, show GB/s"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from tpusync.demo import main as demo_main

        return demo_main(argv[1:])
    return _info(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
