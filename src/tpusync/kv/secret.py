"""Loading the deployment secret from a file: the one reader behind every ``secret=`` argument.

Generate the file once and give the same one to every host and process of a deployment::

    python -c "import secrets; print(secrets.token_hex(32))" > secret && chmod 600 secret

``tpusync serve --secret-file`` reads it with :func:`load_secret`; in a program, pass
``load_secret(path)`` to ``KVStoreConfig(secret=...)``, the cluster's servers and clients and
the tier specs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tpusync.errors import InvalidArgumentError

__all__ = ["load_secret"]

MIN_SECRET_BYTES = 16  # what the cluster's handshake requires of a secret
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")


def load_secret(path: str | os.PathLike[str], *, argument: str = "path") -> bytes:
    """The deployment secret in the file at ``path``, as the bytes ``secret=`` arguments take.

    The file holds hex text (``secrets.token_hex(32)``; surrounding whitespace is ignored), or
    else raw bytes, taken as they are. Either way at least 16 bytes. Raises
    :class:`~tpusync.errors.InvalidArgumentError`, naming ``argument``, when the file cannot be
    read or holds too short a secret.
    """
    if not isinstance(path, str | os.PathLike):
        raise InvalidArgumentError(f"{argument}: expected a file path, got {path!r}")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(
            f"{argument}: cannot read {os.fspath(path)}: {exc.strerror or exc}"
        ) from None
    text = data.strip()
    secret = bytes.fromhex(text.decode()) if _HEX.fullmatch(text) else data
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"{argument}: {os.fspath(path)} holds a secret of {len(secret)} bytes, at least "
            f"{MIN_SECRET_BYTES} needed (e.g. python -c 'import secrets; "
            "print(secrets.token_hex(32))' > secret)"
        )
    return secret
