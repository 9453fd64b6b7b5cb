"""The disk pool's files: the index header, slab names, geometry defaults and small file
helpers (format version 1, see :mod:`tpusync._src.tiers.disk.pool`)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._src.tiers._file_writes import file_error
from tpusync._src.tiers._files import open_file
from tpusync._src.tiers.dram import COMMITTED, RECORD_DTYPE  # noqa: F401 (for format readers)
from tpusync._src.tiers.layout import PoolLayout
from tpusync.errors import PoolFormatError, UnsafeFileError

FORMAT_VERSION = 1
HEADER_BYTES = 4096  # index header and slab header: one page each, so slots stay page-aligned
INDEX_MAGIC = b"TPUSYNCI"
SLAB_MAGIC = b"TPUSYNCS"
LOCK_NAME = "tpusync-disk.lock"
INDEX_NAME = "tpusync-disk.index"
_SLAB_NAME = re.compile(r"^slab-(\d{6})\.tpd$")
_TEMP_NAME = re.compile(r"^\.(slab-\d{6}\.tpd|tpusync-disk\.index)\.tmp-\d+$")
RECORD_BYTES = RECORD_DTYPE.itemsize
DEFAULT_IO_THREADS = 4
DEFAULT_SLAB_BYTES = 1 << 30
MAX_DEFAULT_SLABS = 64
MAX_SLABS = 4096  # each existing slab keeps a file descriptor open
MAX_SEQUENCE = 1 << 62  # commit sequence numbers (u8 on disk) never get near this
# what the pool keeps in memory per slot: its record (64 B), its pin count (8 B), and a free-list
# entry (a Python int and its pointer, about 36 B)
MEMORY_PER_SLOT = 128

# magic, version, header bytes, slot bytes, capacity, slab slots, pool id, fingerprint,
# description length; then the description, then (at HEADER_BYTES - 4) a CRC32 of the rest
_INDEX_FIXED = struct.Struct("<8sIIQQQ16s16sI")
# magic, version, header bytes, slab number, slots in this slab, slot bytes, pool id,
# fingerprint, CRC32 of the preceding fields
_SLAB_FIXED = struct.Struct("<8sIIQQQ16s16s")
_CRC = struct.Struct("<I")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _runs(slots: list[int]) -> Iterator[tuple[int, int]]:
    """Consecutive runs of sorted slots as half-open ranges."""
    start = prev = None
    for slot in slots:
        if start is None:
            start = prev = slot
        elif slot == prev + 1:  # type: ignore[operator]
            prev = slot
        elif slot != prev:
            yield start, prev + 1  # type: ignore[operator]
            start = prev = slot
    if start is not None:
        yield start, prev + 1  # type: ignore[operator]


def _encode_index_header(
    pool_id: bytes, layout: PoolLayout, capacity: int, slab_slots: int
) -> bytes:
    description = json.dumps(layout.describe(), sort_keys=True).encode()
    fixed = _INDEX_FIXED.pack(
        INDEX_MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        layout.slot_bytes,
        capacity,
        slab_slots,
        pool_id,
        layout.fingerprint,
        len(description),
    )
    if len(fixed) + len(description) > HEADER_BYTES - _CRC.size:
        raise PoolFormatError(
            f"the layout's description takes {len(description)} bytes, more than a disk pool "
            f"header holds ({HEADER_BYTES - _CRC.size - len(fixed)}); use shorter array names"
        )
    body = (fixed + description).ljust(HEADER_BYTES - _CRC.size, b"\0")
    return body + _CRC.pack(zlib.crc32(body))


def _decode_index_header(
    data: bytes, file_bytes: int
) -> tuple[bytes, bytes, int, int, int, dict[str, Any]]:
    """Parses and checks an index header; raises :class:`PoolFormatError` saying what is
    wrong. Returns (pool id, fingerprint, capacity, slab slots, slot bytes, description)."""
    if len(data) < HEADER_BYTES:
        raise PoolFormatError(f"truncated: {file_bytes} bytes is shorter than an index header")
    if data[:8] != INDEX_MAGIC:
        raise PoolFormatError("not a tpusync disk pool index (bad magic)")
    body, (crc,) = data[: HEADER_BYTES - _CRC.size], _CRC.unpack_from(data, HEADER_BYTES - 4)
    _, version, header_bytes, slot_bytes, capacity, slab_slots, pool_id, fp, n = (
        _INDEX_FIXED.unpack_from(data)
    )
    if version != FORMAT_VERSION:
        raise PoolFormatError(
            f"disk pool format version {version}; this build reads {FORMAT_VERSION}"
        )
    if zlib.crc32(body) != crc:
        raise PoolFormatError("corrupt index header (checksum)")
    if header_bytes != HEADER_BYTES or _INDEX_FIXED.size + n > HEADER_BYTES - _CRC.size:
        raise PoolFormatError("corrupt index header (sizes out of range)")
    try:
        description = json.loads(data[_INDEX_FIXED.size : _INDEX_FIXED.size + n])
        layout = PoolLayout.from_description(description)
    except (ValueError, KeyError, TypeError, ArithmeticError, RecursionError) as exc:
        raise PoolFormatError(f"corrupt index header (layout description: {exc})") from None
    if layout.fingerprint != fp or layout.slot_bytes != slot_bytes:
        raise PoolFormatError("corrupt index header (fingerprint does not match the layout)")
    return pool_id, fp, int(capacity), int(slab_slots), int(slot_bytes), description


def _is_directory(path: Path) -> bool:
    """Whether ``path`` itself (not what a symlink there points to) is a directory."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove_file(path: Path) -> None:
    """Unlinks a file of the pool's (whatever sits there: a FIFO, a symlink); a directory
    where one belongs is an :class:`UnsafeFileError` naming it (tpusync removes no trees)."""
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        raise UnsafeFileError(
            f"{path}: expected a regular file, found a directory; remove it or choose another "
            "directory for the disk pool"
        ) from None
    except OSError as exc:
        raise file_error(exc, path, "removing a stale file") from exc


def _create_file(temp: Path) -> int:
    """Creates ``temp`` afresh (0600, ``O_EXCL``: whatever a crash left there is removed
    first) and returns its descriptor; the open's ``OSError``\\s pass through."""
    _remove_file(temp)
    return open_file(temp, os.O_RDWR | os.O_EXCL, create=True)


def _default_slab_slots(slot_bytes: int, capacity: int) -> int:
    slab_bytes = max(DEFAULT_SLAB_BYTES, -(-capacity * slot_bytes // MAX_DEFAULT_SLABS))
    return max(1, min(capacity, slab_bytes // slot_bytes))


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
