"""Type stub of the native core (src/tpusync/_native/core.pyx): its memory and slot checks, and the
names it re-exports from the extensions of tpusync._native."""

from collections.abc import Callable

import numpy as np

from tpusync._native.checksum import _checksum_kernel as _checksum_kernel
from tpusync._native.checksum import _crc32c_shift as _crc32c_shift
from tpusync._native.checksum import _force_portable_checksum as _force_portable_checksum
from tpusync._native.checksum import blake2b as blake2b
from tpusync._native.checksum import blake2b_chain as blake2b_chain
from tpusync._native.checksum import copy_sum64_streams as copy_sum64_streams
from tpusync._native.checksum import crc32c as crc32c
from tpusync._native.checksum import sum64 as sum64
from tpusync._native.checksum import sum64_regions as sum64_regions
from tpusync._native.checksum import xxh64 as xxh64
from tpusync._native.checksum import xxh64_gathered as xxh64_gathered
from tpusync._native.checksum import xxh64_rows as xxh64_rows
from tpusync._native.convert import channel_amax as channel_amax
from tpusync._native.convert import convert as convert
from tpusync._native.copy import BlockRows as BlockRows
from tpusync._native.copy import CopyEngine as CopyEngine
from tpusync._native.copy import block_segments as block_segments
from tpusync._native.copy import openmp_here as openmp_here
from tpusync._native.copy import openmp_install as openmp_install
from tpusync._native.copy import openmp_installed as openmp_installed
from tpusync._native.copy import table_bounds as table_bounds
from tpusync._native.fileio import MAX_IOVS_PER_RUN as MAX_IOVS_PER_RUN
from tpusync._native.fileio import file_runs as file_runs
from tpusync._native.limits import copy_seconds as copy_seconds
from tpusync._native.limits import have_streaming as have_streaming
from tpusync._native.net import FRAME_HEADER_BYTES as FRAME_HEADER_BYTES
from tpusync._native.net import FRAMES_DONE as FRAMES_DONE
from tpusync._native.net import FRAMES_HEADER as FRAMES_HEADER
from tpusync._native.net import FRAMES_SILENT as FRAMES_SILENT
from tpusync._native.net import FRAMES_TIMEOUT as FRAMES_TIMEOUT
from tpusync._native.net import FrameReceiver as FrameReceiver
from tpusync._native.net import PieceHasher as PieceHasher
from tpusync._native.net import _set_rcvlowat_max as _set_rcvlowat_max
from tpusync._native.net import _set_recv_step as _set_recv_step
from tpusync._native.net import block_frame_headers as block_frame_headers
from tpusync._native.net import recv_exact as recv_exact
from tpusync._native.net import send_all as send_all
from tpusync._native.pjrt import PJRT_EXTENSION_TYPE_RAW_BUFFER as PJRT_EXTENSION_TYPE_RAW_BUFFER
from tpusync._native.pjrt import PjrtApi as PjrtApi
from tpusync._native.pjrt import PjrtError as PjrtError
from tpusync._native.pjrt import _slot_offsets as _slot_offsets
from tpusync._native.pjrt import _struct_sizes as _struct_sizes
from tpusync._native.pjrt import pjrt_minimum_version as pjrt_minimum_version

__all__ = [
    "FRAMES_DONE",
    "FRAMES_HEADER",
    "FRAMES_SILENT",
    "FRAMES_TIMEOUT",
    "FRAME_HEADER_BYTES",
    "MAX_IOVS_PER_RUN",
    "PAGE_SIZE",
    "PJRT_EXTENSION_TYPE_RAW_BUFFER",
    "BlockRows",
    "CopyEngine",
    "FrameReceiver",
    "Mapping",
    "PieceHasher",
    "PjrtApi",
    "PjrtError",
    "_checksum_kernel",
    "_crc32c_shift",
    "_force_portable_checksum",
    "_set_rcvlowat_max",
    "_set_recv_step",
    "_slot_offsets",
    "_struct_sizes",
    "blake2b",
    "blake2b_chain",
    "block_frame_headers",
    "block_ids_status",
    "block_segments",
    "collapse_huge_pages",
    "copy_seconds",
    "copy_sum64_streams",
    "crc32c",
    "dlpack_address",
    "file_runs",
    "have_streaming",
    "openmp_here",
    "openmp_install",
    "openmp_installed",
    "pin_slots",
    "pjrt_minimum_version",
    "populate_range",
    "recv_exact",
    "send_all",
    "sum64",
    "sum64_regions",
    "table_bounds",
    "unpin_slots",
    "xxh64",
    "xxh64_gathered",
    "xxh64_rows",
]

PAGE_SIZE: int

def collapse_huge_pages(address: int, length: int) -> int: ...
def dlpack_address(capsule: object) -> int | None: ...
def populate_range(address: int, length: int) -> None: ...
def pin_slots(
    index: dict[bytes, int], keys: list[bytes], pins: np.ndarray, checksums: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]: ...
def unpin_slots(pins: np.ndarray, slots: np.ndarray) -> None: ...
def block_ids_status(ids: np.ndarray, limit: int) -> int: ...

class Mapping:
    size: int
    on_unmap: Callable[[int, int], object] | None
    def __init__(
        self, size: int, populate: bool = ..., huge_pages: bool = ..., fd: int = ...
    ) -> None: ...
    def populate(
        self, start: int = ..., length: int | None = ..., *, write: bool = ...
    ) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
