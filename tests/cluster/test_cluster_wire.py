"""The data plane's block frame header (tpusync._src.cluster.dataplane.wire): round trips, a golden
header of version 1, every single-byte corruption refused, arbitrary bytes never raising
anything but FrameError, and the fuzz script."""

from __future__ import annotations

import runpy
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import REPO

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.wire import decode_header, encode_header
from tpusync.errors import FrameError, InvalidArgumentError, TpuSyncError

MAX = 1 << 30

# Version 1, written by hand from the module docstring's table (not by encode_header): a BLOCK
# frame of request 0x0102030405060708, key b"golden-key", fingerprint 00..0f, 65536 payload
# bytes, scheme 1, checksum 0x1122334455667788.
GOLDEN_BLOCK = bytes.fromhex(
    "54505342"  # magic
    "0100"  # version 1
    "0100"  # BLOCK
    "0807060504030201"  # request id
    "0a"  # key length 10
    + b"golden-key".hex().ljust(64, "0")  # key, zero-padded to 32 bytes
    + "000102030405060708090a0b0c0d0e0f"  # fingerprint
    "0000010000000000"  # payload length 65536
    "0100"  # checksum scheme 1
    "8877665544332211"  # checksum
    "000000000000000000"  # reserved
    "100365a9"  # CRC-32C of the 92 bytes before
)
GOLDEN_END = bytes.fromhex("545053420100040007" + "00" * 83 + "cc1ae947")


def _reseal(body: bytes | bytearray) -> bytes:
    """92 header bytes with a fresh CRC (to reach the field checks past the CRC)."""
    body = bytes(body[:92])
    return body + struct.pack("<I", _core.crc32c(body))


def test_crc32c_is_castagnoli() -> None:
    assert _core.crc32c(b"123456789") == 0xE3069283


def test_golden_headers_of_version_1() -> None:
    assert wire.HEADER_SIZE == 96 == len(GOLDEN_BLOCK) == len(GOLDEN_END)
    header = decode_header(GOLDEN_BLOCK, max_payload=MAX)
    assert header == wire.FrameHeader(
        wire.BLOCK,
        0x0102030405060708,
        b"golden-key",
        bytes(range(16)),
        65536,
        1,
        0x1122334455667788,
    )
    assert header.type_name == "BLOCK"
    again = encode_header(
        wire.BLOCK, 0x0102030405060708, b"golden-key", bytes(range(16)), 65536, 0x1122334455667788
    )
    assert again == GOLDEN_BLOCK
    end = decode_header(GOLDEN_END, max_payload=0)
    assert (end.frame_type, end.request_id, end.key, end.payload_length) == (wire.END, 7, b"", 0)
    assert encode_header(wire.END, 7, b"", bytes(16)) == GOLDEN_END


frames = st.one_of(
    st.tuples(
        st.just(wire.BLOCK),
        st.integers(0, 2**64 - 1),
        st.binary(min_size=1, max_size=32),
        st.binary(min_size=16, max_size=16),
        st.integers(0, MAX),
        st.integers(0, 2**64 - 1),
    ),
    st.tuples(
        st.just(wire.MISSING),
        st.integers(0, 2**64 - 1),
        st.binary(min_size=1, max_size=32),
        st.binary(min_size=16, max_size=16),
        st.just(0),
        st.just(0),
    ),
    st.tuples(
        st.just(wire.ERROR),
        st.integers(0, 2**64 - 1),
        st.just(b""),
        st.binary(min_size=16, max_size=16),
        st.integers(0, 4096),
        st.just(0),
    ),
    st.tuples(
        st.just(wire.END),
        st.integers(0, 2**64 - 1),
        st.just(b""),
        st.binary(min_size=16, max_size=16),
        st.just(0),
        st.just(0),
    ),
)


@settings(max_examples=300, deadline=None)
@given(frames)
def test_round_trip(frame: tuple) -> None:
    kind, rid, key, fingerprint, length, checksum = frame
    data = encode_header(kind, rid, key, fingerprint, length, checksum)
    assert len(data) == wire.HEADER_SIZE
    header = decode_header(data, max_payload=MAX)
    assert (header.frame_type, header.request_id, header.key, header.fingerprint) == (
        kind,
        rid,
        key,
        fingerprint,
    )
    assert (header.payload_length, header.checksum) == (length, checksum)
    assert header.checksum_scheme == (1 if kind == wire.BLOCK else 0)
    for view in (bytearray(data), memoryview(data)):  # any bytes-like input
        assert decode_header(view, max_payload=MAX) == header


def test_every_single_byte_corruption_is_refused() -> None:
    """CRC-32C covers all 92 bytes before it (padding and reserved included): any change of
    one byte anywhere -- 96 positions x 255 values -- is refused."""
    for good in (GOLDEN_BLOCK, GOLDEN_END):
        for position in range(wire.HEADER_SIZE):
            for flip in range(1, 256):
                data = bytearray(good)
                data[position] ^= flip
                with pytest.raises(FrameError):
                    decode_header(data, max_payload=MAX)


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.binary(min_size=96, max_size=96),
        st.binary(min_size=92, max_size=92).map(_reseal),  # passes the CRC, fails elsewhere
        st.binary(min_size=88, max_size=88).map(lambda b: _reseal(b"TPSB\x01\x00" + b[:86])),
    )
)
def test_arbitrary_bytes_raise_only_frame_error(data: bytes) -> None:
    try:
        header = decode_header(data, max_payload=MAX)
    except FrameError as exc:
        assert isinstance(exc, TpuSyncError) and isinstance(exc, ValueError)
        assert exc.reason
        return
    # Whatever decodes is a well-formed header that encodes back to exactly the same bytes.
    again = encode_header(
        header.frame_type,
        header.request_id,
        header.key,
        header.fingerprint,
        header.payload_length,
        header.checksum,
        header.checksum_scheme,
    )
    assert again == data


@pytest.mark.parametrize("value", [None, 7, "TPSB" * 24, [0] * 96, object(), 1.5])
def test_non_bytes_raise_frame_error(value: object) -> None:
    with pytest.raises(FrameError):
        decode_header(value, max_payload=MAX)


def _fields(**changes: object) -> bytes:
    """A resealed header packed from GOLDEN_BLOCK's fields with some changed (raw, unchecked)."""
    fields = {
        "magic": b"TPSB",
        "version": 1,
        "kind": wire.BLOCK,
        "rid": 5,
        "key_len": 3,
        "key": b"abc",
        "fingerprint": bytes(16),
        "length": 100,
        "scheme": 1,
        "checksum": 9,
        "reserved": bytes(9),
    }
    fields.update(changes)
    body = struct.pack("<4sHHQB32s16sQHQ9s", *fields.values())
    return _reseal(body)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"magic": b"TPSX"}, "magic"),
        ({"version": 2}, "version"),
        ({"version": 0}, "version"),
        ({"kind": 0}, "type"),
        ({"kind": 5}, "type"),
        ({"key_len": 0}, "key"),
        ({"key_len": 33}, "key"),
        ({"key_len": 255}, "key"),
        ({"key_len": 2}, "key"),  # b"c" is then padding that is not zero
        ({"key": b"abc\x00\x00\x01"}, "key"),
        ({"length": 101}, "payload"),  # above the caller's limit of 100
        ({"length": 2**64 - 1}, "payload"),
        ({"scheme": 0}, "checksum"),
        ({"scheme": 2}, "checksum"),
        ({"reserved": b"\x00" * 8 + b"\x01"}, "reserved"),
        ({"kind": wire.MISSING, "scheme": 0, "checksum": 0}, "payload"),  # MISSING has none
        ({"kind": wire.MISSING, "length": 0}, "checksum"),
        ({"kind": wire.END, "key_len": 0, "key": b"", "length": 0, "scheme": 0}, "checksum"),
        ({"kind": wire.END, "length": 0, "scheme": 0, "checksum": 0}, "key"),  # END has no key
        ({"kind": wire.ERROR, "key_len": 0, "key": b"", "scheme": 1}, "checksum"),
    ],
)
def test_each_field_is_checked(changes: dict, reason: str) -> None:
    assert decode_header(_fields(), max_payload=100).key == b"abc"
    with pytest.raises(FrameError) as info:
        decode_header(_fields(**changes), max_payload=100)
    assert info.value.reason == reason


def test_wrong_lengths_and_bad_crc() -> None:
    for data in (b"", GOLDEN_BLOCK[:95], GOLDEN_BLOCK + b"\0"):
        with pytest.raises(FrameError, match="96 bytes"):
            decode_header(data, max_payload=MAX)
    with pytest.raises(FrameError, match="CRC"):
        decode_header(GOLDEN_BLOCK[:92] + b"\0\0\0\0", max_payload=MAX)


@pytest.mark.parametrize(
    "args",
    [
        (9, 1, b"k", bytes(16)),  # unknown type
        (wire.BLOCK, -1, b"k", bytes(16)),
        (wire.BLOCK, 2**64, b"k", bytes(16)),
        (wire.BLOCK, 1, b"", bytes(16)),  # BLOCK needs a key
        (wire.BLOCK, 1, b"k" * 33, bytes(16)),
        (wire.BLOCK, 1, "k", bytes(16)),
        (wire.BLOCK, 1, b"k", bytes(15)),
        (wire.END, 1, b"k", bytes(16)),  # END has no key
        (wire.MISSING, 1, b"k", bytes(16), 5),  # MISSING has no payload
        (wire.BLOCK, 1, b"k", bytes(16), 0, 0, 7),  # unknown scheme
    ],
)
def test_encode_rejects_what_decode_refuses(args: tuple) -> None:
    with pytest.raises(InvalidArgumentError):
        encode_header(*args)


def test_max_payload_must_be_given_properly() -> None:
    with pytest.raises(InvalidArgumentError):
        decode_header(GOLDEN_BLOCK, max_payload=-1)
    with pytest.raises(FrameError, match="exceeds"):
        decode_header(GOLDEN_BLOCK, max_payload=65535)
    assert decode_header(GOLDEN_BLOCK, max_payload=65536).payload_length == 65536


def test_fuzz_script_short_run(capsys: pytest.CaptureFixture[str]) -> None:
    script = runpy.run_path(str(REPO / "scripts" / "fuzz_wire.py"), run_name="fuzz_wire")
    assert script["main"](["fuzz_wire.py", "20000", "12345"]) == 0
    out = capsys.readouterr().out
    assert "no failure" in out and "mutated: refused (crc)" in out and "valid: decoded" in out
