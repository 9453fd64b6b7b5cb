"""The native receiver of a pull's block frames (_core.FrameReceiver): blocks land verified in
their slots however the stream is cut, a damaged byte never yields a block marked verified, and
the frames it does not expect, its time budget and a silent peer hand back to the caller."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane import wire
from tpusync.errors import FrameError

FINGERPRINT = bytes(range(16))
RID = 77


def _pieces(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A slot cut into 1-4 consecutive arrays, as a layout's piece table."""
    cuts = np.sort(rng.choice(np.arange(1, size), size=min(3, size - 1), replace=False))
    bounds = np.concatenate(([0], cuts[: int(rng.integers(0, len(cuts) + 1))], [size]))
    return bounds[:-1].astype(np.int64), np.diff(bounds).astype(np.int64)


def _checksum(payload: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> int:
    starts = (payload.ctypes.data + offsets).astype(np.uint64)
    digests = _core.sum64_regions(starts, lengths.astype(np.uint64))
    return int(_core.xxh64_rows(np.ascontiguousarray(digests[None, :]))[0])


class Case:
    """Random blocks, their frames as a server sends them (some MISSING) and the slots a
    receiver writes into, or (``scattered``) the runs it scatters them over."""

    def __init__(
        self,
        rng: np.random.Generator,
        n: int,
        size: int,
        missing: set[int],
        scattered: bool = False,
    ) -> None:
        self.size = size
        self.offsets, self.lengths = _pieces(rng, size)
        self.keys = [rng.bytes(int(rng.integers(1, 33))) for _ in range(n)]
        self.payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
        self.checksums = np.array(
            [_checksum(p, self.offsets, self.lengths) for p in self.payloads], dtype=np.uint64
        )
        self.missing = missing
        frames = []
        for i, (key, data) in enumerate(zip(self.keys, self.payloads, strict=True)):
            if i in missing:
                frames.append(wire.encode_header(wire.MISSING, RID, key, FINGERPRINT))
                continue
            frames.append(
                wire.encode_header(
                    wire.BLOCK,
                    RID,
                    key,
                    FINGERPRINT,
                    payload_length=size,
                    checksum=int(self.checksums[i]),
                )
            )
            frames.append(data.tobytes())
        frames.append(wire.encode_header(wire.END, RID, b"", FINGERPRINT))
        self.stream = b"".join(frames)
        self.slots = np.zeros((n, size), dtype=np.uint8)
        self.runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if scattered:
            self._scatter(rng, n, size)

    def _scatter(self, rng: np.random.Generator, n: int, size: int) -> None:
        """Each block cut into 1-70 runs, the runs of all blocks placed in a shuffled order
        with random gaps in one arena."""
        cuts = [
            np.sort(rng.choice(np.arange(1, size), int(rng.integers(0, min(70, size))), False))
            for _ in range(n)
        ]
        offsets = [np.concatenate(([0], c)).astype(np.int64) for c in cuts]
        lengths = np.concatenate([np.diff(np.append(o, size)) for o in offsets])
        order = rng.permutation(len(lengths))
        gaps = rng.integers(0, 64, len(lengths))
        place = np.empty(len(lengths), dtype=np.int64)
        place[order] = np.cumsum(lengths[order] + gaps[order]) - lengths[order]
        self.arena = rng.integers(0, 256, int(place.max() + lengths.max()), dtype=np.uint8)
        self.place, self.run_lengths = place, lengths
        first = np.concatenate(([0], np.cumsum([len(o) for o in offsets]))).astype(np.int64)
        targets = (self.arena.ctypes.data + place).astype(np.uint64)
        self.runs = (first, np.concatenate(offsets), targets)

    def landed(self, i: int) -> np.ndarray:
        """Block ``i``'s bytes where the receiver put them."""
        if self.runs is None:
            return self.slots[i]
        first = self.runs[0]
        return np.concatenate(
            [self.arena[p : p + m] for p, m in zip(
                self.place[first[i] : first[i + 1]], self.run_lengths[first[i] : first[i + 1]],
                strict=True,
            )]
        )  # fmt: skip

    def receiver(self, fd: int) -> _core.FrameReceiver:
        headers = _core.block_frame_headers(
            RID, self.keys, FINGERPRINT, self.size, self.checksums, wire.CHECKSUM_SCHEME
        )
        if self.runs is not None:
            return _core.FrameReceiver(
                fd, headers, None, self.checksums, self.size, self.offsets, self.lengths,
                runs=self.runs,
            )  # fmt: skip
        addresses = (self.slots.ctypes.data + np.arange(len(self.keys)) * self.size).astype(
            np.uint64
        )
        return _core.FrameReceiver(
            fd, headers, addresses, self.checksums, self.size, self.offsets, self.lengths
        )

    def drive(self, receiver: _core.FrameReceiver) -> wire.FrameHeader:
        """What the client does: runs the receiver, skips MISSING frames, and returns the last
        header it stopped at (END when all went well). FrameError for a damaged header."""
        while True:
            status = receiver.run(10.0, 10.0)
            assert status in (_core.FRAMES_DONE, _core.FRAMES_HEADER)
            header = wire.decode_header(receiver.header, max_payload=self.size)
            if status == _core.FRAMES_DONE or header.frame_type != wire.MISSING:
                return header
            receiver.resume(receiver.index + 1)


@contextlib.contextmanager
def reads_of_at_most(nbytes: int | None) -> Iterator[None]:
    """The native receivers take at most ``nbytes`` per read meanwhile (None: as built)."""
    if nbytes is None:
        yield
        return
    previous = _core._set_recv_step(nbytes)
    try:
        yield
    finally:
        _core._set_recv_step(previous)


def _send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int]) -> threading.Thread:
    def send() -> None:
        at = 0
        for cut in [*sorted(cuts), len(data)]:
            sock.sendall(data[at:cut])
            at = max(at, cut)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@settings(max_examples=60, deadline=None)
@given(
    request_id=st.integers(0, 2**64 - 1),
    keys=st.lists(st.binary(min_size=1, max_size=32), min_size=1, max_size=5),
    length=st.integers(0, 2**64 - 1),
    checksums=st.lists(st.integers(0, 2**64 - 1), min_size=5, max_size=5),
)
def test_block_frame_headers_are_the_wire_encoding(
    request_id: int, keys: list[bytes], length: int, checksums: list[int]
) -> None:
    sums = np.array(checksums[: len(keys)], dtype=np.uint64)
    expected = b"".join(
        wire.encode_header(wire.BLOCK, request_id, k, FINGERPRINT, length, int(c))
        for k, c in zip(keys, sums, strict=True)
    )
    headers = _core.block_frame_headers(
        request_id, keys, FINGERPRINT, length, sums, wire.CHECKSUM_SCHEME
    )
    assert headers == expected


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    size=st.integers(2, 20_000),
    cuts=st.lists(st.integers(0, 200_000), max_size=12),
    missing=st.sets(st.integers(0, 5), max_size=3),
    step=st.sampled_from([None, 1, 95, 4096]),
    scattered=st.booleans(),
)
def test_blocks_land_verified_however_the_stream_is_cut(
    seed: int,
    n: int,
    size: int,
    cuts: list[int],
    missing: set[int],
    step: int | None,
    scattered: bool,
) -> None:
    """Also with reads capped below a payload (2 MiB blocks are read 128 KiB at a time): the
    next header is then read apart from the payload's last bytes; and scattered over runs
    (more runs than one read fills, runs shorter than a read)."""
    case = Case(np.random.default_rng(seed), n, size, {i for i in missing if i < n}, scattered)
    a, b = socket.socketpair()
    with reads_of_at_most(step):
        try:
            sender = _send_in_pieces(a, case.stream, [c % len(case.stream) for c in cuts])
            receiver = case.receiver(b.fileno())
            end = case.drive(receiver)
            sender.join(10)
            assert end.frame_type == wire.END
            got = [i for i in range(n) if i not in case.missing]
            assert receiver.results.tolist() == [0 if i in case.missing else 1 for i in range(n)]
            assert receiver.bytes_received == len(got) * size
            for i in got:
                assert np.array_equal(case.landed(i), case.payloads[i])
        finally:
            a.close()
            b.close()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    size=st.integers(2, 5000),
    step=st.sampled_from([None, 1, 333]),
    scattered=st.booleans(),
)
def test_a_damaged_byte_never_yields_a_verified_wrong_block(
    seed: int, n: int, size: int, step: int | None, scattered: bool
) -> None:
    """One byte anywhere in the stream flipped: a damaged payload fails its checksum; a damaged
    header stops the receiver there (the caller's decode then refuses it, or it names another
    key). Every block marked verified holds exactly its bytes."""
    rng = np.random.default_rng(seed)
    case = Case(rng, n, size, set(), scattered)
    stream = bytearray(case.stream)
    at = int(rng.integers(0, len(stream)))
    stream[at] ^= 1 << int(rng.integers(0, 8))
    a, b = socket.socketpair()
    with reads_of_at_most(step):
        try:
            a.sendall(bytes(stream))
            a.shutdown(socket.SHUT_WR)
            receiver = case.receiver(b.fileno())
            try:
                ended = case.drive(receiver).frame_type == wire.END
            except (FrameError, EOFError):  # what the client refuses
                ended = False
            results = receiver.results.tolist()
            assert not (ended and results == [1] * n)  # the damage was seen
            for i, result in enumerate(results):
                if result == 1:
                    assert np.array_equal(case.landed(i), case.payloads[i])
                payload_start = 96 * (i + 1) + size * i
                if payload_start <= at < payload_start + size:
                    assert result == 2  # its own payload was damaged
        finally:
            a.close()
            b.close()


def test_budget_silence_and_a_closed_peer_hand_back(rng: np.random.Generator) -> None:
    """A peer that sends a block and a half, then nothing: a run hands back at its budget
    (FRAMES_TIMEOUT) or after the silence (FRAMES_SILENT), keeping what came; once the rest
    arrives the run ends; SO_RCVLOWAT is 1 again. A peer that closes mid-block is an
    EOFError, and the blocks before it stay verified."""
    case = Case(rng, 3, 300_000, set())
    split = 96 + 300_000 + 96 + 150_000
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname(), timeout=5)
        receiver_sock, _ = listener.accept()
    try:
        first = threading.Thread(target=sender.sendall, args=(case.stream[:split],))
        first.start()
        receiver = case.receiver(receiver_sock.fileno())
        start = time.monotonic()
        assert receiver.run(0.3, 30.0) == _core.FRAMES_TIMEOUT
        assert 0.25 < time.monotonic() - start < 5
        first.join(10)
        assert receiver.index == 1 and receiver.results.tolist() == [1, 0, 0]
        assert receiver.run(30.0, 0.2) == _core.FRAMES_SILENT
        assert receiver_sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        later = threading.Timer(0.1, lambda: sender.sendall(case.stream[split:]))
        later.start()
        assert receiver.run(10.0, 10.0) == _core.FRAMES_DONE
        later.join(5)
        assert receiver.results.tolist() == [1, 1, 1]
        assert receiver_sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        assert wire.decode_header(receiver.header, max_payload=0).frame_type == wire.END
    finally:
        sender.close()
        receiver_sock.close()

    case = Case(rng, 3, 300_000, set())
    a, b = socket.socketpair()
    try:

        def send_and_close() -> None:
            a.sendall(case.stream[:split])
            a.close()

        thread = threading.Thread(target=send_and_close)
        thread.start()
        receiver = case.receiver(b.fileno())
        with pytest.raises(EOFError):
            receiver.run(10.0, 10.0)
        thread.join(10)
        assert receiver.results.tolist() == [1, 0, 0]
    finally:
        a.close()
        b.close()


def test_receiver_refuses_inconsistent_arguments(rng: np.random.Generator) -> None:
    case = Case(rng, 2, 1000, set())
    addresses = np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="one 96-byte header"):
        _core.FrameReceiver(0, b"x" * 96, addresses, case.checksums, 1000, *_pieces(rng, 1000))
    with pytest.raises(ValueError, match="outside"):
        case.receiver(0).resume(3)
    args = (0, b"x" * 192, None, case.checksums, 1000, *_pieces(rng, 1000))
    with pytest.raises(ValueError, match="addresses or runs"):
        _core.FrameReceiver(*args)
    good = (np.array([0, 1, 3]), np.array([0, 0, 500]), np.array([8, 8, 9], np.uint64))
    _core.FrameReceiver(*args, runs=good)
    bad_runs = [
        ((np.array([0, 1]), good[1], good[2]), "one entry per block"),  # first too short
        ((np.array([0, 0, 3]), good[1], good[2]), "every block has a run"),
        ((good[0], np.array([0, 5, 500]), good[2]), "start at 0"),  # block 1 starts at 5
        ((good[0], np.array([0, 0, 0]), good[2]), "rise"),
        ((good[0], np.array([0, 0, 1000]), good[2]), "inside the payload"),
        ((good[0], good[1], np.array([8, 0, 9], np.uint64)), "nonzero"),
        ((good[0], good[1]), "first, offsets, targets"),
    ]
    for runs, match in bad_runs:
        with pytest.raises(ValueError, match=match):
            _core.FrameReceiver(*args, runs=runs)
    with pytest.raises(ValueError, match="addresses or runs"):
        _core.FrameReceiver(*args[:2], addresses, *args[3:], runs=good)
    with pytest.raises(ValueError, match="fingerprint"):
        _core.block_frame_headers(1, case.keys, b"short", 10, case.checksums, 1)
