"""The on-memory format of a host pool (anonymous or a file in /dev/shm), version 2.

    [header: 4096 bytes][records: n_slots x 64 bytes, padded to a page][slots: n_slots x slot_bytes]

The header holds a magic, the format version, the geometry, the layout fingerprint and the layout's
description (JSON), and the owner's pid (informational: ownership is a ``flock`` on the file,
which the kernel drops when the owner dies, however it dies). Version 2 ends the header with a
CRC32 of the rest of it, the owner's pid taken as 0 (each owner rewrites only its pid, so a
kill mid-write cannot tear the checksummed part); version 1, the same without the checksum,
still reads. A record says whether its slot is free, being written, or committed, and holds the
key, the payload length and the checksum.
A slot becomes visible only when its record's state is set to committed, after every byte of the
slot and every other field of the record has been written; a record found in the writing state on
attach is a torn write and is freed, and so is a record that is not a valid one (damaged).

Every decode error, whatever the bytes, is a :class:`~tpusync.errors.PoolFormatError`.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync._src.tiers.blocks import CHECKSUM_SCHEME, MAX_KEY_BYTES, slot_checksums  # noqa: F401 (home)
from tpusync._src.tiers.layout import PoolLayout
from tpusync.errors import PoolFormatError

MAGIC = b"TPUSYNCP"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no header checksum
HEADER_BYTES = 4096
PAGE = 4096

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

# Records' sequence numbers count commits; one beyond this is damage (and would overflow).
MAX_SEQUENCE = 1 << 62

# magic, version, header bytes, slot bytes, n_slots, records offset, data offset, fingerprint,
# owner pid, description length
_FIXED = struct.Struct("<8sIIQQQQ16sII")
_PID_OFFSET = 64  # of the owner pid in _FIXED
_PID = struct.Struct("<I")
_CRC = struct.Struct("<I")  # version 2: CRC32 of the header before it, the owner pid as 0
_CRC_OFFSET = HEADER_BYTES - _CRC.size
_MAX_DESCRIPTION = _CRC_OFFSET - _FIXED.size
assert _FIXED.size == _PID_OFFSET + 8


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
    layout: PoolLayout


def encode_header(geometry: PoolGeometry, owner_pid: int) -> bytes:
    """The header of a pool of ``geometry`` (this build's format version)."""
    layout = geometry.layout
    description = json.dumps(layout.describe(), sort_keys=True).encode()
    if len(description) > _MAX_DESCRIPTION:
        raise PoolFormatError(
            f"the layout's description takes {len(description)} bytes, more than a pool header "
            f"holds ({_MAX_DESCRIPTION}); use shorter array names"
        )
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        layout.slot_bytes,
        geometry.n_slots,
        geometry.records_offset,
        geometry.data_offset,
        layout.fingerprint,
        0,
        len(description),
    )
    body = (fixed + description).ljust(_CRC_OFFSET, b"\0")
    header = bytearray(body + _CRC.pack(zlib.crc32(body)))
    _PID.pack_into(header, _PID_OFFSET, owner_pid & 0xFFFFFFFF)
    return bytes(header)


def owner_pid_field() -> slice:
    """Where the owner's pid lies in a header: the only bytes an owner rewrites on attach."""
    return slice(_PID_OFFSET, _PID_OFFSET + _PID.size)


def decode_header(data: bytes | memoryview, file_bytes: int) -> PoolHeader:
    """Parses and checks a header (any readable version) against a file of ``file_bytes``;
    raises :class:`PoolFormatError` saying what is wrong, whatever ``data`` holds."""
    data = bytes(data[:HEADER_BYTES])
    if len(data) < HEADER_BYTES:
        raise PoolFormatError(f"truncated: {file_bytes} bytes is shorter than a pool header")
    magic, version, header_bytes, slot_bytes, n_slots, rec_off, data_off, fp, pid, n = (
        _FIXED.unpack_from(data)
    )
    if magic != MAGIC:
        raise PoolFormatError("not a tpusync pool (bad magic)")
    if version not in READABLE_VERSIONS:
        raise PoolFormatError(
            f"pool format version {version}; this build reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if version >= 2:
        body = bytearray(data[:_CRC_OFFSET])
        _PID.pack_into(body, _PID_OFFSET, 0)
        if zlib.crc32(body) != _CRC.unpack_from(data, _CRC_OFFSET)[0]:
            raise PoolFormatError("damaged header (its checksum does not match)")
    limit = _MAX_DESCRIPTION if version >= 2 else HEADER_BYTES - _FIXED.size
    if header_bytes != HEADER_BYTES or n > limit:
        raise PoolFormatError("damaged header (sizes out of range)")
    if n_slots < 1:
        raise PoolFormatError("damaged header (no slots)")
    try:
        description = json.loads(data[_FIXED.size : _FIXED.size + n])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PoolFormatError(f"damaged header (layout description: {exc})") from None
    try:
        layout = PoolLayout.from_description(description)
    except PoolFormatError as exc:
        raise PoolFormatError(f"damaged header ({exc})") from None
    geometry = PoolGeometry(layout, int(n_slots))
    if (
        layout.slot_bytes != slot_bytes
        or layout.fingerprint != fp
        or geometry.records_offset != rec_off
        or geometry.data_offset != data_off
    ):
        raise PoolFormatError("damaged header (geometry does not match the layout)")
    if file_bytes < geometry.file_bytes:
        raise PoolFormatError(
            f"truncated: {file_bytes} bytes, the header describes {geometry.file_bytes}"
        )
    return PoolHeader(
        version, slot_bytes, int(n_slots), rec_off, data_off, fp, pid, description, layout
    )


def read_owner_pid(data: bytes) -> int | None:
    """The pid recorded in a header (informational), or None if it is not a pool header."""
    if len(data) < _FIXED.size or data[:8] != MAGIC:
        return None
    return int(_PID.unpack_from(data, _PID_OFFSET)[0])


@dataclass(frozen=True)
class RecordScan:
    """What a pool's records hold, as :func:`scan_records` found them."""

    index: dict[bytes, int]  # key -> slot of every valid committed record, oldest first
    torn: np.ndarray  # slots left in the writing state (a crash mid-write)
    damaged: np.ndarray  # slots whose record is no valid record, or repeats a newer key
    sequence: int  # the highest commit sequence number in use


def scan_records(records: np.ndarray, payload_bytes: int) -> RecordScan:
    """Reads a pool's records (any bytes: they may be damaged) without changing them: O(slots),
    no data is read. A committed record counts only if its key length, payload length and
    sequence number are in range; of two records of one key, the later commit wins."""
    state = records["state"]
    torn = np.flatnonzero(state == WRITING)
    known = (state == FREE) | (state == WRITING) | (state == COMMITTED)
    lengths = records["key_len"].astype(np.int64)
    sequences = records["sequence"]
    valid = (
        (state == COMMITTED)
        & (lengths >= 1)
        & (lengths <= MAX_KEY_BYTES)
        & (records["length"] == payload_bytes)
        & (sequences < MAX_SEQUENCE)
    )
    committed = np.flatnonzero(valid)
    damaged = [np.flatnonzero(~known | ((state == COMMITTED) & ~valid))]
    index: dict[bytes, int] = {}
    sequence = 0
    if len(committed):
        order = committed[np.argsort(sequences[committed], kind="stable")]
        sequence = int(sequences[order[-1]])
        raw = records["key"]
        for slot in order.tolist():
            key = bytes(raw[slot])[: int(lengths[slot])]
            replaced = index.pop(key, None)  # popped: the dict keeps commit order
            if replaced is not None:
                damaged.append(np.array([replaced]))
            index[key] = slot
    return RecordScan(index, torn, np.sort(np.concatenate(damaged)).astype(np.int64), sequence)
