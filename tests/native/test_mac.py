"""Keyed MACs of block files: Poly1305 against an independent model, and the
shared-FS tier with ``mac_key``: anyone who can write its files but lacks the secret forges
nothing that is served."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import mac as _mac
from tpusync._src.tiers.mac import MacKey, mac_key_from_secret
from tpusync.errors import BlocksMissingError, InvalidArgumentError
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout, SharedFsPool

SECRET = b"this deployment's own secret"


def poly1305_model(key: bytes, message: bytes) -> bytes:
    """RFC 8439 section 2.5.1, with Python integers."""
    r = int.from_bytes(key[:16], "little") & 0x0FFFFFFC0FFFFFFC0FFFFFFC0FFFFFFF
    s = int.from_bytes(key[16:], "little")
    p = (1 << 130) - 5
    accumulator = 0
    for i in range(0, len(message), 16):
        chunk = message[i : i + 16] + b"\x01"
        accumulator = (accumulator + int.from_bytes(chunk, "little")) * r % p
    return ((accumulator + s) % (1 << 128)).to_bytes(16, "little")


def test_rfc_8439_vector() -> None:
    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    message = b"Cryptographic Forum Research Group"
    assert _mac.poly1305(key, message).hex() == "a8061dc1305136c6c22b8baf0c0127a9"
    assert poly1305_model(key, message) == _mac.poly1305(key, message)


@settings(max_examples=300, deadline=None)
@given(key=st.binary(min_size=32, max_size=32), message=st.binary(max_size=300))
def test_matches_the_model(key: bytes, message: bytes) -> None:
    assert _mac.poly1305(key, message) == poly1305_model(key, message)


@pytest.mark.parametrize("fill", [0x00, 0xFF])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 4096, 65537])
def test_extreme_keys_and_lengths(fill: int, n: int, rng: np.random.Generator) -> None:
    """All-ones keys and payloads push every limb to its carry limit."""
    message = bytes([fill]) * n
    for key in (b"\xff" * 32, bytes(16) + b"\xff" * 16, rng.bytes(32)):
        assert _mac.poly1305(key, message) == poly1305_model(key, message)


def test_regions_match_one_by_one(rng: np.random.Generator) -> None:
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 5, 4096, 70001)]
    keys = rng.integers(0, 256, (len(buffers), 32), dtype=np.uint8)
    starts = np.array([b.ctypes.data for b in buffers], dtype=np.uint64)
    lengths = np.array([b.size for b in buffers], dtype=np.uint64)
    tags = _mac.poly1305_regions(keys, starts, lengths)
    for i, b in enumerate(buffers):
        assert tags[i].tobytes() == poly1305_model(keys[i].tobytes(), b.tobytes())


def test_bad_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        _mac.poly1305(b"short", b"")
    with pytest.raises(InvalidArgumentError, match="mac_key"):
        MacKey(b"x" * 31)
    with pytest.raises(InvalidArgumentError, match="secret"):
        mac_key_from_secret(b"")
    assert repr(mac_key_from_secret(SECRET)) == "MacKey(...)"


# --- the shared-FS tier ------------------------------------------------------------------------


def make_layout() -> PoolLayout:
    return PoolLayout("mac-test", (ArrayLayout("kv", "uint8", (8192,), 0, 1),))


def fill(pool: HostPool, keys: list[bytes], rng: np.random.Generator) -> list[np.ndarray]:
    reservation = pool.reserve(keys)
    payloads = []
    for slot in reservation.slots.tolist():
        data = rng.integers(1, 256, pool.layout.slot_bytes, dtype=np.uint8)
        view = pool.slot_memory(slot)
        np.frombuffer(view, np.uint8)[:] = data
        view.release()
        payloads.append(data)
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    return payloads


def read(pool: HostPool, key: bytes) -> np.ndarray:
    slot = pool.slot_of(key)
    assert slot is not None
    view = pool.slot_memory(slot)
    data = np.frombuffer(view, np.uint8).copy()
    view.release()
    return data


def test_shared_fs_blocks_round_trip_with_a_mac(tmp_path: Path, rng: np.random.Generator) -> None:
    layout, keys = make_layout(), [bytes([i]) * 16 for i in range(1, 7)]
    key = mac_key_from_secret(SECRET)
    with HostPool(layout, 8) as dram, SharedFsPool(layout, tmp_path, mac_key=key) as shared:
        payloads = fill(dram, keys, rng)
        assert shared.mac and shared.put(keys, dram) == len(keys)
        with HostPool(layout, 8) as target:
            shared.get(keys, target)
            for k, p in zip(keys, payloads, strict=True):
                assert np.array_equal(read(target, k), p)
    with SharedFsPool(layout, tmp_path) as plain, HostPool(layout, 8) as target:
        plain.get(keys, target)  # a reader without the key still reads (and checksums) them


def forge(tmp_path: Path, key: bytes, payload: np.ndarray) -> None:
    """What anyone who can write the directory can do without the secret: write a whole,
    checksummed block file of their own under a tenant's key (tpusync's own writer)."""
    layout = make_layout()
    with HostPool(layout, 2) as dram, SharedFsPool(layout, tmp_path) as writer:
        reservation = dram.reserve([key])
        view = dram.slot_memory(int(reservation.slots[0]))
        np.frombuffer(view, np.uint8)[:] = payload
        view.release()
        dram.commit(reservation, dram.hash_slots(reservation.slots))
        writer.put([key], dram, overwrite=True)


def test_a_forged_block_is_served_without_a_mac_and_a_miss_with_one(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    layout, keys = make_layout(), [bytes([i]) * 16 for i in range(1, 4)]
    mac_key = mac_key_from_secret(SECRET)
    forged = rng.integers(1, 256, layout.slot_bytes, dtype=np.uint8)
    with HostPool(layout, 8) as dram, SharedFsPool(layout, tmp_path, mac_key=mac_key) as shared:
        payloads = fill(dram, keys, rng)
        shared.put(keys, dram)
        path = Path(shared.path_of(keys[1]))
        genuine = path.read_bytes()
        forge(tmp_path, keys[1], forged)
        # Without a MAC the checksums cannot tell: the forged bytes are served.
        with SharedFsPool(layout, tmp_path) as plain, HostPool(layout, 8) as target:
            plain.get([keys[1]], target)
            assert np.array_equal(read(target, keys[1]), forged)
        # With it the forgery is a miss, the others are served.
        with HostPool(layout, 8) as target:
            with pytest.raises(BlocksMissingError) as caught:
                shared.get(keys, target)
            assert caught.value.loaded == [True, False, True] and caught.value.corrupt == 1
            assert np.array_equal(read(target, keys[0]), payloads[0])
        # Copying a genuine tag onto the forged file does not help either.
        forge(tmp_path, keys[1], forged)
        data = bytearray(path.read_bytes())
        data[168 : 168 + 36] = genuine[168 : 168 + 36]
        path.write_bytes(bytes(data))
        with HostPool(layout, 8) as target:
            with pytest.raises(BlocksMissingError) as caught:
                shared.get([keys[1]], target)
            assert caught.value.corrupt == 1 and not target.contains([keys[1]])[0]
        # One flipped payload bit of a genuine file: a miss too.
        shared.put([keys[2]], dram, overwrite=True)
        path = Path(shared.path_of(keys[2]))
        data = bytearray(path.read_bytes())
        data[4096 + int(rng.integers(layout.slot_bytes))] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(data))
        with HostPool(layout, 8) as target, pytest.raises(BlocksMissingError):
            shared.get([keys[2]], target)


def test_store_refuses_a_mac_keyed_by_the_public_default_secret(tmp_path: Path) -> None:
    import jax.numpy as jnp

    from tpusync import DevicePool
    from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig, SharedFsTier

    pools = [DevicePool(jnp.ones((8, 16, 2, 4), jnp.float32))]
    config = KVStoreConfig(
        "mac", block_size=16, dram=DramTier(8), tiers=(SharedFsTier(tmp_path, mac=True),)
    )
    with pytest.raises(InvalidArgumentError, match=r"shared_fs\.mac.*secret"):
        KVCacheStore(config, pools)
    with pytest.raises(InvalidArgumentError, match=r"shared_fs\.mac"):
        SharedFsTier(tmp_path, mac="yes")  # type: ignore[arg-type]
    config = KVStoreConfig(
        "mac",
        block_size=16,
        dram=DramTier(8),
        tiers=(SharedFsTier(tmp_path, mac=True),),
        secret=SECRET,
    )
    with KVCacheStore(config, pools) as store:
        assert store._stack.names[-1] == "shared_fs"
