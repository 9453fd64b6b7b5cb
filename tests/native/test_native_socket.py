"""The native socket calls of the data plane: send_all, recv_exact with a PieceHasher, and the
hasher itself (each piece's checksum equals sum64 of its bytes, however the bytes arrive)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import core as _core


def _piece_table(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, non-overlapping pieces with gaps between some of them (like a slot's arrays,
    each aligned), covering most of ``size`` bytes."""
    cuts = np.sort(rng.choice(np.arange(1, size), size=14, replace=False))
    bounds = np.concatenate(([0], cuts, [size]))
    starts, stops = bounds[:-1:2], bounds[1::2]  # every other span is a gap
    return starts.astype(np.int64), (stops - starts).astype(np.int64)


def _expected(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    starts = (data.ctypes.data + offsets).astype(np.uint64)
    return _core.sum64_regions(starts, lengths.astype(np.uint64))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), splits=st.integers(1, 40))
def test_hasher_matches_sum64_for_any_split(seed: int, splits: int) -> None:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(64, 300_000)), dtype=np.uint8)
    offsets, lengths = _piece_table(rng, len(data))
    hasher = _core.PieceHasher(offsets, lengths)
    cuts = np.sort(rng.integers(0, len(data), splits))
    for part in np.split(data, cuts):
        assert not hasher.complete or hasher.position >= offsets[-1] + lengths[-1]
        hasher.feed(part)
    assert hasher.complete and hasher.position == len(data)
    assert np.array_equal(hasher.digests, _expected(data, offsets, lengths))


def test_hasher_is_incomplete_until_the_last_piece_arrives(rng: np.random.Generator) -> None:
    data = rng.integers(0, 256, 100_000, dtype=np.uint8)
    hasher = _core.PieceHasher(np.array([0, 50_000]), np.array([50_000, 50_000]))
    hasher.feed(data[:99_999])
    assert not hasher.complete and hasher.digests[1] == 0
    hasher.feed(data[99_999:])
    assert hasher.complete
    with pytest.raises(ValueError):
        _core.PieceHasher(np.array([0, 1]), np.array([1]))


def test_recv_exact_hashes_what_lands_across_timeouts(rng: np.random.Generator) -> None:
    """A payload whose first 70,001 bytes come, then nothing for longer than the receiver's
    timeout: recv_exact returns what came, the hasher is exactly as far as the bytes received
    (its last step cut short), and later calls complete both."""
    data = rng.integers(0, 256, (1 << 20) + 12_345, dtype=np.uint8)
    offsets, lengths = _piece_table(rng, len(data))
    first = 70_001  # more than one 64 KiB hashing step, not a whole number of them
    a, b = socket.socketpair()
    try:
        b.settimeout(5.0)
        go_on = threading.Event()

        def send() -> None:
            a.sendall(data[:first].tobytes())
            go_on.wait(10)  # silence until the receiver has seen a timeout
            a.sendall(data[first:].tobytes())

        sender = threading.Thread(target=send)
        sender.start()
        buffer = np.zeros_like(data)
        hasher = _core.PieceHasher(offsets, lengths)
        got = 0
        deadline = time.monotonic() + 10
        while got < first and time.monotonic() < deadline:  # however the first bytes arrive
            got += _core.recv_exact(b.fileno(), memoryview(buffer)[got:], 0.1, hasher)
            assert hasher.position == got
        assert got == first
        assert _core.recv_exact(b.fileno(), memoryview(buffer)[got:], 0.1, hasher) == 0
        assert hasher.position == first and not hasher.complete
        go_on.set()
        while got < len(data) and time.monotonic() < deadline:
            got += _core.recv_exact(b.fileno(), memoryview(buffer)[got:], 5.0, hasher)
        sender.join(5)
        assert got == len(data) and np.array_equal(buffer, data)
        assert hasher.complete
        assert np.array_equal(hasher.digests, _expected(data, offsets, lengths))
    finally:
        a.close()
        b.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        server, _ = listener.accept()
    return client, server


def test_recv_exact_over_tcp_collects_bytes_below_the_low_mark_and_resets_it(
    rng: np.random.Generator,
) -> None:
    """recv_exact raises the socket's SO_RCVLOWAT while it waits (fewer wake-ups), yet bytes
    fewer than that mark still arrive: a peer that sends 3,000 bytes and then nothing yields
    those 3,000 after the timeout, a payload trickled in small pieces arrives whole, and the
    mark is back at 1 afterwards (other readers of the socket see every byte)."""
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    sender, receiver = _tcp_pair()
    try:
        # the 3,000 bytes come while recv_exact already waits for 256 KiB of the missing MiB
        later = threading.Timer(0.05, lambda: sender.sendall(data[:3000].tobytes()))
        later.start()
        buffer = np.zeros_like(data)
        got = _core.recv_exact(receiver.fileno(), memoryview(buffer), 1.0)  # ample slack
        later.join(5)
        assert got == 3000 and np.array_equal(buffer[:3000], data[:3000])
        assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        deadline = time.monotonic() + 10

        def trickle() -> None:
            for at in range(3000, len(data), 40_000):
                sender.sendall(data[at : at + 40_000].tobytes())
                time.sleep(0.002)

        thread = threading.Thread(target=trickle)
        thread.start()
        while got < len(data) and time.monotonic() < deadline:
            got += _core.recv_exact(receiver.fileno(), memoryview(buffer)[got:], 5.0)
        thread.join(10)
        assert got == len(data) and np.array_equal(buffer, data)
        assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        sender.close()
        receiver.close()


def test_send_all_sends_every_buffer_in_order_through_short_sends(
    rng: np.random.Generator,
) -> None:
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (7, 0, 3 << 20, 1, 99)]
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)  # many short sends
        a.settimeout(5.0)
        received = bytearray()

        def receive() -> None:
            while len(received) < sum(map(len, parts)):
                received.extend(b.recv(50_000))

        reader = threading.Thread(target=receive)
        reader.start()
        assert _core.send_all(a.fileno(), [memoryview(p) for p in parts], 5.0) == len(
            b"".join(parts)
        )
        reader.join(5)
        assert bytes(received) == b"".join(parts)
    finally:
        a.close()
        b.close()


def test_send_all_times_out_on_a_peer_that_reads_nothing_and_fails_on_a_closed_one() -> None:
    a, b = socket.socketpair()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            _core.send_all(a.fileno(), [bytes(32 << 20)], 0.2)
        assert time.monotonic() - start < 5
        b.close()
        with pytest.raises(OSError):  # EPIPE or ECONNRESET, never a SIGPIPE
            _core.send_all(a.fileno(), [bytes(32 << 20)], 1.0)
    finally:
        a.close()
        b.close()
