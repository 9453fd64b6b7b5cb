"""External programs the tests start (redis-server, ...): found on PATH, else the test skips
locally but fails in CI, so that CI (which installs them, see .ci/run) can never hide a test
behind a missing program.

CI is recognised by ``TPUSYNC_REQUIRE_TOOLS=1`` (.ci/run sets it) or by the ``CI`` variable most
CI services set (any value but empty, ``0`` or ``false``)."""

from __future__ import annotations

import os
import shutil

import pytest


def tools_required() -> bool:
    """Whether a missing program fails the test instead of skipping it."""
    if os.environ.get("TPUSYNC_REQUIRE_TOOLS") == "1":
        return True
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def require_tool(name: str, apt_package: str) -> str:
    """The path of program ``name``; where it is missing the test skips, or fails where
    :func:`tools_required` (the message names the program and the apt package)."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = (
        f"{name} is not installed: apt-get install {apt_package} "
        "(CI installs it; a missing tool fails there: TPUSYNC_REQUIRE_TOOLS=1 or CI set)"
    )
    if tools_required():
        pytest.fail(message)
    pytest.skip(message)


def skip_or_fail(message: str) -> None:
    """Skips the test where something it needs is missing (root, a kernel feature), or fails it
    where :func:`tools_required` (CI has all of it: a skip there would hide the test)."""
    if tools_required():
        pytest.fail(f"{message} (CI must run this test: TPUSYNC_REQUIRE_TOOLS=1 or CI set)")
    pytest.skip(message)
