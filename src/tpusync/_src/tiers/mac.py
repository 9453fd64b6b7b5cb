"""Keyed authentication of block files for tiers that others may write (``mac=True``).

A block's checksums (CRC-32C lanes combined by XXH64) catch damage, not forgery: they are
linear and unkeyed, so anyone who can write a tier's files can rewrite a payload together with
its checksum. With a MAC key, a block file also carries a Poly1305 tag (RFC 8439, native, GIL
released) over its payload, under a one-time key derived for that write:

    one-time key = BLAKE2b-256(key = tier MAC key, person = "tpusync-mac-v1",
                               data = header bytes || 16-byte random nonce)

The header bytes name the block (key, layout fingerprint, length, checksum, time, writer), so
a tag moved to another block or header fails; the random nonce makes every write's key fresh,
as Poly1305 requires. Without the tier's MAC key, which comes from the deployment secret and
never touches the tier, nobody can make a tag that verifies: a forged or unauthenticated block
is a miss.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from tpusync._native import mac as _mac
from tpusync.errors import InvalidArgumentError

__all__ = ["MAC_BYTES", "MacKey", "mac_key_from_secret"]

_PERSON = b"tpusync-mac-v1"
_SECTION = struct.Struct("<4s16s16s")  # marker, nonce, tag
_MARKER = b"MAC1"
MAC_BYTES = _SECTION.size


class MacKey:
    """A tier's MAC key (32 bytes); it seals and checks block payloads."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != 32:
            raise InvalidArgumentError("mac_key: expected 32 bytes (see mac_key_from_secret)")
        self._key = key

    def __repr__(self) -> str:
        return "MacKey(...)"  # never the key

    def _one_time_key(self, header: bytes, nonce: bytes) -> bytes:
        return hashlib.blake2b(
            header + nonce, key=self._key, person=_PERSON, digest_size=32
        ).digest()

    def seal(self, header: bytes, payload: memoryview | bytes) -> bytes:
        """The MAC section (``MAC_BYTES``) for a block whose header starts with ``header``."""
        nonce = os.urandom(16)
        tag = _mac.poly1305(self._one_time_key(header, nonce), payload)
        return _SECTION.pack(_MARKER, nonce, tag)

    def verify(self, header: bytes, section: bytes, payload: memoryview | bytes) -> str | None:
        """None if ``section`` authenticates ``header`` and ``payload``, else why not."""
        if len(section) < MAC_BYTES:
            return "no MAC"
        marker, nonce, tag = _SECTION.unpack_from(section)
        if marker != _MARKER:
            return "no MAC (written without mac=True, or damaged)"
        expected = _mac.poly1305(self._one_time_key(header, nonce), payload)
        if not hmac.compare_digest(expected, tag):
            return "MAC mismatch (forged or damaged)"
        return None


def mac_key_from_secret(secret: bytes, *, argument: str = "secret") -> MacKey:
    """The MAC key of block files, derived from the deployment secret (1 to 64 bytes)."""
    if not isinstance(secret, bytes) or not 1 <= len(secret) <= 64:
        raise InvalidArgumentError(f"{argument}: expected 1 to 64 bytes for a MAC key")
    return MacKey(
        hashlib.blake2b(b"block files", key=secret, person=_PERSON, digest_size=32).digest()
    )
