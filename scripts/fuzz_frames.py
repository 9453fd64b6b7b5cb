#!/usr/bin/env python
"""Fuzzes the native receiver of a pull's block frames (tpusync._native.net.FrameReceiver).

Usage: python scripts/fuzz_frames.py [ITERATIONS (default 20000)] [SEED]

Each iteration builds the frames a server sends for 1-5 random blocks (some MISSING, then END),
damages the stream -- flipped bytes, a cut, inserted or deleted bytes, or nothing -- and feeds
it through a socket pair into a FrameReceiver, handled as the client handles it: a header the
receiver stops at is decoded with wire.decode_header; MISSING resumes at the next block,
anything else ends the stream. Failures: an exception other than FrameError or EOFError, a hang,
or a block marked verified whose slot does not hold exactly its bytes. The script prints the
first failure and exits 1; at the end it prints how the streams ended.
"""

from __future__ import annotations

import collections
import random
import socket
import sys
import threading
import time

import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane import wire
from tpusync.errors import FrameError

FINGERPRINT = bytes(range(16))
RID = 5


def stream_for(
    rng: random.Random, n: int, size: int
) -> tuple[bytes, list[bytes], np.ndarray, np.ndarray]:
    """The frames for n random blocks of ``size`` bytes (one piece each), their keys, their
    payloads as rows and their checksums."""
    payloads = np.frombuffer(rng.randbytes(n * size), np.uint8).reshape(n, size)
    keys = [rng.randbytes(rng.randint(1, 32)) for _ in range(n)]
    pieces = np.array([[_core.sum64(row.tobytes())] for row in payloads], np.uint64)
    checksums = _core.xxh64_rows(pieces)  # a one-piece slot's checksum
    parts = []
    for key, row, checksum in zip(keys, payloads, checksums.tolist(), strict=True):
        if rng.random() < 0.2:
            parts.append(wire.encode_header(wire.MISSING, RID, key, FINGERPRINT))
            continue
        parts += [
            wire.encode_header(wire.BLOCK, RID, key, FINGERPRINT, size, checksum),
            row.tobytes(),
        ]
    parts.append(wire.encode_header(wire.END, RID, b"", FINGERPRINT))
    return b"".join(parts), keys, payloads, checksums


def damage(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    out = bytearray(data)
    kind = rng.choice(["none", "flip", "cut", "insert", "delete"])
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= rng.randint(1, 255)
    elif kind == "cut":
        del out[rng.randrange(len(out)) :]
    elif kind == "insert":
        at = rng.randrange(len(out))
        out[at:at] = rng.randbytes(rng.randint(1, 200))
    elif kind == "delete":
        at = rng.randrange(len(out))
        del out[at : at + rng.randint(1, 200)]
    return kind, bytes(out)


def one(rng: random.Random) -> str:
    n, size = rng.randint(1, 5), rng.randint(1, 3000)
    good, keys, payloads, checksums = stream_for(rng, n, size)
    kind, data = damage(rng, good)
    slots = np.zeros((n, size), np.uint8)
    addresses = (slots.ctypes.data + np.arange(n) * size).astype(np.uint64)
    headers = _core.block_frame_headers(
        RID, keys, FINGERPRINT, size, checksums, wire.CHECKSUM_SCHEME
    )
    a, b = socket.socketpair()

    def send() -> None:
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
        except OSError:  # the receiver stopped reading and closed its end
            pass

    sender = threading.Thread(target=send)
    sender.start()
    receiver = _core.FrameReceiver(
        b.fileno(), headers, addresses, checksums, size, np.array([0]), np.array([size])
    )
    try:
        while True:
            status = receiver.run(5.0, 5.0)
            if status not in (_core.FRAMES_DONE, _core.FRAMES_HEADER):
                raise AssertionError(f"the receiver hung (status {status})")
            header = wire.decode_header(receiver.header, max_payload=size)
            if status == _core.FRAMES_HEADER and header.frame_type == wire.MISSING:
                receiver.resume(receiver.index + 1)
                continue
            ended = f"{kind}: {header.type_name}"
            break
    except FrameError as exc:
        ended = f"{kind}: refused ({exc.reason})"
    except EOFError:
        ended = f"{kind}: cut off"
    finally:
        b.close()  # before the join: a sender blocked on a full socket then fails and ends
        sender.join(10)
        a.close()
    for i, result in enumerate(receiver.results.tolist()):
        if result == 1 and not np.array_equal(slots[i], payloads[i]):
            raise AssertionError(f"block {i} is marked verified but differs ({kind})")
    return ended


def main(argv: list[str]) -> int:
    iterations = int(float(argv[1])) if len(argv) > 1 else 20_000
    seed = int(argv[2]) if len(argv) > 2 else random.randrange(2**32)
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for i in range(iterations):
        try:
            counts[one(rng)] += 1
        except Exception as exc:  # the one thing this script looks for
            print(f"FAIL at iteration {i} (seed {seed}): {exc!r}")
            return 1
    for name, count in sorted(counts.items()):
        print(f"{count:>8}  {name}")
    print(f"{iterations} streams in {time.perf_counter() - start:.1f} s (seed {seed}): no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
