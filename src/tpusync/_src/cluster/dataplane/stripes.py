"""Where a pull's blocks land, one connection's share (a stripe) at a time: in the slots of a
local :class:`~tpusync.tiers.HostPool` (:class:`PoolStripe`), or scattered over the caller's
own memory (:class:`ScatterStripe`, from a :class:`Scatter`: each block's bytes received
straight into their places, no staging copy)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane._connection import Connection
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.frames import frame_receiver, slot_addresses
from tpusync._src.cluster.dataplane.protocol import MAX_ERROR_BYTES
from tpusync._src.engines import native
from tpusync._src.tiers.blocks import slot_checksums
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter

__all__ = ["PoolStripe", "ScatterStripe"]


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
