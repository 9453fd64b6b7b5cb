"""An independent model of tpusync's piece checksum, sum64 format 1, written from its description
in docs/decisions/0002-fused-checksum.md and include/tpusync/checksum.h, not from the C code: the
oracle the native kernels are compared with (tests/native/test_sum64_oracle.py).

Plain Python integers and a bytewise CRC-32C table, so that every step can be read against the
description; NumPy only splits the input into the lanes' words. About half a second per MiB.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
CASTAGNOLI_REFLECTED = 0x82F63B78  # CRC-32C's polynomial, bit-reversed (the reflected form)
LANE_MIXER = 0x9E3779B185EBCA87
LENGTH_MIXER = 0xC2B2AE3D27D4EB4F
FMIX64_MULTIPLIERS = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def _crc_table() -> list[int]:
    """The bytewise table of reflected CRC-32C: the register after shifting one byte through."""
    table = []
    for byte in range(256):
        register = byte
        for _ in range(8):
            register = (register >> 1) ^ (CASTAGNOLI_REFLECTED if register & 1 else 0)
        table.append(register)
    return table


CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """Standard CRC-32C: reflected, initial value and final xor 0xFFFFFFFF."""
    table = CRC_TABLE
    register = 0xFFFFFFFF
    for byte in data:
        register = table[(register ^ byte) & 0xFF] ^ (register >> 8)
    return register ^ 0xFFFFFFFF


def lane_streams(data: bytes | memoryview | np.ndarray) -> tuple[bytes, bytes, bytes]:
    """The bytes each lane's CRC runs over: 8-byte word i goes to lane i % 3 (words in order,
    each word's bytes in memory order), then the n % 8 trailing bytes to lane 0."""
    raw = np.frombuffer(memoryview(data).tobytes(), dtype=np.uint8)
    n_words = raw.size // 8
    words = raw[: n_words * 8].reshape(n_words, 8)
    tail = raw[n_words * 8 :].tobytes()
    return words[0::3].tobytes() + tail, words[1::3].tobytes(), words[2::3].tobytes()


def rotate_left64(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (64 - bits))) & MASK64


def fmix64(h: int) -> int:
    """MurmurHash3's 64-bit finalizer."""
    first, second = FMIX64_MULTIPLIERS
    h ^= h >> 33
    h = (h * first) & MASK64
    h ^= h >> 33
    h = (h * second) & MASK64
    h ^= h >> 33
    return h


def mix(c0: int, c1: int, c2: int, length: int) -> int:
    """The three lane CRCs and the byte length mixed into the 64-bit checksum."""
    h = (c1 << 32) | c0
    h ^= rotate_left64((((c2 << 32) | c2) * LANE_MIXER) & MASK64, 29)
    h ^= (length * LENGTH_MIXER) & MASK64
    return fmix64(h)


def sum64(data: bytes | memoryview | np.ndarray) -> int:
    """The piece checksum (format 1) of `data`'s bytes."""
    streams = lane_streams(data)
    length = sum(len(stream) for stream in streams)
    return mix(*(crc32c(stream) for stream in streams), length)
