"""What every `tpusync` command shares: argument types, help that shows defaults, messages that
name flags, and a quiet end when the reader of stdout goes away.

The exit codes of every command: 0 done; 2 a usage error (argparse's convention: the command line
is malformed, or a value is refused before anything runs); 1 a runtime failure (the command ran
and failed). Errors go to stderr, as ``tpusync CMD: message`` naming the flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping

__all__ = [
    "RUNTIME_ERROR",
    "USAGE_ERROR",
    "DefaultsHelpFormatter",
    "exit_quietly_on_broken_pipe",
    "flag_message",
    "have_matplotlib",
    "int_at_least",
    "port_number",
]

USAGE_ERROR = 2  # argparse's exit code for a bad command line
RUNTIME_ERROR = 1

_ARGUMENT = re.compile(r"^([a-z_]+):")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends each option with ``(default: X)``, except where there is no default
    (``None``) or it is an off switch (``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a TCP port from 0 to 65535 (0: a free one), got {text!r}"
        )
    return port


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def have_matplotlib() -> bool:
    """Whether matplotlib (for the commands' --plot) can be imported; a module set to None in
    sys.modules cannot."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # sys.modules["matplotlib"] is None: imports of it are blocked
        return False


def flag_message(message: str, flags: Mapping[str, str]) -> str:
    """``message`` (a library error's) with the Python argument names in ``flags`` written as
    the command's flags: the leading ``name:`` and any ``snake_case`` name found in the text."""
    message = _ARGUMENT.sub(lambda m: f"{flags.get(m.group(1), m.group(1))}:", message, count=1)
    names = [k for k in flags if "_" in k]
    if not names:
        return message
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: flags[m[1]], message)


def exit_quietly_on_broken_pipe(command: Callable[[], int]) -> int:
    """Runs ``command`` and flushes stdout; when the reader has closed the pipe (``tpusync info
    | head``), returns 0 with no traceback, as the reader chose to stop reading."""
    try:
        try:
            return command()
        finally:  # also after argparse's SystemExit (`--help | head`)
            sys.stdout.flush()
    except BrokenPipeError:
        # stdout now points at /dev/null, so the interpreter's last flush of what the reader
        # did not take cannot fail a second time at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
