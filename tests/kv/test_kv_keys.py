"""Block keys of the KV store, scheme ``blake2b-chain-v1``: golden vectors, chaining, namespace
isolation, the same keys in every process, and token-list validation.

The reference below follows the module docstring of ``tpusync._src.kv.keys`` with nothing but
``hashlib`` and ``struct``; the literal hex values pin the scheme, so any change to it (field
order, encoding, personalisation, digest size) fails here and must come with a new scheme name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import signal
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpusync._src.kv.keys import DEFAULT_SECRET, KEY_BYTES, TAG_BYTES, check_tokens
from tpusync.errors import InvalidArgumentError, TpuSyncError
from tpusync.kv import Blake2bChainKeys, DramTier, KeyScheme, KVStoreConfig, Namespace

SECRET = b"golden-secret"
GOLDEN_NS = Namespace(
    model_id="golden-model",
    layout_fingerprint=bytes(range(16)),
    weight_version="7",
    shard_rank=1,
    shard_count=2,
    salt=b"tenant-a",
)
GOLDEN_TOKENS = [(i * 7919) % 100003 for i in range(40)]  # 2 full blocks of 16, a tail of 8
CHILD_TIMEOUT_S = 60.0

# --- the reference: hashlib only, straight from the module docstring ---------------------------


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def ref_namespace_digest(ns: Namespace, secret: bytes) -> bytes:
    encoded = b"".join(
        _field(f)
        for f in (
            ns.model_id.encode("utf-8"),
            ns.weight_version.encode("utf-8"),
            ns.layout_fingerprint,
            struct.pack("<I", ns.shard_rank),
            struct.pack("<I", ns.shard_count),
            ns.salt,
        )
    )
    return hashlib.blake2b(encoded, digest_size=16, key=secret, person=b"tpusync-ns-v1").digest()


def ref_block_keys(ns: Namespace, secret: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    digest = ref_namespace_digest(ns, secret)
    chain = digest
    keys = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        chain = hashlib.blake2b(
            chain + struct.pack(f"<{block_size}I", *block),
            digest_size=16,
            key=secret,
            person=b"tpusync-kv-v1",
        ).digest()
        keys.append(digest[:8] + chain)
    return keys


def ref_tail_key(
    ns: Namespace, secret: bytes, parent: bytes | None, session_id: str, tail: list[int]
) -> bytes:
    digest = ref_namespace_digest(ns, secret)
    chain = digest if parent is None else parent[8:]
    sid = session_id.encode("utf-8")
    value = hashlib.blake2b(
        chain + struct.pack("<I", len(sid)) + sid + struct.pack(f"<{len(tail)}I", *tail),
        digest_size=16,
        key=secret,
        person=b"tpusync-tail-v1",
    ).digest()
    return digest[:8] + value


# --- golden vectors ----------------------------------------------------------------------------


def test_scheme_name_and_constants():
    scheme = Blake2bChainKeys(SECRET)
    assert scheme.name == "blake2b-chain-v1"
    assert (KEY_BYTES, TAG_BYTES) == (24, 8)
    assert isinstance(scheme, KeyScheme)


def test_golden_literal_vectors():
    """Literal values: a change of the scheme must change its name (and these vectors)."""
    scheme = Blake2bChainKeys(SECRET)
    assert scheme.namespace_digest(GOLDEN_NS).hex() == "63fcf18abd645f43ab2bf93fe1bff6a4"
    assert scheme.namespace_tag(GOLDEN_NS).hex() == "63fcf18abd645f43"
    keys = scheme.block_keys(GOLDEN_NS, np.array(GOLDEN_TOKENS, dtype=np.uint32), 16)
    assert [k.hex() for k in keys] == [
        "63fcf18abd645f4353640df6848fca3215b9c4d127400d1b",
        "63fcf18abd645f435b2cc5d22c719e0b176c5f57d59cc975",
    ]
    tail = scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1", np.array(GOLDEN_TOKENS[32:]))
    assert tail.hex() == "63fcf18abd645f43cff7bc98a2c94447138e562f670dcded"
    lone = scheme.tail_key(GOLDEN_NS, None, "sess-1", np.array(GOLDEN_TOKENS[:5]))
    assert lone.hex() == "63fcf18abd645f43fc654b93258fb11241810aaef0e850a6"


def test_golden_literal_vectors_default_secret():
    """The development secret and the namespace defaults are part of the scheme too."""
    assert DEFAULT_SECRET == b"tpusync-development-secret"
    ns = Namespace("m", b"\x01")
    scheme = Blake2bChainKeys()
    assert scheme.namespace_digest(ns).hex() == "a041f80b7e82e12d10c294b0980e0d21"
    assert [k.hex() for k in scheme.block_keys(ns, np.arange(1, 9), 4)] == [
        "a041f80b7e82e12d53b654217e1cec6af0363a0cd254cb02",
        "a041f80b7e82e12d5a583fbbdd1e56b822a9fe217294a8e2",
    ]


def test_golden_matches_reference():
    scheme = Blake2bChainKeys(SECRET)
    tokens = np.array(GOLDEN_TOKENS, dtype=np.uint32)
    assert scheme.namespace_digest(GOLDEN_NS) == ref_namespace_digest(GOLDEN_NS, SECRET)
    keys = scheme.block_keys(GOLDEN_NS, tokens, 16)
    assert keys == ref_block_keys(GOLDEN_NS, SECRET, GOLDEN_TOKENS, 16)
    assert all(len(k) == KEY_BYTES for k in keys)
    assert all(k[:TAG_BYTES] == ref_namespace_digest(GOLDEN_NS, SECRET)[:8] for k in keys)
    assert scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1", tokens[32:]) == ref_tail_key(
        GOLDEN_NS, SECRET, keys[-1], "sess-1", GOLDEN_TOKENS[32:]
    )


def test_namespace_encoding_is_length_prefixed_utf8():
    ns = Namespace("modèle-🦙", b"\xff\x00", "v2", 3, 4, b"\x00salt")
    expected = (
        _field("modèle-🦙".encode())
        + _field(b"v2")
        + _field(b"\xff\x00")
        + _field(struct.pack("<I", 3))
        + _field(struct.pack("<I", 4))
        + _field(b"\x00salt")
    )
    assert ns.encode() == expected
    assert Blake2bChainKeys(SECRET).namespace_digest(ns) == ref_namespace_digest(ns, SECRET)


_text = st.text(min_size=1, max_size=12)
_namespaces = st.builds(
    lambda model, fp, wv, count, rank, salt: Namespace(model, fp, wv, rank % count, count, salt),
    _text,
    st.binary(min_size=1, max_size=20),
    st.text(max_size=8),
    st.integers(1, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=16),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ns=_namespaces,
    secret=st.binary(min_size=1, max_size=64),
    block_size=st.integers(1, 40),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=130),
)
def test_matches_reference_property(ns, secret, block_size, tokens):
    scheme = Blake2bChainKeys(secret)
    toks = check_tokens(tokens)
    keys = scheme.block_keys(ns, toks, block_size)
    assert keys == ref_block_keys(ns, secret, tokens, block_size)
    assert len(keys) == len(tokens) // block_size
    n_full = len(keys) * block_size
    parent = keys[-1] if keys else None
    tail = tokens[n_full:]
    assert scheme.tail_key(ns, parent, "s", toks[n_full:]) == ref_tail_key(
        ns, secret, parent, "s", tail
    )


# --- chaining ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 16),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=100),
    data=st.data(),
)
def test_key_depends_on_every_earlier_token(block_size, tokens, data):
    scheme = Blake2bChainKeys(SECRET)
    keys = scheme.block_keys(GOLDEN_NS, check_tokens(tokens), block_size)
    j = data.draw(st.integers(0, len(tokens) - 1), label="changed position")
    delta = data.draw(st.integers(1, 2**32 - 1), label="delta")
    changed = list(tokens)
    changed[j] = (changed[j] + delta) % 2**32
    other = scheme.block_keys(GOLDEN_NS, check_tokens(changed), block_size)
    assert len(other) == len(keys)
    first = j // block_size
    assert other[:first] == keys[:first]  # blocks before the change are untouched
    for i in range(first, len(keys)):  # every block at or after it changes
        assert other[i] != keys[i], (i, j)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 16),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=100),
    extra=st.lists(st.integers(0, 2**32 - 1), max_size=40),
)
def test_identical_prefixes_give_identical_keys(block_size, tokens, extra):
    scheme = Blake2bChainKeys(SECRET)
    short = scheme.block_keys(GOLDEN_NS, check_tokens(tokens), block_size)
    long = scheme.block_keys(GOLDEN_NS, check_tokens(tokens + extra), block_size)
    assert long[: len(short)] == short
    assert len(short) == len(tokens) // block_size  # only full blocks get keys
    assert len(long) == (len(tokens) + len(extra)) // block_size
    assert len(set(long)) == len(long)  # a chain value names its whole prefix


def test_only_full_blocks_get_keys():
    scheme = Blake2bChainKeys(SECRET)
    for n in (0, 1, 15):
        assert scheme.block_keys(GOLDEN_NS, np.arange(1, n + 1), 16) == []
    assert len(scheme.block_keys(GOLDEN_NS, np.arange(1, 17), 16)) == 1
    assert len(scheme.block_keys(GOLDEN_NS, np.arange(1, 48), 16)) == 2
    assert len(scheme.block_keys(GOLDEN_NS, np.arange(1, 49), 16)) == 3


def test_same_keys_for_every_integer_input_form():
    scheme = Blake2bChainKeys(SECRET)
    expected = scheme.block_keys(GOLDEN_NS, np.array(GOLDEN_TOKENS, dtype=np.uint32), 16)
    for form in (
        GOLDEN_TOKENS,
        tuple(GOLDEN_TOKENS),
        np.array(GOLDEN_TOKENS, dtype=np.int64),
        np.array(GOLDEN_TOKENS, dtype=np.uint64),
        np.array(GOLDEN_TOKENS, dtype=np.int32),
        [np.int64(t) for t in GOLDEN_TOKENS],
    ):
        assert scheme.block_keys(GOLDEN_NS, check_tokens(form), 16) == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_id", "golden-model2"),
        ("weight_version", "8"),
        ("layout_fingerprint", bytes(range(1, 17))),
        ("shard_rank", 0),
        ("shard_count", 3),
        ("salt", b"tenant-b"),
        ("salt", b""),
    ],
)
def test_every_namespace_field_changes_every_key(field, value):
    scheme = Blake2bChainKeys(SECRET)
    tokens = check_tokens(GOLDEN_TOKENS)
    other_ns = dataclasses.replace(GOLDEN_NS, **{field: value})
    assert other_ns != GOLDEN_NS
    keys = scheme.block_keys(GOLDEN_NS, tokens, 8)
    other = scheme.block_keys(other_ns, tokens, 8)
    assert len(keys) == len(other) == 5
    assert not set(keys) & set(other)
    assert scheme.namespace_tag(other_ns) != scheme.namespace_tag(GOLDEN_NS)
    assert all(k[:TAG_BYTES] == scheme.namespace_tag(other_ns) for k in other)
    assert scheme.tail_key(other_ns, None, "s", tokens[:3]) != scheme.tail_key(
        GOLDEN_NS, None, "s", tokens[:3]
    )


def test_field_boundaries_are_unambiguous():
    """Length prefixes: moving bytes between adjacent fields changes the digest."""
    scheme = Blake2bChainKeys(SECRET)
    a = Namespace("ab", b"\x01", "c")
    b = Namespace("a", b"\x01", "bc")
    assert scheme.namespace_digest(a) != scheme.namespace_digest(b)


def test_secret_changes_every_key():
    tokens = check_tokens(GOLDEN_TOKENS)
    keys = Blake2bChainKeys(SECRET).block_keys(GOLDEN_NS, tokens, 8)
    for secret in (b"golden-secreT", SECRET + b"\0", b"x", DEFAULT_SECRET, b"\xff" * 64):
        other = Blake2bChainKeys(secret).block_keys(GOLDEN_NS, tokens, 8)
        assert not set(keys) & set(other), secret
        assert other[0][:TAG_BYTES] != keys[0][:TAG_BYTES]


def test_tail_key():
    scheme = Blake2bChainKeys(SECRET)
    tokens = check_tokens(GOLDEN_TOKENS)
    keys = scheme.block_keys(GOLDEN_NS, tokens, 16)
    tail = tokens[32:]
    key = scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1", tail)
    assert len(key) == KEY_BYTES
    assert key[:TAG_BYTES] == scheme.namespace_tag(GOLDEN_NS)
    assert key not in keys
    # a block key of the same tokens (tail padded to a full block under the kv personalisation)
    assert key not in scheme.block_keys(GOLDEN_NS, tokens[:40], 8)
    assert scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1", tail.copy()) == key  # deterministic
    others = {
        scheme.tail_key(GOLDEN_NS, keys[-1], "sess-2", tail),  # session id
        scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1 ", tail),
        scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1", tail[:-1]),  # tail tokens
        scheme.tail_key(GOLDEN_NS, keys[-1], "sess-1", np.append(tail[:-1], tail[-1] + 1)),
        scheme.tail_key(GOLDEN_NS, keys[0], "sess-1", tail),  # parent
        scheme.tail_key(GOLDEN_NS, None, "sess-1", tail),
        scheme.tail_key(dataclasses.replace(GOLDEN_NS, salt=b"x"), keys[-1], "sess-1", tail),
        Blake2bChainKeys(b"other").tail_key(GOLDEN_NS, keys[-1], "sess-1", tail),
    }
    assert key not in others
    assert len(others) == 8


def test_tail_key_session_id_is_length_prefixed():
    """A session id's bytes can't shift into the tail tokens: "a" + tail != "a\\x01..." ."""
    scheme = Blake2bChainKeys(SECRET)
    a = scheme.tail_key(GOLDEN_NS, None, "a", np.array([1, 2], dtype=np.uint32))
    b = scheme.tail_key(GOLDEN_NS, None, "a\x01\x00\x00\x00", np.array([2], dtype=np.uint32))
    assert a != b


# --- the same keys in another process ----------------------------------------------------------


def _child_keys(conn: Any, secret: bytes, ns: Namespace, tokens: list[int], block_size: int):
    try:
        from tpusync._src.kv.keys import check_tokens as check
        from tpusync.kv import Blake2bChainKeys as Scheme

        scheme = Scheme(secret)
        toks = check(tokens)
        keys = scheme.block_keys(ns, toks, block_size)
        n_full = len(keys) * block_size
        tail = scheme.tail_key(ns, keys[-1] if keys else None, "child", toks[n_full:])
        conn.send(("ok", [*keys, tail], os.getpid()))
    except BaseException as error:  # report, don't hang the parent
        conn.send(("error", repr(error), os.getpid()))
    finally:
        conn.close()


def test_keys_identical_in_a_spawned_process(rng):
    tokens = rng.integers(0, 2**32, size=101, dtype=np.uint64).tolist()
    ns = dataclasses.replace(GOLDEN_NS, salt=rng.bytes(8))
    scheme = Blake2bChainKeys(SECRET)
    keys = scheme.block_keys(ns, check_tokens(tokens), 16)
    expected = [*keys, scheme.tail_key(ns, keys[-1], "child", check_tokens(tokens)[96:])]

    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_keys, args=(child_end, SECRET, ns, tokens, 16), daemon=True)
    child.start()
    child_end.close()
    try:
        assert parent_end.poll(CHILD_TIMEOUT_S), "the child sent nothing in time"
        status, got, pid = parent_end.recv()
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == 0
    finally:
        parent_end.close()
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
    assert status == "ok", got
    assert pid != os.getpid()
    assert got == expected


# --- check_tokens ------------------------------------------------------------------------------

BAD_TOKENS = {
    "float list": [1.0, 2.0],
    "float mixed": [1, 2.5],
    "float array": np.array([1.0, 2.0]),
    "bool list": [True, False],
    "bool in list": [1, True],
    "bool array": np.array([True, False]),
    "string": "hello",
    "bytes": b"hello",
    "string list": ["1", "2"],
    "2-D list": [[1, 2], [3, 4]],
    "2-D array": np.ones((2, 3), dtype=np.int64),
    "0-D array": np.array(5),
    "negative": [1, -1],
    "negative array": np.array([3, -2], dtype=np.int64),
    "too large": [2**32],
    "too large array": np.array([2**32], dtype=np.int64),
    "huge": [2**64],
    "None": None,
    "int": 5,
    "dict": {1: 2},
    "None in list": [1, None],
    "complex": [1j],
}


@pytest.mark.parametrize("bad", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
def test_check_tokens_rejects(bad):
    with pytest.raises(InvalidArgumentError, match=r"^tokens: ") as info:
        check_tokens(bad)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TpuSyncError)


def test_check_tokens_names_the_argument():
    with pytest.raises(InvalidArgumentError, match=r"^prompt: "):
        check_tokens([1.5], "prompt")


@pytest.mark.parametrize(
    "good",
    [
        [0, 1, 2**32 - 1],
        (5, 6, 7),
        np.array([0, 1, 2**32 - 1], dtype=np.uint64),
        np.array([0, 1, 2**31 - 1], dtype=np.int32),
        np.array([3, 4], dtype=np.uint8),
        np.array([3, 4], dtype=np.int16),
        [np.uint32(1), np.int64(2), 3],
        range(10),
    ],
    ids=["list", "tuple", "uint64", "int32", "uint8", "int16", "numpy scalars", "range"],
)
def test_check_tokens_accepts(good):
    out = check_tokens(good)
    assert out.dtype == np.uint32
    assert out.ndim == 1
    assert out.tolist() == [int(t) for t in good]


@pytest.mark.parametrize("empty", [[], (), np.array([], dtype=np.int64)])
def test_check_tokens_empty(empty):
    out = check_tokens(empty)
    assert out.dtype == np.uint32 and out.shape == (0,)


def test_check_tokens_does_not_modify_input():
    given_ = np.array([1, 2, 3], dtype=np.int64)
    check_tokens(given_)
    assert given_.dtype == np.int64 and given_.tolist() == [1, 2, 3]


# --- Namespace and secret validation -----------------------------------------------------------

BAD_NAMESPACES = [
    ({"model_id": ""}, "model_id"),
    ({"model_id": 3}, "model_id"),
    ({"model_id": b"m"}, "model_id"),
    ({"weight_version": 1}, "weight_version"),
    ({"weight_version": None}, "weight_version"),
    ({"layout_fingerprint": b""}, "layout_fingerprint"),
    ({"layout_fingerprint": "abc"}, "layout_fingerprint"),
    ({"layout_fingerprint": bytearray(b"ab")}, "layout_fingerprint"),
    ({"salt": "tenant"}, "salt"),
    ({"salt": None}, "salt"),
    ({"shard_rank": -1}, "shard_rank"),
    ({"shard_rank": 1.0}, "shard_rank"),
    ({"shard_rank": True}, "shard_rank"),
    ({"shard_count": 0}, "shard_rank|shard_count"),
    ({"shard_count": False}, "shard_count"),
    ({"shard_count": -2}, "shard_count"),
    ({"shard_rank": 2, "shard_count": 2}, "shard_rank"),
    ({"shard_rank": 5}, "shard_rank"),
]


@pytest.mark.parametrize(
    ("fields", "argument"), BAD_NAMESPACES, ids=[repr(f) for f, _ in BAD_NAMESPACES]
)
def test_namespace_validation(fields, argument):
    kwargs = {"model_id": "m", "layout_fingerprint": b"\x01", **fields}
    with pytest.raises(InvalidArgumentError, match=rf"^({argument}): "):
        Namespace(**kwargs)


def test_namespace_is_hashable_and_frozen():
    ns = Namespace("m", b"\x01")
    assert ns == Namespace("m", b"\x01", "0", 0, 1, b"")
    assert {ns: 1}[Namespace("m", b"\x01")] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.salt = b"x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "secret",
    [b"", b"x" * 65, "secret", None, bytearray(b"secret"), 12],
    ids=["empty", "65 bytes", "str", "None", "bytearray", "int"],
)
def test_secret_validation(secret):
    with pytest.raises(InvalidArgumentError, match=r"^secret: "):
        Blake2bChainKeys(secret)


def test_secret_limits_accepted():
    for secret in (b"x", b"y" * 64):
        keys = Blake2bChainKeys(secret).block_keys(GOLDEN_NS, np.arange(1, 17), 16)
        assert keys == ref_block_keys(GOLDEN_NS, secret, list(range(1, 17)), 16)


def test_repr_never_shows_the_secret():
    secret = b"do-not-print-me-0123"
    scheme = Blake2bChainKeys(secret)
    for text in (repr(scheme), str(scheme), f"{scheme!r}"):
        assert "do-not-print" not in text
        assert secret.hex() not in text
        assert "blake2b-chain-v1" in text
    config = KVStoreConfig("m", 16, DramTier(4), secret=secret)
    assert "do-not-print" not in repr(config)
    assert secret.hex() not in repr(config)


# --- the native BLAKE2b behind the chain ------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(max_size=700),
    key=st.binary(max_size=64),
    person=st.binary(max_size=16),
    digest_size=st.integers(1, 64),
)
def test_native_blake2b_equals_hashlib(
    data: bytes, key: bytes, person: bytes, digest_size: int
) -> None:
    from tpusync._native import core as _core

    expected = hashlib.blake2b(data, key=key, person=person, digest_size=digest_size).digest()
    assert _core.blake2b(data, key, person, digest_size) == expected


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.sampled_from([1, 3, 16, 32, 128]),
    secret=st.binary(min_size=1, max_size=64),
)
def test_block_keys_equal_the_hashlib_chain(tokens: list, block_size: int, secret: bytes) -> None:
    """The C chain gives the keys the scheme's definition gives (module docstring), computed
    here block by block with hashlib."""
    scheme = Blake2bChainKeys(secret)
    ns = Namespace("m", b"\x01" * 16)
    array = np.array(tokens, dtype=np.uint32)
    digest = scheme.namespace_digest(ns)
    parent, expected = digest, []
    for i in range(len(tokens) // block_size):
        piece = array[i * block_size : (i + 1) * block_size].astype("<u4").tobytes()
        parent = hashlib.blake2b(
            parent + piece, digest_size=16, key=secret, person=b"tpusync-kv-v1"
        ).digest()
        expected.append(digest[:TAG_BYTES] + parent)
    assert scheme.block_keys(ns, array, block_size) == expected


def test_native_blake2b_refuses_bad_sizes() -> None:
    from tpusync._native import core as _core

    for kwargs in ({"key": b"k" * 65}, {"person": b"p" * 17}, {"digest_size": 0}):
        with pytest.raises(ValueError, match="BLAKE2b"):
            _core.blake2b(b"x", **kwargs)
    with pytest.raises(ValueError, match="step"):
        _core.blake2b_chain(b"s" * 16, b"data", 0)


def test_native_chain_ignores_a_partial_last_piece_and_empty_input() -> None:
    from tpusync._native import core as _core

    start, key = b"s" * 16, b"k" * 32
    data = bytes(range(100))
    keys = _core.blake2b_chain(start, data, 40, key, b"p", b"tag")
    assert len(keys) == 2  # the last 20 bytes are not a whole piece
    first = hashlib.blake2b(start + data[:40], key=key, person=b"p", digest_size=16).digest()
    second = hashlib.blake2b(first + data[40:80], key=key, person=b"p", digest_size=16).digest()
    assert keys == [b"tag" + first, b"tag" + second]
    assert _core.blake2b_chain(start, b"", 40, key) == []
