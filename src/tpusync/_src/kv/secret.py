"""Loading the deployment secret from a file: the one reader behind every ``secret=`` argument.

Generate the file once and give the same one to every host and process of a deployment::

    python -c "import secrets; print(secrets.token_hex(32))" > secret && chmod 600 secret

``tpusync serve --secret-file`` reads it with :func:`load_secret`, and so do
``KVStoreConfig.from_dict`` (``"secret_file"``, the engine connectors' path) and its tier
sections; in a program, pass ``load_secret(path)`` to ``KVStoreConfig(secret=...)``, the
cluster's servers and clients and the tier specs. The same rules everywhere:

* the file is opened without following a symlink or waiting on a FIFO, and must be a regular
  file of this uid that neither its group nor others may read or write (mode 0600), of at most
  :data:`MAX_SECRET_FILE_BYTES`;
* it holds hex text (``secrets.token_hex(32)``; surrounding whitespace is ignored), or else raw
  bytes, taken as they are; either way at least :data:`MIN_SECRET_BYTES`.
"""

from __future__ import annotations

import os
import re

from tpusync._src.tiers.files import read_private_file
from tpusync.errors import InvalidArgumentError, UnsafeFileError

__all__ = ["MAX_SECRET_FILE_BYTES", "MIN_SECRET_BYTES", "check_secret", "load_secret"]

MIN_SECRET_BYTES = 16  # what the cluster's handshake requires of a secret
MAX_SECRET_FILE_BYTES = 4096  # far above any secret (64 bytes in hex: 129), far below a mistake
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")
_HOW = "e.g. python -c 'import secrets; print(secrets.token_hex(32))' > secret; chmod 600 secret"


def check_secret(secret: object, argument: str = "secret", *, at_most: int | None = None) -> bytes:
    """``secret`` if it is bytes of at least :data:`MIN_SECRET_BYTES` (and at most ``at_most``);
    else :class:`~tpusync.errors.InvalidArgumentError` naming ``argument`` and the fix."""
    if type(secret) is not bytes:
        raise InvalidArgumentError(
            f"{argument}: expected bytes (tpusync.kv.load_secret(path) reads a secret file), "
            f"got {type(secret).__name__}"
        )
    if len(secret) < MIN_SECRET_BYTES or (at_most is not None and len(secret) > at_most):
        bounds = f"{MIN_SECRET_BYTES} to {at_most}" if at_most else f"at least {MIN_SECRET_BYTES}"
        raise InvalidArgumentError(
            f"{argument}: a secret of {len(secret)} bytes; {bounds} needed (a short key lets "
            f"anyone guess it: secrets.token_bytes(32))"
        )
    return secret


def load_secret(path: str | os.PathLike[str], *, argument: str = "path") -> bytes:
    """The deployment secret in the file at ``path``, as the bytes ``secret=`` arguments take.

    See the module docstring for the file's rules. Never blocks: a FIFO, a device, a socket, a
    directory or a symlink at ``path`` is refused before anything is read. Raises
    :class:`~tpusync.errors.UnsafeFileError` (not a regular file, another uid's, readable or
    writable by others, too large) or :class:`~tpusync.errors.InvalidArgumentError` (missing,
    unreadable, too short a secret), each naming ``argument``, the path and the fix.
    """
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise InvalidArgumentError(f"{argument}: expected a file path, got {path!r}")
    where = os.fspath(path)
    try:
        data = read_private_file(path, MAX_SECRET_FILE_BYTES)
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"{argument}: {exc}") from None
    except OSError as exc:
        raise InvalidArgumentError(
            f"{argument}: cannot read {where}: {exc.strerror or exc}"
        ) from None
    text = data.strip()
    if _HEX.fullmatch(text):
        secret, read_as = bytes.fromhex(text.decode()), "hex text"
    else:
        secret, read_as = data, "raw bytes (it is not hex text)"
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"{argument}: {where} holds a secret of {len(secret)} bytes, read as {read_as}; at "
            f"least {MIN_SECRET_BYTES} needed ({_HOW})"
        )
    return secret
