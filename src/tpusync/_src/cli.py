"""The `tpusync` command: info, demo, shm, serve, health, bench.

    tpusync --version | version
    tpusync --help | help [COMMAND]
    tpusync info [--dir DIR] [--json]
    tpusync demo [...] | tpusync demo --transfer [...]
    tpusync shm [--dir DIR] {list [--json], remove [NAME | --name NAME] [--force]}
        (--dir before or after; --shm-dir and --name as `tpusync serve` takes them)
    tpusync serve --dram 64GiB --secret-file FILE [...]
    tpusync health HOST:PORT --secret-file FILE [--tls-ca PEM] [...]

Exit codes, the same for every command: 0 done; 2 a usage error (argparse's convention: an
unknown command or flag, a malformed value, a value refused before anything runs, such as a
port outside 0..65535); 1 a runtime failure (the command ran and failed: a pool that is not
there, an I/O or network error). Errors go to stderr as ``tpusync CMD: message``, naming the
flag (``--dram``, never the library's ``dram_bytes``). Output piped into a reader that stops
early (``tpusync info | head``) ends quietly with exit 0.

Each command's module is imported when that command runs: ``--version`` and ``--help`` answer
without importing JAX (tests/cli/test_cli_conventions.py checks that they import none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable

from tpusync._src.cli_common import (
    RUNTIME_ERROR,
    USAGE_ERROR,
    DefaultsHelpFormatter,
    exit_quietly_on_broken_pipe,
    flag_message,
)
from tpusync._version import __version__
from tpusync.errors import TpuSyncError

# shm_admin's argument names as `tpusync shm`'s flags
_SHM_FLAGS = {"name": "NAME", "shm_dir": "--dir", "force": "--force"}
_DIR_HELP = "where the pools live (--shm-dir: the same, as `tpusync serve` spells it)"


def _info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tpusync info",
        description="Paths and host limits.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--dir", help="directory to check O_DIRECT in (default: temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    from tpusync._src.info import info  # a command's module, when it runs (JAX)

    report = info(args.dir)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report)
    return 0


def _shm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpusync shm", description="Named host pools.", formatter_class=DefaultsHelpFormatter
    )
    # --shm-dir and --name as `tpusync serve` spells them, so its flags can be copied here
    parser.add_argument("--dir", "--shm-dir", dest="dir", default="/dev/shm", help=_DIR_HELP)
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser(
        "list",
        help="pools, owners, fingerprints, sizes, blocks used; damaged and stale files",
        formatter_class=DefaultsHelpFormatter,
    )
    listing.add_argument("--json", action="store_true", help="print JSON: one object per pool")
    remove = sub.add_parser(
        "remove",
        help="free a pool, its stale temporary files and its session manifests (refused while "
        "its owner lives); without NAME, free every stale temporary file",
        formatter_class=DefaultsHelpFormatter,
    )
    remove.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="the pool's name; where no pool has it, the pools of the store node `tpusync "
        "serve --name NAME` ran (one per block layout)",
    )
    remove.add_argument(
        "--name",
        dest="name_flag",
        metavar="NAME",
        help="the same as NAME, spelled as `tpusync serve` takes it",
    )
    remove.add_argument("--force", action="store_true", help="remove even if its owner lives")
    for action in (listing, remove):
        # as users type it, after the action too; SUPPRESS keeps a --dir given before
        action.add_argument(
            "--dir", "--shm-dir", dest="dir", default=argparse.SUPPRESS, help=_DIR_HELP
        )
    return parser


def _shm(argv: list[str]) -> int:
    parser = _shm_parser()
    args = parser.parse_args(argv)
    if args.action == "remove" and args.name_flag is not None:
        if args.name is not None and args.name != args.name_flag:
            parser.error(f"NAME, --name: two names ({args.name}, {args.name_flag}); give one")
        args.name = args.name_flag
    if not os.path.exists(args.dir):  # a typo would otherwise list no pools and exit 0
        parser.error(f"--dir: {args.dir} does not exist")
    if not os.path.isdir(args.dir):
        parser.error(f"--dir: {args.dir} is not a directory")
    try:
        return _shm_remove(args) if args.action == "remove" else _shm_list(args.dir, args.json)
    except BrokenPipeError:  # the reader of stdout left: not a failure of the command
        raise
    except (TpuSyncError, OSError) as exc:
        print(f"tpusync shm {args.action}: {_shm_error(exc, args.dir)}", file=sys.stderr)
        return RUNTIME_ERROR


def _shm_error(exc: Exception, shm_dir: str) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, TpuSyncError) and exc.strerror:
        where = exc.filename if exc.filename is not None else shm_dir
        return f"--dir {shm_dir}: {where}: {exc.strerror}"
    return flag_message(str(exc), _SHM_FLAGS)


def _shm_remove(args: argparse.Namespace) -> int:
    from tpusync._src.tiers.dram.shm_admin import (  # when it runs
        remove_pools,
        remove_stale,
        size_text,
    )

    if args.name is None:
        removed = remove_stale(args.dir)
        if not removed.paths:
            print(f"no stale tpusync files in {args.dir}")
    else:
        removed = remove_pools(args.name, force=args.force, shm_dir=args.dir)
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


def _shm_list(shm_dir: str, as_json: bool = False) -> int:
    from tpusync._src.tiers.dram.shm_admin import (  # a command's module, when it runs
        list_pools,
        size_text,
    )

    pools = list_pools(shm_dir)
    if as_json:
        print(json.dumps([dataclasses.asdict(p) for p in pools], indent=2))
        return 0
    if not pools:
        print(f"no tpusync pools in {shm_dir}")
        return 0
    # one row of cells per pool; an entry that is not a pool has its name, owner and a note
    header = ("name", "owner", "model", "fingerprint", "size", "used")
    rows: list[tuple[str, ...]] = []
    for p in pools:
        owner = f"alive {p.owner_pid}" if p.owner_alive else "gone"
        if p.status in ("unsafe", "orphaned"):
            owner = "-"
        if p.status != "ok":
            size = f" ({size_text(p.size_bytes)})" if p.size_bytes else ""
            rows.append((p.name, owner, f"{p.status}{size}: {p.error}"))
            continue
        links = f"  ({p.links - 1} more hard link(s))" if p.links > 1 else ""
        used = f"{p.used}/{p.slots}"
        cells = (p.name, owner, p.model_id or "-", p.fingerprint or "-", size_text(p.size_bytes))
        rows.append((*cells, used + links))
    # columns as wide as their content (a note or the last column runs on unpadded)
    widths = [
        max(len(r[i]) for r in [header, *rows] if i < len(r) - 1) for i in range(len(header) - 1)
    ]
    right = {4}  # sizes align on their units
    for row in [header, *rows]:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row[:-1])
        ]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


def _demo(argv: list[str]) -> int:
    from tpusync._src.demo import main  # a command's module, when it runs (JAX)

    return main(argv)


def _serve(argv: list[str]) -> int:
    from tpusync._src.serve import main  # a command's module, when it runs (JAX)

    return main(argv)


def _health(argv: list[str]) -> int:
    from tpusync._src.health import main  # a command's module, when it runs

    return main(argv)


def _bench(argv: list[str]) -> int:
    from tpusync._src.bench.command import main  # a command's module, when it runs (JAX)

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "info": _info,
    "demo": _demo,
    "shm": _shm,
    "serve": _serve,
    "health": _health,
    "bench": _bench,
}

USAGE = """usage: tpusync [--version] [--help]
               {info,demo,shm,serve,health,bench,help,version} [options]

  info     which engine each device gets and why; host limits
  demo     prefix caching end to end: TTFT cold vs warm from each tier (--transfer: GB/s demo)
  shm      list or remove named host pools in /dev/shm
  serve    run a store node: lend this host's DRAM to other nodes (and host a registry)
  health   probe a tpusync server (a store node, registry, publisher): exit 0 when healthy
  bench    benchmarks against their physical limits (without a name: the list, with durations)
  help     this text; `tpusync help COMMAND`: that command's options
  version  the version (as --version)

`tpusync COMMAND --help` shows a command's options. Exit codes: 0 done, 2 a usage error,
1 a runtime failure."""


def _dispatch(argv: list[str]) -> int:
    if not argv:
        print(USAGE, file=sys.stderr)
        print("tpusync: error: a command is required", file=sys.stderr)
        return USAGE_ERROR
    first = argv[0]
    if first in ("-h", "--help", "help"):
        if first == "help" and argv[1:]:  # `tpusync help shm`: `tpusync shm --help`
            return _dispatch([argv[1], "--help"])
        print(USAGE)
        return 0
    if first in ("-V", "--version", "version"):
        print(f"tpusync {__version__}")
        return 0
    command = COMMANDS.get(first)
    if command is None:
        kind = "option" if first.startswith("-") else "command"
        print(USAGE, file=sys.stderr)
        print(
            f"tpusync: error: unknown {kind} {first!r} (choose from {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return USAGE_ERROR
    return command(argv[1:])


def main(argv: list[str] | None = None) -> int:
    """Runs the `tpusync` command line ``argv`` (``sys.argv[1:]`` by default); returns its exit
    code (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return exit_quietly_on_broken_pipe(lambda: _dispatch(args))


if __name__ == "__main__":
    sys.exit(main())
