"""Byte rows between a version's stream and shard buffers, and a subscriber's rows as the
scatter of a data-plane pull of its chunks.

A row is (stream offset, address, bytes): ``bytes`` of the stream at ``offset`` sit at
``address``. The publisher's rows read shards into chunks; a subscriber's rows are the runs of
each reshard piece (:mod:`tpusync._src.weights.plan`), split where chunks end.
"""

from __future__ import annotations

import numpy as np

from tpusync._src.weights.plan import Piece

__all__ = ["Rows", "piece_rows", "scatter_runs", "split_at_chunks"]


class Rows:
    """Parallel int64 arrays: stream offsets, addresses, byte counts."""

    __slots__ = ("address", "nbytes", "offset")

    def __init__(self, offset: np.ndarray, address: np.ndarray, nbytes: np.ndarray) -> None:
        self.offset = np.asarray(offset, dtype=np.int64)
        self.address = np.asarray(address, dtype=np.int64)
        self.nbytes = np.asarray(nbytes, dtype=np.int64)

    @classmethod
    def join(cls, parts: list[Rows]) -> Rows:
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty)
        return cls(
            np.concatenate([p.offset for p in parts]),
            np.concatenate([p.address for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )

    def sorted(self) -> Rows:
        order = np.argsort(self.offset, kind="stable")
        return Rows(self.offset[order], self.address[order], self.nbytes[order])

    def __len__(self) -> int:
        return len(self.offset)


def piece_rows(piece: Piece, stream_start: int, target_address: int) -> Rows:
    """The rows that carry ``piece`` from its source shard (whose bytes start at
    ``stream_start`` in the stream) to its target shard (at ``target_address``)."""
    src, dst, run = piece.runs()
    return Rows(stream_start + src, target_address + dst, np.full(len(src), run, np.int64))


def split_at_chunks(rows: Rows, chunk_bytes: int) -> Rows:
    """``rows`` cut where the stream's chunks end, so that each row lies in one chunk."""
    first = rows.offset // chunk_bytes
    last = (rows.offset + rows.nbytes - 1) // chunk_bytes
    spans = last - first + 1
    if (spans == 1).all():
        return rows
    index = np.repeat(np.arange(len(rows)), spans)
    step = np.arange(len(index)) - np.repeat(np.cumsum(spans) - spans, spans)
    chunk = first[index] + step
    start = np.maximum(rows.offset[index], chunk * chunk_bytes)
    end = np.minimum(rows.offset[index] + rows.nbytes[index], (chunk + 1) * chunk_bytes)
    return Rows(start, rows.address[index] + (start - rows.offset[index]), end - start)


def scatter_runs(
    rows: Rows, chunks: np.ndarray, chunk_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each chunk of ``chunks`` (sorted; each holds at least one row) lands, as a
    data-plane scatter (first, offsets, targets) in its byte order: its rows (sorted, each
    inside one chunk, not overlapping; offset in the chunk, place) and, around them, the bytes
    no row carries (target 0: hashed, then dropped)."""
    chunk_of_row = rows.offset // chunk_bytes
    lo, hi = np.searchsorted(chunk_of_row, [chunks[0], chunks[-1] + 1]) if len(chunks) else (0, 0)
    rc = chunk_of_row[lo:hi]
    picked = np.isin(rc, chunks, assume_unique=False) if len(rc) else rc.astype(bool)
    rc = rc[picked]
    rel = rows.offset[lo:hi][picked] - rc * chunk_bytes
    n = rows.nbytes[lo:hi][picked]
    address = rows.address[lo:hi][picked]
    first = np.ones(len(rc), dtype=bool)
    first[1:] = rc[1:] != rc[:-1]
    last = np.ones(len(rc), dtype=bool)
    last[:-1] = first[1:]
    end = rel + n
    gap_start = np.where(first, 0, np.concatenate([[0], end[:-1]]))
    # per row: the gap before it, the row, and after a chunk's last row the chunk's tail
    offset = np.stack([gap_start, rel, end], 1).reshape(-1)
    dst = np.stack([np.zeros_like(rel), address, np.zeros_like(rel)], 1).reshape(-1)
    length = np.stack([rel - gap_start, n, np.where(last, chunk_bytes - end, 0)], 1).reshape(-1)
    keep = length > 0
    region_chunk = np.repeat(rc, 3)[keep]
    ends = np.searchsorted(region_chunk, chunks, side="right").astype(np.int64)
    chunk_first = np.concatenate(([0], ends)).astype(np.int64)  # each chunk's first run
    return chunk_first, offset[keep].astype(np.int64), dst[keep].astype(np.uint64)
