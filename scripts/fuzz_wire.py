#!/usr/bin/env python
"""Fuzzes the data plane's block-frame header decoder
(tpusync._src.cluster.dataplane.wire.decode_header).

Usage: python scripts/fuzz_wire.py [ITERATIONS (default 1000000)] [SEED]

Each iteration decodes one input: random bytes of a random length, random bytes of exactly a
header's length, a valid header with 1-4 random byte changes, a valid header with a field
rewritten and its CRC fixed (so the field checks, not the CRC, must catch it), or a truncated
or extended valid header. Anything but a FrameError -- or a corrupted header that decodes to
something other than the original -- is a failure: the script prints it and exits 1. At the end
it prints how many inputs of each kind were decoded, refused, and why.
"""

from __future__ import annotations

import collections
import random
import struct
import sys
import time

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane import wire
from tpusync.errors import FrameError

MAX_PAYLOAD = 1 << 24


def valid_header(rng: random.Random) -> bytes:
    kind = rng.choice([wire.BLOCK, wire.MISSING, wire.ERROR, wire.END])
    key = rng.randbytes(rng.randint(1, 32)) if kind in (wire.BLOCK, wire.MISSING) else b""
    payload = 0
    if kind == wire.BLOCK:
        payload = rng.randint(0, MAX_PAYLOAD)
    elif kind == wire.ERROR:
        payload = rng.randint(0, 4096)
    return wire.encode_header(
        kind,
        rng.getrandbits(64),
        key,
        rng.randbytes(16),
        payload_length=payload,
        checksum=rng.getrandbits(64) if kind == wire.BLOCK else 0,
    )


def recrc(body: bytearray) -> bytes:
    body = bytearray(body[: wire.HEADER_SIZE - 4])
    return bytes(body) + struct.pack("<I", _core.crc32c(bytes(body)))


def one_input(rng: random.Random) -> tuple[str, bytes, bytes | None]:
    """(kind, input, the valid header it came from when it must decode to the same or fail)."""
    choice = rng.randrange(6)
    if choice == 0:
        return "random", rng.randbytes(rng.randint(0, 2 * wire.HEADER_SIZE)), None
    if choice == 1:
        return "random-96", rng.randbytes(wire.HEADER_SIZE), None
    good = valid_header(rng)
    if choice == 2:
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        return ("mutated" if data != good else "mutated-back"), bytes(data), good
    if choice == 3:
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(wire.HEADER_SIZE - 4)] = rng.randrange(256)
        return "mutated+crc", recrc(data), good
    if choice == 4:
        return "resized", good[: rng.randrange(len(good))] + rng.randbytes(rng.randint(0, 8)), None
    return "valid", good, good


def fuzz(iterations: int, seed: int) -> collections.Counter[str]:
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    for i in range(iterations):
        kind, data, origin = one_input(rng)
        try:
            header = wire.decode_header(data, max_payload=MAX_PAYLOAD)
        except FrameError as exc:
            counts[f"{kind}: refused ({exc.reason})"] += 1
            continue
        except Exception as exc:  # the one thing this script looks for
            print(f"FAIL at iteration {i} (seed {seed}): {kind} input {data.hex()} raised {exc!r}")
            raise SystemExit(1) from None
        if kind in ("mutated", "valid") and data != origin:
            print(f"FAIL at iteration {i} (seed {seed}): a damaged header decoded: {data.hex()}")
            raise SystemExit(1)
        if kind == "mutated+crc" and data != origin:
            again = wire.encode_header(
                header.frame_type,
                header.request_id,
                header.key,
                header.fingerprint,
                payload_length=header.payload_length,
                checksum=header.checksum,
                checksum_scheme=header.checksum_scheme,
            )
            if again != data:
                print(
                    f"FAIL at iteration {i} (seed {seed}): {data.hex()} decodes but does not "
                    "re-encode to the same bytes"
                )
                raise SystemExit(1)
        counts[f"{kind}: decoded"] += 1
    return counts


def main(argv: list[str]) -> int:
    iterations = int(float(argv[1])) if len(argv) > 1 else 1_000_000
    seed = int(argv[2]) if len(argv) > 2 else random.randrange(2**32)
    start = time.perf_counter()
    counts = fuzz(iterations, seed)
    elapsed = time.perf_counter() - start
    for name, count in sorted(counts.items()):
        print(f"{count:>10}  {name}")
    print(f"{iterations} inputs in {elapsed:.1f} s (seed {seed}): no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
