"""The `tpusync` command: info, demo, shm, serve."""

from __future__ import annotations

import argparse
import json
import sys

from tpusync.demo import main as demo_main
from tpusync.errors import TpuSyncError
from tpusync.info import info
from tpusync.serve import main as serve_main
from tpusync.tiers.shm_admin import list_pools, remove_pool, remove_stale, size_text


def _info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tpusync info", description="Paths and host limits.")
    parser.add_argument("--dir", help="directory to check O_DIRECT in (default: temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    report = info(args.dir)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report)
    return 0


def _shm(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tpusync shm", description="Named host pools.")
    parser.add_argument("--dir", default="/dev/shm", help="where the pools live")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser(
        "list", help="pools, owners, fingerprints, sizes, blocks used; damaged and stale files"
    )
    remove = sub.add_parser(
        "remove",
        help="free a pool, its stale temporary files and its session manifests (refused while "
        "its owner lives); without NAME, free every stale temporary file",
    )
    remove.add_argument("name", nargs="?")
    remove.add_argument("--force", action="store_true", help="remove even if its owner lives")
    args = parser.parse_args(argv)
    try:
        return _shm_remove(args) if args.action == "remove" else _shm_list(args.dir)
    except (TpuSyncError, OSError) as exc:
        print(f"tpusync shm {args.action}: {exc}", file=sys.stderr)
        return 1


def _shm_remove(args: argparse.Namespace) -> int:
    if args.name is None:
        removed = remove_stale(args.dir)
        if not removed.paths:
            print(f"no stale tpusync files in {args.dir}")
    else:
        removed = remove_pool(args.name, force=args.force, shm_dir=args.dir)
    for path in removed.paths:
        print(f"removed {path}")
    if removed.freed_bytes:
        print(f"freed {size_text(removed.freed_bytes)}")
    if removed.links_left:
        print(
            f"warning: {removed.links_left} other hard link(s) of the pool keep its memory; "
            "find them with `find / -samefile` and remove them",
            file=sys.stderr,
        )
    return 0


def _shm_list(shm_dir: str) -> int:
    pools = list_pools(shm_dir)
    if not pools:
        print(f"no tpusync pools in {shm_dir}")
        return 0
    print(f"{'name':<28}{'owner':<14}{'model':<16}{'fingerprint':<34}{'GiB':>8}{'used':>14}")
    for p in pools:
        owner = f"alive {p.owner_pid}" if p.owner_alive else "gone"
        if p.status in ("unsafe", "orphaned"):
            owner = "-"
        if p.status != "ok":
            size = f" ({size_text(p.size_bytes)})" if p.size_bytes else ""
            print(f"{p.name:<28}{owner:<14}{p.status}{size}: {p.error}")
            continue
        used = f"{p.used}/{p.slots}"
        links = f"  ({p.links - 1} more hard link(s))" if p.links > 1 else ""
        print(
            f"{p.name:<28}{owner:<14}{p.model_id or '':<16}{p.fingerprint or '':<34}"
            f"{p.size_bytes / 2**30:>8.2f}{used:>14}{links}"
        )
    return 0


USAGE = """usage: tpusync {info,demo,shm,serve} [options]

  info   which engine each device gets and why; host limits
  demo   prefix caching end to end: TTFT cold vs warm from each tier (--transfer: GB/s demo)
  shm    list or remove named host pools in /dev/shm
  serve  run a store node: lend this host's DRAM to other nodes (and host a registry)"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("info", "demo", "shm", "serve"):
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        return demo_main(argv[1:])
    if argv[0] == "shm":
        return _shm(argv[1:])
    if argv[0] == "serve":
        return serve_main(argv[1:])
    return _info(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
