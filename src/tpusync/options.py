"""The process's runtime options: one typed dataclass, read from the environment once.

Every layer may take :class:`Options` (it sits beside :mod:`tpusync.errors`, at the bottom), and
none reads ``os.environ`` itself: the facade (``import tpusync``) calls :func:`from_environment`
once and makes its answer the process's :func:`current` options. Tests and benchmarks switch
behaviour with :func:`set_current` or :func:`overridden`, never by changing the environment.

Environment variables (documented overrides of the defaults, read only by
:func:`from_environment`):

``TPUSYNC_COPY_THREADS``
    threads of the native copy engine (default: one per usable core, at most 8); read when the
    engine starts, on the first native copy.
``TPUSYNC_PJRT``
    ``1``: ``path="auto"`` picks the PJRT engine on platforms where it is not yet proven on
    hardware (default: only proven platforms).
``TPUSYNC_PJRT_STAGE_BELOW``
    PJRT device reads smaller than this many bytes are gathered on the device first (default
    1 MiB; 0 turns staging off).
``TPUSYNC_HUGE_PAGES``
    ``0``: CPU device pools and /dev/shm host pools are not collapsed into huge pages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tpusync.errors import InvalidArgumentError

__all__ = ["Options", "current", "from_environment", "overridden", "set_current"]

DEFAULT_STAGE_BELOW = 1 << 20


@dataclass(frozen=True)
class Options:
    """What the transfer engine may be told at run time.

    Attributes:
      copy_threads: threads of the native copy engine; None: one per usable core, at most 8.
      pjrt: ``path="auto"`` picks the PJRT engine also on platforms not proven on hardware.
      pjrt_stage_below: PJRT device reads below this many bytes are gathered on the device
        first; 0 turns that off.
      huge_pages: CPU device pools and /dev/shm host pools are collapsed into huge pages in
        the background.
    """

    copy_threads: int | None = None
    pjrt: bool = False
    pjrt_stage_below: int = DEFAULT_STAGE_BELOW
    huge_pages: bool = True

    def __post_init__(self) -> None:
        threads = self.copy_threads
        if threads is not None and (type(threads) is not int or threads < 1):
            raise InvalidArgumentError(
                f"copy_threads: expected a positive int or None, got {threads!r}"
            )
        stage = self.pjrt_stage_below
        if type(stage) is not int or stage < 0:
            raise InvalidArgumentError(
                f"pjrt_stage_below: expected a non-negative int of bytes, got {stage!r}"
            )
        for name in ("pjrt", "huge_pages"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"{name}: expected True or False, got {getattr(self, name)!r}"
                )


def _int_variable(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(
            f"{name}: expected an integer, got {text!r}; fix or unset the environment variable"
        ) from None


def from_environment(environ: Mapping[str, str] | None = None) -> Options:
    """The options that the ``TPUSYNC_*`` variables of ``environ`` (default: this process's
    environment) ask for, over the defaults (see the module docstring)."""
    environ = os.environ if environ is None else environ
    threads = _int_variable(environ, "TPUSYNC_COPY_THREADS")
    stage = _int_variable(environ, "TPUSYNC_PJRT_STAGE_BELOW")
    return Options(
        copy_threads=None if threads is None else max(1, threads),
        pjrt=environ.get("TPUSYNC_PJRT") == "1",
        pjrt_stage_below=DEFAULT_STAGE_BELOW if stage is None else max(0, stage),
        huge_pages=environ.get("TPUSYNC_HUGE_PAGES", "1") != "0",
    )


_current = Options()
_lock = threading.Lock()


def current() -> Options:
    """The process's options now (the defaults until the facade or :func:`set_current` sets
    them)."""
    return _current


def set_current(options: Options) -> Options:
    """Makes ``options`` the process's options; returns the previous ones (to restore)."""
    global _current
    if not isinstance(options, Options):
        raise InvalidArgumentError(
            f"options: expected tpusync.options.Options, got {type(options).__name__}"
        )
    with _lock:
        previous, _current = _current, options
    return previous


@contextlib.contextmanager
def overridden(**changes: Any) -> Iterator[Options]:
    """``with overridden(pjrt_stage_below=0): ...``: the current options with ``changes``,
    restored on exit (for tests and benchmarks)."""
    previous = set_current(dataclasses.replace(current(), **changes))
    try:
        yield current()
    finally:
        set_current(previous)
