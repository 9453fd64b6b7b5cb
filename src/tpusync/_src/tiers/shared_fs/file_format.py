"""The shared-FS tier's block file format, version 1: its header and the errors a reader's
checks raise (see :mod:`tpusync._src.tiers.shared_fs.pool`)."""

from __future__ import annotations

import re
import socket
import struct
from dataclasses import dataclass

from tpusync._native import core as _core
from tpusync._src.tiers.blocks import CHECKSUM_SCHEME, MAX_KEY_BYTES

MAGIC = b"TPUSYNCB"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
SUFFIX = ".blk"
TEMP_MARK = ".tmp-"
WRITER_BYTES = 64

# magic, version, header bytes, key length, checksum scheme, reserved, key, fingerprint,
# payload length, payload checksum, written at (ns), writer
_FIXED = struct.Struct("<8sIIHHI32s16sQQQ64s")
_CHECK = struct.Struct("<Q")
HEADER_USED = _FIXED.size + _CHECK.size  # 168: the rest of the 4096 bytes are zeros
DURABILITY = ("commit", "none")

_FANOUT = re.compile(r"^[0-9a-f]{2}$")
_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:48] or "host"


_STAT_PROBE = 8  # keys whose stat times tell a local filesystem from a shared one
_FAST_STAT_S = 50e-6  # a local or cached stat: microseconds; a network round trip: far more


@dataclass(frozen=True)
class BlockHeader:
    """The fields of one block file's header (see the module docstring)."""

    key: bytes
    fingerprint: bytes
    payload_bytes: int
    checksum: int
    written_ns: int
    writer: str
    version: int = FORMAT_VERSION
    checksum_scheme: int = CHECKSUM_SCHEME


class _Corrupt(Exception):
    """A block file that is not a whole, valid block (the reason is the message)."""


class _Foreign(Exception):
    """A block file of another format version or checksum scheme: a miss, left in place."""


def encode_block_header(
    key: bytes,
    fingerprint: bytes,
    payload_bytes: int,
    checksum: int,
    *,
    written_ns: int,
    writer: str,
) -> bytes:
    """The 4096-byte header of a block file."""
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        len(key),
        CHECKSUM_SCHEME,
        0,
        key,
        fingerprint,
        payload_bytes,
        checksum,
        written_ns,
        writer.encode()[:WRITER_BYTES],
    )
    return (fixed + _CHECK.pack(_core.xxh64(fixed))).ljust(HEADER_BYTES, b"\0")


def decode_block_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """Parses a header; raises ``_Corrupt`` or ``_Foreign`` saying what is wrong."""
    data = bytes(data[:HEADER_USED])
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise _Corrupt("not a tpusync block file (bad magic)")
    if len(data) < HEADER_USED:
        raise _Corrupt(f"truncated header ({len(data)} bytes)")
    fields = _FIXED.unpack_from(data)
    version = fields[1]
    if version != FORMAT_VERSION:
        raise _Foreign(f"block format version {version}; this build reads {FORMAT_VERSION}")
    (stored,) = _CHECK.unpack_from(data, _FIXED.size)
    if stored != _core.xxh64(data[: _FIXED.size]):
        raise _Corrupt("header checksum mismatch")
    _, _, header_bytes, key_len, scheme, _, key, fingerprint, length, checksum, at, writer = fields
    if header_bytes != HEADER_BYTES or not 1 <= key_len <= MAX_KEY_BYTES:
        raise _Corrupt("header sizes out of range")
    if scheme != CHECKSUM_SCHEME:
        raise _Foreign(f"checksum scheme {scheme}; this build uses {CHECKSUM_SCHEME}")
    return BlockHeader(
        key=key[:key_len],
        fingerprint=fingerprint,
        payload_bytes=length,
        checksum=checksum,
        written_ns=at,
        writer=writer.rstrip(b"\0").decode(errors="replace"),
    )
