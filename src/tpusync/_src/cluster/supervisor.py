"""Keeps a server's loop thread running (the handshake loop, a lease table's expiry loop, a
registry link's loop).

Every fault a peer can cause is handled inside the loops themselves: it costs that peer its
connection and nothing else. An exception that still ends a loop is a bug of ours, and a server
whose loop has ended would stay alive but deaf (its listen queue fills, no supervisor notices).
So :class:`SupervisedLoop` logs the traceback, resets the loop's state and starts it again after
a short pause (doubling, up to a second). A loop that dies more than ``max_restarts`` times within
``window_s`` is failing on every turn: restarting it again only hides that, so the supervisor
gives up on it and tells its owner (``on_failure``), which stops listening and reports the
failure (``tpusync serve`` exits non-zero, with the traceback, for its own supervisor to restart
the process).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable

__all__ = ["MAX_RESTARTS", "RESTART_WINDOW_S", "SupervisedLoop", "failure_line"]

log = logging.getLogger("tpusync.cluster")

MAX_RESTARTS = 5  # deaths within RESTART_WINDOW_S that are restarted; one more gives up
RESTART_WINDOW_S = 60.0
FIRST_PAUSE_S = 0.05  # before the first restart; doubles with each death in the window
LAST_PAUSE_S = 1.0


def failure_line(exc: BaseException) -> str:
    """``"TypeError: message"``: an exception on one line (for health reports)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class SupervisedLoop:
    """Runs ``run`` on a daemon thread named ``name`` and starts it again when it raises (see the
    module docstring). ``run`` returns when its owner closed it; :meth:`stop` (called by the
    owner as it closes) keeps a loop that raises meanwhile from being started again.

    Args:
      run: the loop; it returns only once its owner has closed it.
      name: the thread's name, and the loop's in log lines.
      reset: called before each restart (e.g. to drop connections left half-handled); an
        exception there counts as one more death.
      on_failure: called once, with the last exception, when the loop is given up on.
      max_restarts, window_s: the loop is given up on at its ``max_restarts + 1``-th death
        within ``window_s`` seconds.
    """

    def __init__(
        self,
        run: Callable[[], None],
        *,
        name: str,
        reset: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        max_restarts: int = MAX_RESTARTS,
        window_s: float = RESTART_WINDOW_S,
    ) -> None:
        self.name = name
        self._run, self._reset, self._on_failure = run, reset, on_failure
        self._max_restarts, self._window = max_restarts, window_s
        self._stopping = threading.Event()
        self.restarts = 0  # how many times the loop was started again (a counter)
        self.failure: BaseException | None = None  # set when the loop was given up on
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the loop's thread runs (also while it pauses before a restart)."""
        return self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No restart from now on (the owner is closing); the loop itself is told by its owner."""
        self._stopping.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _supervise(self) -> None:
        deaths: collections.deque[float] = collections.deque()
        first = True
        while True:
            try:
                if not first and self._reset is not None:
                    self._reset()
                first = False
                self._run()
                return  # the owner closed it
            except BaseException as exc:  # whatever it was, the loop has ended
                if self._stopping.is_set():
                    log.debug("%s ended while closing: %r", self.name, exc)
                    return
                now = time.monotonic()
                deaths.append(now)
                while deaths and deaths[0] < now - self._window:
                    deaths.popleft()
                if len(deaths) > self._max_restarts:
                    self._give_up(exc, len(deaths))
                    return
                log.error(
                    "%s died (a bug: please report it); starting it again (%d death(s) in the "
                    "last %g s; more than %d gives up on it)",
                    self.name, len(deaths), self._window, self._max_restarts, exc_info=exc,
                )  # fmt: skip
                self.restarts += 1
                pause = min(LAST_PAUSE_S, FIRST_PAUSE_S * 2 ** (len(deaths) - 1))
                if self._stopping.wait(pause):
                    return

    def _give_up(self, exc: BaseException, deaths: int) -> None:
        self.failure = exc
        log.critical(
            "%s died %d times in %g s; giving up on it: %s\n%s",
            self.name, deaths, self._window, failure_line(exc),
            "".join(traceback.format_exception(exc)).rstrip(),
        )  # fmt: skip
        if self._on_failure is not None:
            try:
                self._on_failure(exc)
            except Exception:  # the owner's handler must not hide the failure it reports
                log.exception("%s: reporting its failure failed", self.name)
