"""The on-memory format of a host pool (anonymous or a file in /dev/shm), version 1.

    [header: 4096 bytes][records: n_slots x 64 bytes, padded to a page][slots: n_slots x slot_bytes]

The header holds a magic, the format version, the geometry, the layout fingerprint and the layout's
description (JSON), and the owner's pid (informational: ownership is a ``flock`` on the file,
which the kernel drops when the owner dies, however it dies). A record says whether its slot is
free, being written, or committed, and holds the key, the payload length and the checksum.
A slot becomes visible only when its record's state is set to committed, after every byte of the
slot and every other field of the record has been written; a record found in the writing state on
attach is a torn write and is freed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync.errors import PoolFormatError
from tpusync.tiers.layout import PoolLayout

MAGIC = b"TPUSYNCP"
FORMAT_VERSION = 1
# How block checksums are computed (piece checksum and how pieces combine); every tier stores
# blocks with checksums of this scheme, and a change needs a new number.
CHECKSUM_SCHEME = 1
HEADER_BYTES = 4096
PAGE = 4096
MAX_KEY_BYTES = 32

FREE, WRITING, COMMITTED = 0, 1, 2

RECORD_DTYPE = np.dtype(
    [
        ("state", "<u4"),
        ("key_len", "<u2"),
        ("reserved", "<u2"),
        ("checksum", "<u8"),
        ("length", "<u8"),
        ("sequence", "<u8"),
        ("key", "V32"),
    ]
)
assert RECORD_DTYPE.itemsize == 64

# magic, version, header bytes, slot bytes, n_slots, records offset, data offset, fingerprint,
# owner pid, description length
_FIXED = struct.Struct("<8sIIQQQQ16sII")


@dataclass(frozen=True)
class PoolGeometry:
    layout: PoolLayout
    n_slots: int

    @property
    def records_offset(self) -> int:
        return HEADER_BYTES

    @property
    def data_offset(self) -> int:
        end = self.records_offset + self.n_slots * RECORD_DTYPE.itemsize
        return -(-end // PAGE) * PAGE

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.n_slots * self.layout.slot_bytes


@dataclass(frozen=True)
class PoolHeader:
    version: int
    slot_bytes: int
    n_slots: int
    records_offset: int
    data_offset: int
    fingerprint: bytes
    owner_pid: int
    description: dict[str, Any]


def encode_header(geometry: PoolGeometry, owner_pid: int) -> bytes:
    layout = geometry.layout
    description = json.dumps(layout.describe(), sort_keys=True).encode()
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        layout.slot_bytes,
        geometry.n_slots,
        geometry.records_offset,
        geometry.data_offset,
        layout.fingerprint,
        owner_pid,
        len(description),
    )
    if len(fixed) + len(description) > HEADER_BYTES:
        raise PoolFormatError(
            f"the layout's description takes {len(description)} bytes, more than a pool header "
            f"holds ({HEADER_BYTES - len(fixed)}); use shorter array names"
        )
    return (fixed + description).ljust(HEADER_BYTES, b"\0")


def decode_header(data: bytes | memoryview, file_bytes: int) -> PoolHeader:
    """Parses and checks a header; raises :class:`PoolFormatError` saying what is wrong."""
    data = bytes(data[:HEADER_BYTES])
    if len(data) < _FIXED.size:
        raise PoolFormatError(f"truncated: {file_bytes} bytes is shorter than a pool header")
    magic, version, header_bytes, slot_bytes, n_slots, rec_off, data_off, fp, pid, n = (
        _FIXED.unpack_from(data)
    )
    if magic != MAGIC:
        raise PoolFormatError("not a tpusync pool (bad magic)")
    if version != FORMAT_VERSION:
        raise PoolFormatError(f"pool format version {version}; this build reads {FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES or _FIXED.size + n > HEADER_BYTES:
        raise PoolFormatError("corrupt header (sizes out of range)")
    try:
        description = json.loads(data[_FIXED.size : _FIXED.size + n])
        layout = PoolLayout.from_description(description)
    except (ValueError, KeyError, TypeError) as exc:
        raise PoolFormatError(f"corrupt header (layout description: {exc})") from None
    geometry = PoolGeometry(layout, int(n_slots))
    if (
        layout.slot_bytes != slot_bytes
        or layout.fingerprint != fp
        or geometry.records_offset != rec_off
        or geometry.data_offset != data_off
    ):
        raise PoolFormatError("corrupt header (geometry does not match the layout)")
    if file_bytes < geometry.file_bytes:
        raise PoolFormatError(
            f"truncated: {file_bytes} bytes, the header describes {geometry.file_bytes}"
        )
    return PoolHeader(version, slot_bytes, int(n_slots), rec_off, data_off, fp, pid, description)


def read_owner_pid(data: bytes) -> int | None:
    """The pid recorded in a header (informational), or None if it is not a pool header."""
    if len(data) < _FIXED.size or data[:8] != MAGIC:
        return None
    return int(_FIXED.unpack_from(data)[8])


def slot_checksums(piece_digests: np.ndarray) -> np.ndarray:
    """A block's checksum from its pieces' checksums (``_core.sum64`` of each contiguous piece,
    see include/tpusync/checksum.h): XXH64 of those, in slot order.

    ``piece_digests`` has shape (blocks, pieces per slot)."""
    from tpusync import _core

    rows = np.ascontiguousarray(piece_digests, dtype="<u8")  # the bytes hashed, per row
    return _core.xxh64_rows(rows)
