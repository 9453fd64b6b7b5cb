"""A disk hit read straight into the caller's memory (:meth:`DiskPool.get_scattered`).

O_DIRECT reads want memory aligned to the device's block (an engine's tensors are not: torch
aligns its CPU allocations to 64 bytes), so each run of consecutive slots is read into a staging
buffer of the I/O thread that reads it, then copied to its places and hashed in one pass
(``_core.copy_sum64_streams``) while the other threads' reads are still in flight. The block
moves from the page it landed in to its place once, and its checksum costs no pass of its own.
The staging buffers are kept between loads: the first write into a fresh page costs more than
the copy."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tpusync._native import core as _core
from tpusync._src.tiers.blocks import slot_checksums
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter

__all__ = ["Segments", "StagingBuffers", "lander", "segments_of"]


@dataclass(frozen=True)
class Segments:
    """Every block's bytes as segments that lie in one scatter run and one piece each: block
    ``i``'s segments are ``first[i]`` to ``first[i + 1]``, segment ``s`` starts ``offsets[s]``
    into the payload, lasts ``lengths[s]`` bytes and lands at ``targets[s]`` (0: hashed only);
    ``piece_ends[i]`` closes each of block ``i``'s pieces' groups of segments (counted from
    its first segment)."""

    first: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    piece_ends: list[np.ndarray]


def segments_of(scatter: Scatter, layout: PoolLayout, blocks: int) -> Segments:
    """The segments of ``blocks`` blocks landing where the (checked) ``scatter`` says."""
    piece_offsets, piece_lengths = layout.piece_table
    pieces = len(piece_offsets)
    if (
        len(scatter.offsets) == blocks * pieces
        and (scatter.offsets.reshape(blocks, pieces) == piece_offsets[None, :]).all()
    ):  # one run per piece: what an engine's tensors give
        ends = [np.arange(1, pieces + 1, dtype=np.int64)] * blocks
        return Segments(
            np.arange(0, blocks * pieces + 1, pieces, dtype=np.int64),
            scatter.offsets.astype(np.int64),
            np.tile(piece_lengths, blocks),
            scatter.targets,
            ends,
        )
    firsts, offsets, lengths, targets, ends = [0], [], [], [], []
    payload = layout.payload_bytes
    for i in range(blocks):
        runs = slice(int(scatter.first[i]), int(scatter.first[i + 1]))
        run_offsets, run_targets = scatter.offsets[runs], scatter.targets[runs]
        cuts = np.union1d(np.union1d(run_offsets, piece_offsets), [payload])
        starts, stops = cuts[:-1], cuts[1:]
        run = np.searchsorted(run_offsets, starts, side="right") - 1
        piece = np.searchsorted(piece_offsets, starts, side="right") - 1
        base = run_targets[run]
        shift = (starts - run_offsets[run]).astype(np.uint64)
        offsets.append(starts)
        lengths.append(stops - starts)
        targets.append(np.where(base == 0, np.uint64(0), base + shift))
        ends.append(np.flatnonzero(np.diff(piece, append=pieces)) + 1)
        firsts.append(firsts[-1] + len(starts))
    return Segments(
        np.array(firsts, dtype=np.int64),
        np.concatenate(offsets).astype(np.int64),
        np.concatenate(lengths).astype(np.int64),
        np.concatenate(targets).astype(np.uint64),
        ends,
    )


class StagingBuffers:
    """Page-aligned buffers of ``nbytes`` each, one per I/O thread reading at a time, made on
    first use with transparent huge pages (a direct read into 4 KiB pages reaches the device
    as many small requests, and those went one after another here), populated, and kept until
    :meth:`close`."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free: list[tuple[_core.Mapping, np.ndarray]] = []
        self._made: list[_core.Mapping] = []

    def take(self) -> tuple[_core.Mapping, np.ndarray]:
        with self._lock:
            if self._free:
                return self._free.pop()
        mapping = _core.Mapping(self.nbytes, populate=True, huge_pages=True)
        with self._lock:
            self._made.append(mapping)
        return mapping, np.frombuffer(mapping, dtype=np.uint8)

    def give(self, staging: tuple[_core.Mapping, np.ndarray]) -> None:
        with self._lock:
            self._free.append(staging)

    def close(self) -> None:
        """Unmaps the buffers (the pool calls it once no read is running)."""
        with self._lock:
            self._free.clear()
            made, self._made = self._made, []
        for mapping in made:
            mapping.close()


def lander(
    places: list[tuple[int, int]],
    segments: Segments,
    slot_bytes: int,
    staging: StagingBuffers,
    checksums: np.ndarray,
) -> Callable[[list[int]], None]:
    """The I/O threads' job for one run (block indices of slots that follow each other in one
    file; ``places`` gives each block's (fd, offset)): read it into a staging buffer, then copy
    and hash its blocks' segments, each block's checksum over the bytes landed going to
    ``checksums``. An OSError says the run could not be read."""

    def land(blocks: list[int]) -> None:
        staging_buffer = staging.take()
        try:
            digests = _land_one(blocks, staging_buffer[1])
        except OSError as exc:  # raised afresh below: its traceback would keep the view alive
            error: OSError | None = OSError(exc.errno, exc.strerror)
        else:
            error = None
            pieces = len(segments.piece_ends[blocks[0]])
            checksums[blocks] = slot_checksums(digests.reshape(len(blocks), pieces))
        finally:
            staging.give(staging_buffer)
            del staging_buffer
        if error is not None:
            raise error

    def _land_one(blocks: list[int], view: np.ndarray) -> np.ndarray:
        fd, offset = places[blocks[0]]
        _read_all(fd, memoryview(view)[: len(blocks) * slot_bytes], offset)
        address = view.ctypes.data
        sources, targets, lengths, ends, at = [], [], [], [], 0
        for j, block in enumerate(blocks):
            part = slice(int(segments.first[block]), int(segments.first[block + 1]))
            sources.append(address + j * slot_bytes + segments.offsets[part])
            targets.append(segments.targets[part])
            lengths.append(segments.lengths[part])
            ends.append(at + segments.piece_ends[block])
            at += part.stop - part.start
        return _core.copy_sum64_streams(
            np.concatenate(sources).astype(np.uint64),
            np.concatenate(targets).astype(np.uint64),
            np.concatenate(lengths).astype(np.uint64),
            np.concatenate(ends).astype(np.int64),
        )

    return land


def _read_all(fd: int, buffer: memoryview, offset: int) -> None:
    """Fills ``buffer`` from ``fd`` at ``offset`` (``os.preadv`` releases the GIL); EIO when
    the file ends first (a slab cut short)."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got <= 0:
            short = len(buffer) - done
            raise OSError(errno.EIO, f"the slab file ends at byte {offset + done}, {short} short")
        done += got
