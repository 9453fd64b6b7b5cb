"""Fuzzing the on-disk formats of the disk tier, the shared-filesystem tier and session manifests
with mutations of real files.

Each ``fuzz_*`` function writes a small real tier (or a real manifest) into a directory, then, for
each iteration until its count or time budget is spent, restores the pristine files, damages them
(bit flips, truncations, extensions, random bytes, fields rewritten with their checksum fixed so
that the field checks -- not the checksum -- must catch them, huge numbers, records copied or
swapped, JSON edits with the digest recomputed), and opens and reads what is there. The rules:

* nothing raises but the format's documented error, which the tier turns into a miss or a cold
  start (:class:`~tpusync.errors.PoolFormatError` on open with ``on_mismatch="error"``,
  :class:`~tpusync.errors.BlocksMissingError` from ``get``,
  :class:`~tpusync._src.kv.sessions.ManifestError` from a manifest); every call returns;
* every block served under a key that was stored has exactly the bytes stored under it.

A broken rule raises :class:`FuzzFailure` naming the mutation, the iteration and the seed. The
functions return how often each outcome happened. Used by ``tests/tiers/test_damaged_files.py`` (a
few seconds each) and ``scripts/fuzz_files.py`` (longer runs).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.kv import sessions as manifests_module
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.disk import file_format as disk_module
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.dram.pool_file import COMMITTED, PAGE, RECORD_DTYPE
from tpusync._src.tiers.layout import ArrayLayout, PoolLayout
from tpusync._src.tiers.shared_fs import SharedFsPool
from tpusync._src.tiers.shared_fs import file_format as sfs_module
from tpusync.errors import BlocksMissingError, PoolFormatError

__all__ = ["FuzzFailure", "fuzz_disk_pool", "fuzz_manifests", "fuzz_shared_fs"]

PAYLOAD = 3000  # bytes of a fuzzed block (a slot of 4096: padding follows)
N_KEYS = 6
HUGE = (
    0,
    1,
    2,
    255,
    0xFFFF,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 62,
    (1 << 63) - 1,
    (1 << 64) - 1,
)


class FuzzFailure(AssertionError):
    """A fuzzed input broke the format's contract (the message says which, and how to replay)."""


def small_layout(model_id: str) -> PoolLayout:
    return PoolLayout(model_id, (ArrayLayout("kv", "uint8", (PAYLOAD,), 0, 1),))


def key_for(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def expected(key: bytes) -> bytes:
    """The payload stored under ``key``: bytes that are a function of the key, never zeros."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(1, 256, PAYLOAD, dtype=np.uint8).tobytes()


def fill(pool: HostPool, keys: list[bytes]) -> None:
    reservation = pool.reserve(keys)
    for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
        with pool.slot_memory(slot) as memory:
            memory[:PAYLOAD] = expected(key)
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def served_bytes(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None
    with pool.slot_memory(slot) as memory:
        return bytes(memory[:PAYLOAD])


# --- byte mutations ---------------------------------------------------------------------------


def flip(rng: random.Random, data: bytearray, lo: int = 0, hi: int | None = None) -> None:
    """Flips 1 to 4 random bits in ``data[lo:hi]``."""
    hi = len(data) if hi is None else min(hi, len(data))
    if hi <= lo:
        return
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)


def resize(rng: random.Random, data: bytearray) -> None:
    """Truncates ``data`` at a random point or extends it with random bytes."""
    if data and rng.random() < 0.6:
        del data[rng.randrange(len(data)) :]
    else:
        data.extend(rng.randbytes(rng.choice([1, 7, 64, 4096, rng.randint(1, 9000)])))


def number(rng: random.Random, bits: int) -> int:
    """An interesting unsigned value of ``bits`` bits: edges, powers of two, or random."""
    choice = rng.randrange(3)
    limit = (1 << bits) - 1
    if choice == 0:
        return min(rng.choice(HUGE), limit)
    if choice == 1:
        return min(1 << rng.randrange(bits), limit)
    return rng.getrandbits(bits)


def json_edit(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """``value`` (parsed JSON) with one random edit somewhere inside it."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(sorted(value))
        edited = dict(value)
        action = rng.randrange(4)
        if action == 0:
            del edited[key]
        elif action == 1:
            edited[key + "x"] = edited[key]
        else:
            edited[key] = json_edit(rng, value[key], depth + 1)
        return edited
    if isinstance(value, list) and value and rng.random() < 0.8:
        edited = list(value)
        i = rng.randrange(len(value))
        action = rng.randrange(4)
        if action == 0:
            del edited[i]
        elif action == 1:
            edited.insert(i, json_edit(rng, value[i], depth + 1))
        else:
            edited[i] = json_edit(rng, value[i], depth + 1)
        return edited
    return rng.choice(
        [
            None,
            True,
            False,
            -1,
            0,
            1.5,
            float("inf"),
            float("nan"),
            10**30,
            -(10**30),
            (1 << 64) - 1,
            "",
            "x" * rng.randint(1, 300),
            "ZZ",
            "AB" * 16,
            "ab" * 33,
            "\ud800",
            [],
            {},
            [[[[1]]]],
            {"a": [1, 2]},
            (value + 1) if isinstance(value, int) and not isinstance(value, bool) else 7,
            str(value).upper() if isinstance(value, str) else "0",
        ]
    )


def deep_json(rng: random.Random) -> bytes:
    depth = rng.choice([100, 1000, 5000, 100000])
    return b"[" * depth + b"1" + b"]" * depth


# --- the disk tier ------------------------------------------------------------------------------

_INDEX_CRC_AT = disk_module.HEADER_BYTES - 4
_INDEX_FIELDS = [  # (offset, bits) of the index header's numeric fields
    (8, 32),  # version
    (12, 32),  # header bytes
    (16, 64),  # slot bytes
    (24, 64),  # capacity
    (32, 64),  # slab slots
    (72, 32),  # description length
]
_RECORD_FIELDS = {name: (RECORD_DTYPE.fields[name][1], RECORD_DTYPE.fields[name][0]) for name in
                  RECORD_DTYPE.names}  # fmt: skip


def _fix_index_crc(data: bytearray) -> None:
    if len(data) >= disk_module.HEADER_BYTES:
        struct.pack_into("<I", data, _INDEX_CRC_AT, zlib.crc32(bytes(data[:_INDEX_CRC_AT])))


def _index_description(rng: random.Random, data: bytearray) -> None:
    """Rewrites the layout description (JSON edits, deep nesting, bad UTF-8), length and CRC
    fixed."""
    (n,) = struct.unpack_from("<I", data, 72)
    start = disk_module._INDEX_FIXED.size
    try:
        described = json.loads(bytes(data[start : start + n]))
        text = json.dumps(json_edit(rng, described)).encode()
    except (ValueError, RecursionError):  # an earlier mutation of this input broke it
        text = b"{"
    choice = rng.randrange(5)
    if choice == 0:
        text = deep_json(rng)
    elif choice == 1:
        text = b"\xff\xfe" + text
    room = _INDEX_CRC_AT - start
    text = text[:room]
    data[start:_INDEX_CRC_AT] = text.ljust(room, b"\0")
    struct.pack_into("<I", data, 72, len(text) if rng.random() < 0.9 else number(rng, 32))
    _fix_index_crc(data)


def _record_at(slot: int) -> int:
    return disk_module.HEADER_BYTES + slot * RECORD_DTYPE.itemsize


def _disk_mutations(capacity: int) -> list[tuple[str, Callable[[random.Random, dict], None]]]:
    index, slab0, slab1 = disk_module.INDEX_NAME, "slab-000000.tpd", "slab-000001.tpd"
    page = disk_module.HEADER_BYTES
    size = RECORD_DTYPE.itemsize

    def whole(files: dict) -> bool:  # an earlier mutation of this input may have cut it short
        return len(files[index]) >= page + capacity * size

    def header_flips(rng: random.Random, files: dict) -> None:
        flip(rng, files[index], 0, page)

    def header_field(rng: random.Random, files: dict) -> None:
        if not whole(files):
            return
        offset, bits = rng.choice(_INDEX_FIELDS)
        files[index][offset : offset + bits // 8] = number(rng, bits).to_bytes(bits // 8, "little")
        _fix_index_crc(files[index])

    def header_ids(rng: random.Random, files: dict) -> None:  # pool id or fingerprint
        if not whole(files):
            return
        offset = rng.choice([40, 56])
        files[index][offset : offset + 16] = rng.randbytes(16)
        _fix_index_crc(files[index])

    def description(rng: random.Random, files: dict) -> None:
        if not whole(files):
            return
        _index_description(rng, files[index])

    def record_field(rng: random.Random, files: dict) -> None:
        if not whole(files):
            return
        for _ in range(rng.randint(1, 3)):
            at = _record_at(rng.randrange(capacity))
            name = rng.choice(RECORD_DTYPE.names)
            offset, dtype = _RECORD_FIELDS[name]
            width = dtype.itemsize
            value = (
                rng.randbytes(width)
                if name == "key"
                else number(rng, 8 * width).to_bytes(width, "little")
            )
            files[index][at + offset : at + offset + width] = value

    def record_flips(rng: random.Random, files: dict) -> None:
        flip(rng, files[index], page, page + capacity * size)

    def record_copy(rng: random.Random, files: dict) -> None:  # a key twice, or in a wrong slot
        if not whole(files):
            return
        a, b = rng.sample(range(capacity), 2)
        data = files[index]
        data[_record_at(b) : _record_at(b) + size] = data[_record_at(a) : _record_at(a) + size]
        if rng.random() < 0.5:  # the copy as the newer commit
            struct.pack_into("<Q", data, _record_at(b) + 24, (1 << 40) + rng.randrange(100))

    def record_swap(rng: random.Random, files: dict) -> None:  # keys point at others' payloads
        if not whole(files):
            return
        a, b = rng.sample(range(capacity), 2)
        data = files[index]
        ra = bytes(data[_record_at(a) : _record_at(a) + size])
        data[_record_at(a) : _record_at(a) + size] = data[_record_at(b) : _record_at(b) + size]
        data[_record_at(b) : _record_at(b) + size] = ra

    def index_resize(rng: random.Random, files: dict) -> None:
        resize(rng, files[index])

    def index_random(rng: random.Random, files: dict) -> None:
        files[index][:] = rng.randbytes(rng.choice([0, 10, page, len(files[index])]))

    def a_slab(rng: random.Random, files: dict) -> bytearray:
        present = [name for name in (slab0, slab1) if name in files]
        return files[rng.choice(present)] if present else bytearray()

    def slab_header(rng: random.Random, files: dict) -> None:
        flip(rng, a_slab(rng, files), 0, page)

    def slab_payload(rng: random.Random, files: dict) -> None:
        flip(rng, a_slab(rng, files), page)

    def slab_resize(rng: random.Random, files: dict) -> None:
        resize(rng, a_slab(rng, files))

    def slab_missing(rng: random.Random, files: dict) -> None:
        files.pop(rng.choice([slab0, slab1]), None)

    def slab_swap(rng: random.Random, files: dict) -> None:
        if slab0 in files and slab1 in files:
            files[slab0], files[slab1] = files[slab1], files[slab0]

    return [
        ("index-header-flips", header_flips),
        ("index-header-field+crc", header_field),
        ("index-header-ids+crc", header_ids),
        ("index-description+crc", description),
        ("record-fields", record_field),
        ("record-flips", record_flips),
        ("record-copy", record_copy),
        ("record-swap", record_swap),
        ("index-resized", index_resize),
        ("index-random", index_random),
        ("slab-header-flips", slab_header),
        ("slab-payload-flips", slab_payload),
        ("slab-resized", slab_resize),
        ("slab-missing", slab_missing),
        ("slabs-swapped", slab_swap),
    ]


def _write_files(directory: Path, files: dict[str, bytearray]) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700)
    for name, data in files.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, bytes(data))
        finally:
            os.close(fd)


def _loop(seconds: float, iterations: int | None) -> Any:
    deadline = time.monotonic() + seconds
    i = 0
    while (iterations is None or i < iterations) and time.monotonic() < deadline:
        yield i
        i += 1


def fuzz_disk_pool(
    directory: str | os.PathLike[str],
    *,
    seconds: float = 2.0,
    iterations: int | None = None,
    seed: int = 0,
) -> collections.Counter[str]:
    """Damages a real disk pool's index and slab files and reopens and reads it, each time."""
    root = Path(directory)
    layout = small_layout("fuzz-disk")
    capacity, slab_slots = 8, 4
    keys = [key_for(i) for i in range(N_KEYS)]
    options = {"slab_slots": slab_slots, "durability": "none", "direct_io": False}
    pristine_dir = root / "pristine"
    pristine_dir.mkdir(mode=0o700)
    with HostPool(layout, capacity) as source:
        fill(source, keys)
        with DiskPool(layout, capacity, pristine_dir, **options) as disk:
            disk.put(keys, source)
    pristine = {
        p.name: p.read_bytes() for p in pristine_dir.iterdir() if p.name != disk_module.LOCK_NAME
    }
    mutations = _disk_mutations(capacity)
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    work = root / "work"
    with HostPool(layout, capacity + N_KEYS) as target:
        for i in _loop(seconds, iterations):
            files = {name: bytearray(data) for name, data in pristine.items()}
            applied = [rng.choice(mutations) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
            for _, mutate in applied:
                mutate(rng, files)
            what = "+".join(name for name, _ in applied)
            replay = f"mutation {what}, iteration {i} of fuzz_disk_pool(seed={seed})"
            _write_files(work, files)
            mode = rng.choice(["recreate", "error"])
            try:
                disk = DiskPool(layout, capacity, work, on_mismatch=mode, **options)
            except PoolFormatError:
                if mode == "error":
                    counts["refused"] += 1
                    continue
                raise FuzzFailure(
                    f"PoolFormatError with on_mismatch='recreate' ({replay})"
                ) from None
            except Exception as exc:
                raise FuzzFailure(f"{type(exc).__name__}: {exc} ({replay})") from exc
            with disk:
                _check_served(disk, target, keys, counts, replay)
    return counts


def _check_served(
    tier: Any, target: HostPool, keys: list[bytes], counts: collections.Counter[str], replay: str
) -> None:
    """Asks ``tier`` for every stored key (and any other key it lists); a key that was stored
    must come with exactly its bytes; a key never stored (a damaged record's) must not come
    with bytes that are no stored block's."""
    target.delete(target.keys())
    try:
        listed = tier.keys()
        asked = keys + [k for k in listed if k not in keys]
        try:
            tier.get(asked, target)
            loaded = [True] * len(asked)
        except BlocksMissingError as missing:
            loaded = list(missing.loaded)
    except Exception as exc:
        raise FuzzFailure(f"{type(exc).__name__}: {exc} ({replay})") from exc
    genuine = {expected(k) for k in keys}
    for key, ok in zip(asked, loaded, strict=True):
        if not ok:
            counts["miss"] += 1
            continue
        got = served_bytes(target, key)
        if key in keys:
            if got != expected(key):
                raise FuzzFailure(f"key {key.hex()} served with wrong bytes ({replay})")
            counts["served"] += 1
        elif got not in genuine:
            raise FuzzFailure(f"damaged key {key.hex()} served with bytes never stored ({replay})")
        else:
            counts["served under a damaged key"] += 1


# --- the shared-filesystem tier ---------------------------------------------------------------


def _header_field(rng: random.Random, data: bytearray, fix: bool) -> None:
    """Rewrites one header field of a block file (its header checksum fixed when ``fix``)."""
    fields = sfs_module._FIXED
    offsets = [8, 12, 16, 18, 20, 24, 56, 72, 80, 88, 96]  # version .. writer, by layout
    widths = [4, 4, 2, 2, 4, 32, 16, 8, 8, 8, 64]
    i = rng.randrange(len(offsets))
    at, width = offsets[i], widths[i]
    value = rng.randbytes(width) if width > 8 else number(rng, 8 * width).to_bytes(width, "little")
    data[at : at + width] = value
    if fix:
        struct.pack_into("<Q", data, fields.size, _core.xxh64(bytes(data[: fields.size])))


def fuzz_shared_fs(
    directory: str | os.PathLike[str],
    *,
    seconds: float = 2.0,
    iterations: int | None = None,
    seed: int = 0,
) -> collections.Counter[str]:
    """Damages a real shared-filesystem tier's block files and reads them, each time."""
    root = Path(directory)
    shared = root / "shared"
    shared.mkdir(mode=0o700)
    layout = small_layout("fuzz-shared")
    keys = [key_for(i) for i in range(N_KEYS)]
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    with (
        HostPool(layout, N_KEYS) as source,
        HostPool(layout, 2 * N_KEYS) as target,
        SharedFsPool(layout, shared, durability="none", io_threads=1) as tier,
    ):
        fill(source, keys)
        tier.put(keys, source)
        paths = [Path(tier.path_of(k)) for k in keys]
        pristine = [p.read_bytes() for p in paths]
        header = sfs_module.HEADER_BYTES

        def mutate(data: bytearray, others: list[bytes]) -> str:
            choice = rng.randrange(8)
            if choice == 0:
                flip(rng, data, 0, sfs_module.HEADER_USED)
                return "header-flips"
            if choice == 1:
                flip(rng, data, header, len(data))
                return "payload-flips"
            if choice == 2:
                _header_field(rng, data, fix=True)
                return "header-field+checksum"
            if choice == 3:
                _header_field(rng, data, fix=False)
                return "header-field"
            if choice == 4:
                resize(rng, data)
                return "resized"
            if choice == 5:
                data[:] = rng.choice(others)  # another key's whole file
                return "another-key's-file"
            if choice == 6:
                data[:header] = rng.choice(others)[:header]
                return "another-key's-header"
            data[:] = rng.randbytes(rng.choice([0, 100, header, len(data)]))
            return "random"

        for i in _loop(seconds, iterations):
            damaged = rng.sample(range(N_KEYS), rng.randint(1, 2))
            names = []
            for j in damaged:
                data = bytearray(pristine[j])
                names.append(mutate(data, [p for n, p in enumerate(pristine) if n != j]))
                paths[j].write_bytes(bytes(data))
            replay = f"mutation {'+'.join(names)}, iteration {i} of fuzz_shared_fs(seed={seed})"
            _check_served(tier, target, keys, counts, replay)
            for path, data in zip(paths, pristine, strict=True):  # restore (and repair removals)
                tmp = path.with_name(f".{path.name}.fuzz")
                tmp.write_bytes(data)
                os.chmod(tmp, 0o600)
                os.replace(tmp, path)
    return counts


# --- session manifests --------------------------------------------------------------------------


def fuzz_manifests(
    directory: str | os.PathLike[str],
    *,
    seconds: float = 2.0,
    iterations: int | None = None,
    seed: int = 0,
) -> collections.Counter[str]:
    """Damages real session manifests and decodes them, and loads them as a store does."""
    root = Path(directory)
    owner = ("fuzz-model", "ab" * 16)
    block_size = 4
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    tokens = np.array([rng.randrange(1 << 32) for _ in range(10)], dtype=np.uint32)
    keys = tuple(key_for(i) for i in range(3))
    record = manifests_module.SessionRecord("agent-7", tokens, keys)
    pristine = manifests_module.encode_manifest(record, owner)
    sessions_dir = root / "sessions"

    for i in _loop(seconds, iterations):
        data = bytearray(pristine)
        choice = rng.randrange(6)
        if choice == 0:
            flip(rng, data)
            what = "flips"
        elif choice == 1:
            resize(rng, data)
            what = "resized"
        elif choice == 2:
            data[:] = rng.randbytes(rng.randint(0, 300))
            what = "random"
        elif choice == 3:
            data[:] = deep_json(rng)
            what = "deep"
        else:
            document = json.loads(pristine)
            body = json_edit(rng, document["body"]) if rng.random() < 0.9 else document["body"]
            document = {"body": body, "digest": manifests_module.manifest_digest(body)}
            if choice == 5:
                document = json_edit(rng, document)
            data[:] = json.dumps(document).encode(errors="surrogatepass")
            what = "json-edit+digest" if choice == 4 else "json-edit"
        replay = f"mutation {what}, iteration {i} of fuzz_manifests(seed={seed})"
        try:
            decoded = manifests_module.decode_manifest(bytes(data), owner, block_size)
        except manifests_module.ManifestError:
            counts["refused"] += 1
        except Exception as exc:
            raise FuzzFailure(f"{type(exc).__name__}: {exc} ({replay})") from exc
        else:
            _check_record(decoded, block_size, replay)
            counts["decoded"] += 1
        if i % 8 == 0:  # the whole path a store takes on open, on a real directory
            _load_dir(sessions_dir, record, bytes(data), owner, block_size, replay)
    return counts


def _check_record(record: Any, block_size: int, replay: str) -> None:
    ok = (
        isinstance(record.session_id, str)
        and record.tokens.dtype == np.uint32
        and record.tokens.ndim == 1
        and all(isinstance(k, bytes) and 1 <= len(k) <= 32 for k in record.keys)
        and len(record.keys) == -(-len(record.tokens) // block_size)
    )
    if not ok:
        raise FuzzFailure(f"decoded a record that breaks the manifest's rules ({replay})")


def _load_dir(
    sessions_dir: Path,
    record: Any,
    data: bytes,
    owner: tuple[str, str],
    block_size: int,
    replay: str,
) -> None:
    shutil.rmtree(sessions_dir, ignore_errors=True)
    manifests = manifests_module.SessionManifests(sessions_dir, owner, block_size)
    manifests.put(record)
    path = manifests.path_of(record.session_id)
    path.write_bytes(data)
    try:
        loaded = manifests_module.SessionManifests(sessions_dir, owner, block_size)
    except Exception as exc:
        raise FuzzFailure(f"{type(exc).__name__} loading: {exc} ({replay})") from exc
    found = loaded.all()
    if found and (len(found) != 1 or not path.exists()):
        raise FuzzFailure(f"a loaded manifest is not the file's own ({replay})")
    if not found and path.exists():
        raise FuzzFailure(f"a refused manifest was left in place ({replay})")
    for decoded in found:
        _check_record(decoded, block_size, replay)


def damage_disk_block(directory: str | os.PathLike[str], at: int = 100) -> int:
    """Flips byte ``at`` of the payload of one committed block (the middle one) of the disk
    tier at ``directory`` (a real file on disk, as a failing medium would); returns its slot."""
    directory = Path(directory)
    records = np.frombuffer(
        (directory / "tpusync-disk.index").read_bytes(), RECORD_DTYPE, offset=PAGE
    )
    slots = np.flatnonzero(records["state"] == COMMITTED)
    if not len(slots):
        raise AssertionError(f"{directory}: no committed block to damage")
    slab = directory / "slab-000000.tpd"
    slot_bytes = (slab.stat().st_size - PAGE) // len(records)
    slot = int(slots[len(slots) // 2])
    with open(slab, "r+b") as f:
        f.seek(PAGE + slot * slot_bytes + at)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return slot
