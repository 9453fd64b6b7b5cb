"""External programs the tests start (redis-server, ...): found on PATH, else the test skips
locally but fails in CI, so that CI (which installs them, see .ci/run) can never hide a test
behind a missing program.

CI is recognised by ``TPUSYNC_REQUIRE_TOOLS=1`` (.ci/run sets it) or by the ``CI`` variable most
CI services set (any value but empty, ``0`` or ``false``)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from pathlib import Path

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


def self_signed_tls(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a fresh self-signed certificate for 127.0.0.1 (made by the openssl
    command in ``folder``) and a client context that trusts only it."""
    require_tool("openssl", "openssl")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))
