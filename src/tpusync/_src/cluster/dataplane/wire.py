"""The block frame of the TCP data plane (wire version 1).

Every block, and every other frame of a block response, starts with a fixed 96-byte header,
little-endian::

    offset size  field
         0    4  magic             b"TPSB"
         4    2  version           u16, 1
         6    2  frame type        u16: BLOCK=1, MISSING=2, ERROR=3, END=4
         8    8  request id        u64, the id of the JSON request this frame answers
        16    1  key length        u8: 1..32 for BLOCK and MISSING, 0 for ERROR and END
        17   32  key               the key, zero-padded to 32 bytes (padding must be zero)
        49   16  fingerprint       the sender's PoolLayout.fingerprint
        65    8  payload length    u64: BLOCK: the block's bytes; ERROR: a UTF-8 message;
                                   MISSING and END: 0
        73    2  checksum scheme   u16: BLOCK: a known scheme (CHECKSUM_SCHEME, 1); others: 0
        75    8  block checksum    u64: BLOCK: the block's checksum; others: 0
        83    9  reserved          zero
        92    4  header CRC        u32: CRC-32C of bytes 0..91 (padding and reserved included)

then ``payload length`` bytes of payload. :func:`decode_header` checks every field and raises
:class:`FrameError` -- and no other exception -- on any violation, for any input.

A block response is the frames of the requested keys in request order (BLOCK or MISSING each),
then END; or an ERROR frame at any point, which ends the response (the request failed).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from tpusync._native import core as _core
from tpusync._src.tiers.blocks import CHECKSUM_SCHEME
from tpusync.errors import FrameError, InvalidArgumentError

__all__ = [
    "BLOCK",
    "END",
    "ERROR",
    "HEADER_SIZE",
    "MAGIC",
    "MISSING",
    "VERSION",
    "FrameHeader",
    "decode_header",
    "encode_header",
]

MAGIC = b"TPSB"
VERSION = 1
BLOCK, MISSING, ERROR, END = 1, 2, 3, 4
FRAME_TYPES = {BLOCK: "BLOCK", MISSING: "MISSING", ERROR: "ERROR", END: "END"}
KEY_BYTES = 32
FINGERPRINT_BYTES = 16
RESERVED_BYTES = 9
KNOWN_SCHEMES = frozenset({CHECKSUM_SCHEME})
U64 = (1 << 64) - 1

_BODY = struct.Struct(f"<4sHHQB{KEY_BYTES}s{FINGERPRINT_BYTES}sQHQ{RESERVED_BYTES}s")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 96
_ZERO_RESERVED = bytes(RESERVED_BYTES)


@dataclass(frozen=True)
class FrameHeader:
    """A decoded frame header (see the module docstring for the fields)."""

    frame_type: int
    request_id: int
    key: bytes
    fingerprint: bytes
    payload_length: int
    checksum_scheme: int
    checksum: int

    @property
    def type_name(self) -> str:
        return FRAME_TYPES[self.frame_type]


def _check_int(value: Any, name: str, top: int) -> int:
    if type(value) is not int or not 0 <= value <= top:
        raise InvalidArgumentError(f"{name}: expected an integer in 0..{top}, got {value!r}")
    return value


def encode_header(
    frame_type: int,
    request_id: int,
    key: bytes,
    fingerprint: bytes,
    payload_length: int = 0,
    checksum: int = 0,
    checksum_scheme: int | None = None,
) -> bytes:
    """The 96 header bytes of one frame. ``checksum_scheme`` defaults to CHECKSUM_SCHEME for
    BLOCK frames and 0 for the others. Raises InvalidArgumentError for a header that
    :func:`decode_header` would refuse (except the payload limit, which is the reader's)."""
    if frame_type not in FRAME_TYPES:
        raise InvalidArgumentError(f"frame_type: expected one of {sorted(FRAME_TYPES)}")
    _check_int(request_id, "request_id", U64)
    _check_int(payload_length, "payload_length", U64)
    _check_int(checksum, "checksum", U64)
    if checksum_scheme is None:
        checksum_scheme = CHECKSUM_SCHEME if frame_type == BLOCK else 0
    _check_int(checksum_scheme, "checksum_scheme", 0xFFFF)
    if type(key) is not bytes or len(key) > KEY_BYTES:
        raise InvalidArgumentError(f"key: expected at most {KEY_BYTES} bytes, got {key!r:.80}")
    if type(fingerprint) is not bytes or len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgumentError(f"fingerprint: expected {FINGERPRINT_BYTES} bytes")
    body = _BODY.pack(
        MAGIC,
        VERSION,
        frame_type,
        request_id,
        len(key),
        key,  # struct pads with zeros
        fingerprint,
        payload_length,
        checksum_scheme,
        checksum,
        _ZERO_RESERVED,
    )
    try:
        _validate(
            frame_type,
            len(key),
            key.ljust(KEY_BYTES, b"\0"),
            payload_length,
            checksum_scheme,
            checksum,
        )
    except FrameError as exc:
        raise InvalidArgumentError(f"encode_header: {exc}") from None
    return body + _CRC.pack(_core.crc32c(body))


def _validate(
    frame_type: int,
    key_len: int,
    padded_key: bytes,
    payload_length: int,
    scheme: int,
    checksum: int,
) -> None:
    if frame_type in (BLOCK, MISSING):
        if not 1 <= key_len <= KEY_BYTES:
            raise FrameError(
                f"key length {key_len}: {FRAME_TYPES[frame_type]} frames have 1..32", "key"
            )
    elif key_len != 0:
        raise FrameError(f"key length {key_len}: {FRAME_TYPES[frame_type]} frames have none", "key")
    if any(padded_key[key_len:]):
        raise FrameError("the key's padding is not zero", "key")
    if frame_type == BLOCK:
        if scheme not in KNOWN_SCHEMES:
            raise FrameError(
                f"checksum scheme {scheme} is unknown (known: {sorted(KNOWN_SCHEMES)})", "checksum"
            )
    else:
        if scheme != 0 or checksum != 0:
            raise FrameError(f"{FRAME_TYPES[frame_type]} frames carry no checksum", "checksum")
        if frame_type != ERROR and payload_length != 0:
            raise FrameError(f"{FRAME_TYPES[frame_type]} frames have no payload", "payload")


def decode_header(buf: Any, *, max_payload: int) -> FrameHeader:
    """Decodes and checks one header (exactly :data:`HEADER_SIZE` bytes of any bytes-like
    object). Raises :class:`FrameError` on anything wrong with the bytes: length, magic,
    version, frame type, key length and padding, payload length above ``max_payload``,
    checksum fields, reserved bytes, header CRC."""
    _check_int(max_payload, "max_payload", U64)
    try:
        data = bytes(memoryview(buf).cast("B"))
    except (TypeError, ValueError, BufferError):
        raise FrameError(
            f"expected a bytes-like header, got {type(buf).__name__}", "length"
        ) from None
    if len(data) != HEADER_SIZE:
        raise FrameError(f"a header is {HEADER_SIZE} bytes, got {len(data)}", "length")
    body = data[: _BODY.size]
    (
        magic,
        version,
        frame_type,
        request_id,
        key_len,
        padded_key,
        fingerprint,
        payload_length,
        scheme,
        checksum,
        reserved,
    ) = _BODY.unpack(body)
    if magic != MAGIC:
        raise FrameError(f"magic {magic!r}: not a tpusync block frame", "magic")
    if version != VERSION:
        raise FrameError(f"wire version {version}; this build reads version {VERSION}", "version")
    (crc,) = _CRC.unpack_from(data, _BODY.size)
    if crc != _core.crc32c(body):
        raise FrameError("header CRC mismatch: the header was damaged", "crc")
    if frame_type not in FRAME_TYPES:
        raise FrameError(f"frame type {frame_type} is unknown", "type")
    if reserved != _ZERO_RESERVED:
        raise FrameError("reserved bytes are not zero", "reserved")
    if payload_length > max_payload:
        raise FrameError(
            f"payload length {payload_length} exceeds the limit of {max_payload}", "payload"
        )
    _validate(frame_type, key_len, padded_key, payload_length, scheme, checksum)
    return FrameHeader(
        frame_type=frame_type,
        request_id=request_id,
        key=padded_key[:key_len],
        fingerprint=fingerprint,
        payload_length=payload_length,
        checksum_scheme=scheme,
        checksum=checksum,
    )
