"""What every tier, the KV store and the data plane agree on about a block: how long its key may
be, and how its checksum is made (the scheme number and the rule that combines its pieces'
checksums). The DRAM pool's file format records these; the disk and shared-FS tiers and the
block frame carry them."""

from __future__ import annotations

import numpy as np

from tpusync._native import core as _core

__all__ = ["CHECKSUM_SCHEME", "MAX_KEY_BYTES", "slot_checksums"]

# How block checksums are computed (piece checksum and how pieces combine); every tier stores
# blocks with checksums of this scheme, and a change needs a new number.
CHECKSUM_SCHEME = 1
MAX_KEY_BYTES = 32


def slot_checksums(piece_digests: np.ndarray) -> np.ndarray:
    """A block's checksum from its pieces' checksums (``_core.sum64`` of each contiguous piece,
    see include/tpusync/checksum.h): XXH64 of those, in slot order.

    ``piece_digests`` has shape (blocks, pieces per slot)."""
    rows = np.ascontiguousarray(piece_digests, dtype="<u8")  # the bytes hashed, per row
    return _core.xxh64_rows(rows)
