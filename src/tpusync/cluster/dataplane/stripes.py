"""Where a pull's blocks land, one connection's share (a stripe) at a time: in the slots of a
local :class:`~tpusync.tiers.HostPool` (:class:`PoolStripe`), or scattered over the caller's
own memory (:class:`ScatterStripe`, from a :class:`Scatter`: each block's bytes received
straight into their places, no staging copy)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tpusync import _core
from tpusync.cluster.dataplane import wire
from tpusync.cluster.dataplane._connection import Connection, Deadline
from tpusync.cluster.dataplane.frames import frame_receiver, slot_addresses
from tpusync.cluster.dataplane.protocol import MAX_ERROR_BYTES
from tpusync.engines import native
from tpusync.errors import InvalidArgumentError
from tpusync.tiers.blocks import slot_checksums
from tpusync.tiers.dram import HostPool
from tpusync.tiers.layout import PoolLayout

__all__ = ["PoolStripe", "Scatter", "ScatterStripe"]


@dataclass(frozen=True)
class Scatter:
    """Where each of a pull's blocks goes, run by run: block ``i``'s runs are ``first[i]`` to
    ``first[i + 1]``; run ``r`` starts at ``offsets[r]`` in the block's payload (a block's
    first run at 0, then rising) and lasts to the next run or the payload's end; it lands at
    address ``targets[r]``, or nowhere when that is 0 (received and hashed, then dropped).

    The caller keeps every target writable until the pull returns, and lets no one read a
    block's places unless the pull reports that block loaded: a block that failed (corrupt,
    missing, cut off) may have written some of them."""

    first: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray

    def checked(self, blocks: int, payload_bytes: int) -> Scatter:
        """Itself as contiguous int64/int64/uint64 arrays, after checking it covers ``blocks``
        payloads of ``payload_bytes``; InvalidArgumentError (naming ``scatter``) otherwise."""
        first = np.ascontiguousarray(self.first, dtype=np.int64)
        offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        targets = np.ascontiguousarray(self.targets, dtype=np.uint64)
        runs = len(offsets)
        if first.shape != (blocks + 1,) or targets.shape != (runs,) or offsets.ndim != 1:
            raise InvalidArgumentError(
                f"scatter: expected first of {blocks + 1} entries (one per key and one more) "
                f"and one target per offset; got {first.shape}, {offsets.shape}, {targets.shape}"
            )
        if first[0] != 0 or first[-1] != runs or (np.diff(first) < 1).any():
            raise InvalidArgumentError(
                "scatter: first must start at 0, rise by at least 1 per key (a run each) and "
                "end at the number of runs"
            )
        starts = np.zeros(runs, dtype=bool)
        starts[first[:-1]] = True
        rising = np.diff(offsets, prepend=np.int64(-1)) > 0
        if runs and (
            (offsets[starts] != 0).any()
            or not rising[~starts].all()
            or offsets.max() >= payload_bytes
        ):
            raise InvalidArgumentError(
                "scatter: each key's runs must start at offset 0 and rise inside its payload "
                f"({payload_bytes} bytes)"
            )
        return Scatter(first, offsets, targets)

    def runs_of(self, blocks: np.ndarray, scratch: int) -> tuple[np.ndarray, ...]:
        """The runs of ``blocks`` (in that order), for a receiver: (first, offsets, targets),
        the runs that land nowhere sent to ``scratch`` at their own offset (a payload-sized
        region of the stripe's own)."""
        counts = self.first[blocks + 1] - self.first[blocks]
        starts = np.repeat(self.first[blocks] - np.cumsum(counts) + counts, counts)
        picked = starts + np.arange(int(counts.sum()))
        offsets = self.offsets[picked]
        targets = self.targets[picked].copy()
        nowhere = targets == 0
        targets[nowhere] = np.uint64(scratch) + offsets[nowhere].astype(np.uint64)
        first = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        return first, offsets, targets


class _Stripe(abc.ABC):
    """One connection's share of a pull: its blocks' keys and recorded checksums, and what
    arrived (``ok``: verified, ``complete``: received whole, both over the whole pull)."""

    def __init__(
        self,
        keys: list[bytes],
        indices: np.ndarray,
        expected: np.ndarray,
        layout: PoolLayout,
    ) -> None:
        self.indices = indices
        self.keys = [keys[i] for i in indices.tolist()]
        self.expected = np.ascontiguousarray(np.asarray(expected, dtype=np.uint64)[indices])
        self.layout = layout
        self.size = layout.payload_bytes
        self.limit = max(self.size, MAX_ERROR_BYTES)
        self.ok = np.zeros(len(keys), dtype=bool)
        self.complete = np.zeros(len(keys), dtype=bool)
        self.nbytes = 0

    def landing(self) -> contextlib.AbstractContextManager[None]:
        """Keeps the places the blocks land in valid meanwhile (receivers made inside)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def receiver(self, conn: Connection, rid: int) -> _core.FrameReceiver:
        """The native receiver of this stripe's frames for request ``rid`` on ``conn``."""

    def take_results(self, receiver: _core.FrameReceiver) -> None:
        """Adds what ``receiver`` received (its blocks verified or failed) to the stripe's."""
        results = receiver.results
        self.complete[self.indices[results != 0]] = True
        self.ok[self.indices[results == 1]] = True
        self.nbytes += receiver.bytes_received

    def receive_block(
        self, conn: Connection, j: int, header: wire.FrameHeader, deadline: Deadline
    ) -> None:
        """Receives block ``j``'s payload, hashed piece by piece as it lands (while its bytes
        are still in cache), and judges it."""
        hasher = _core.PieceHasher(*self.layout.piece_table)
        with self._payload(j) as payload:
            conn.recv_into(payload, deadline, hasher)
            expected = int(self.expected[j])
            ok = (
                header.fingerprint == self.layout.fingerprint
                and header.checksum == expected
                and hasher.complete
                and int(slot_checksums(hasher.digests[None, :])[0]) == expected
            )
            if ok:
                self._place(j, payload)
        i = int(self.indices[j])
        self.nbytes += self.size
        self.complete[i] = True
        self.ok[i] = ok

    @abc.abstractmethod
    def _payload(self, j: int) -> contextlib.AbstractContextManager[memoryview]:
        """Where block ``j``'s payload is received when the Python path takes it."""

    def _place(self, j: int, payload: memoryview) -> None:  # noqa: B027 (a no-op by default)
        """Puts verified block ``j``'s bytes where they belong when they were received
        elsewhere (nothing to do where they were received in place)."""


class PoolStripe(_Stripe):
    """A stripe whose blocks land in reserved slots of ``target``."""

    def __init__(
        self,
        keys: list[bytes],
        indices: np.ndarray,
        expected: np.ndarray,
        target: HostPool,
        slots: np.ndarray,
    ) -> None:
        super().__init__(keys, indices, expected, target.layout)
        self.target = target
        self.slots = np.asarray(slots, dtype=np.int64)[indices]
        self._addresses: np.ndarray | None = None

    @contextlib.contextmanager
    def landing(self) -> Iterator[None]:
        with slot_addresses(self.target, self.slots) as addresses:
            self._addresses = addresses
            try:
                yield
            finally:
                self._addresses = None

    def receiver(self, conn: Connection, rid: int) -> _core.FrameReceiver:
        assert conn.sock is not None and self._addresses is not None
        return frame_receiver(
            conn.sock, rid, self.keys, self.layout, self.expected, self._addresses
        )

    @contextlib.contextmanager
    def _payload(self, j: int) -> Iterator[memoryview]:
        with (
            self.target.slot_memory(int(self.slots[j])) as memory,
            memory[: self.size] as payload,
        ):
            yield payload


class ScatterStripe(_Stripe):
    """A stripe whose blocks are received straight into the places ``scatter`` gives its
    ``blocks`` (the runs that land nowhere go to a scratch region of the stripe's own)."""

    def __init__(
        self,
        keys: list[bytes],
        indices: np.ndarray,
        expected: np.ndarray,
        layout: PoolLayout,
        scatter: Scatter,
        blocks: np.ndarray,
    ) -> None:
        super().__init__(keys, indices, expected, layout)
        self._scratch = np.empty(max(self.size, 1), dtype=np.uint8)
        self._runs = scatter.runs_of(blocks, self._scratch.ctypes.data)

    def receiver(self, conn: Connection, rid: int) -> _core.FrameReceiver:
        assert conn.sock is not None
        return frame_receiver(
            conn.sock, rid, self.keys, self.layout, self.expected, None, runs=self._runs
        )

    @contextlib.contextmanager
    def _payload(self, j: int) -> Iterator[memoryview]:
        with memoryview(self._scratch)[: self.size] as payload:
            yield payload

    def _place(self, j: int, payload: memoryview) -> None:
        first, offsets, targets = self._runs
        runs = slice(int(first[j]), int(first[j + 1]))
        starts = offsets[runs]
        lengths = np.diff(np.append(starts, self.size))
        table = np.stack(
            [self._scratch.ctypes.data + starts.astype(np.uint64), targets[runs],
             lengths.astype(np.uint64)], 1,
        ).astype(np.uint64)  # fmt: skip
        keep = table[:, 1] != table[:, 0]  # the runs that land nowhere are already "there"
        native.engine().copy(np.ascontiguousarray(table[keep]))
