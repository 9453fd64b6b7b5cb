"""Block keys for prefix caching: token blocks chained under a keyed namespace digest.

Scheme ``blake2b-chain-v1`` (pinned by golden vectors in ``tests/kv/test_kv_keys.py``):

* The namespace digest is BLAKE2b-128, keyed by the deployment secret, with personalisation
  ``tpusync-ns-v1``, over the namespace's fields in a fixed order, each written as a
  little-endian uint32 length followed by its bytes (text as UTF-8; integers as little-endian
  uint32): model id, weight version, layout fingerprint, shard rank, shard count, salt.
* Token ids are cut into blocks of ``block_size``; only full blocks get keys. Block ``i``'s chain
  value is BLAKE2b-128, keyed by the secret, with personalisation ``tpusync-kv-v1``, over the
  previous chain value (the namespace digest for block 0) and the block's tokens as little-endian
  uint32. A chain value therefore names the whole prefix up to and including its block.
* A stored key is the namespace tag (the digest's first 8 bytes) followed by the chain value: 24
  bytes. The tag lets :meth:`KVCacheStore.purge` find a namespace's blocks in every tier.
* An engine's own block hashes (vLLM's, which already chain the prefix) become keys one by
  one: BLAKE2b-128, keyed, personalisation ``tpusync-eng-v1``, over the namespace digest and
  the hash (length-prefixed), behind the tag (:meth:`Blake2bChainKeys.engine_keys`).
* A session's partial last block gets a tail key: the same construction with personalisation
  ``tpusync-tail-v1`` over the last full block's chain value, the session id and the tail tokens.

No unseeded hashing anywhere: keys are the same in every process and on every machine that
shares the secret. Without the secret nobody can compute (or poison) another deployment's keys;
two tenants with different salts never share blocks.
"""

from __future__ import annotations

import hashlib
import numbers
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tpusync._native import core as _core
from tpusync.errors import InvalidArgumentError

__all__ = ["Blake2bChainKeys", "KeyScheme", "Namespace", "check_engine_hashes", "check_tokens"]

KEY_BYTES = 24
TAG_BYTES = 8
_DIGEST_BYTES = 16
_KV_PERSON = b"tpusync-kv-v1"
_ENGINE_PERSON = b"tpusync-eng-v1"
MAX_SECRET_BYTES = 64  # BLAKE2b's key limit
DEFAULT_SECRET = b"tpusync-development-secret"  # for one trusted deployment only; see KVStoreConfig


@dataclass(frozen=True)
class Namespace:
    """What makes KV blocks interchangeable: blocks are shared only within one namespace.

    Args:
      model_id: the model (architecture and tokenizer).
      layout_fingerprint: the KV block format (:attr:`tpusync.tiers.PoolLayout.fingerprint`).
      weight_version: changes whenever the weights do (e.g. after an RL step).
      shard_rank, shard_count: this process's tensor-parallel shard; each shard stores its own
        part of every block.
      salt: tenant or LoRA adapter; blocks of different salts never mix.
    """

    model_id: str
    layout_fingerprint: bytes
    weight_version: str = "0"
    shard_rank: int = 0
    shard_count: int = 1
    salt: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidArgumentError(
                f"model_id: expected a non-empty string, got {self.model_id!r}"
            )
        if not isinstance(self.weight_version, str):
            raise InvalidArgumentError(
                f"weight_version: expected a string, got {type(self.weight_version).__name__}"
            )
        if not isinstance(self.layout_fingerprint, bytes) or not self.layout_fingerprint:
            raise InvalidArgumentError(
                "layout_fingerprint: expected the layout's fingerprint bytes "
                "(PoolLayout.fingerprint)"
            )
        if not isinstance(self.salt, bytes):
            raise InvalidArgumentError(f"salt: expected bytes, got {type(self.salt).__name__}")
        for name in ("shard_rank", "shard_count"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{name}: expected an int >= 0, got {value!r}")
        if not 0 <= self.shard_rank < max(self.shard_count, 1) or self.shard_count < 1:
            raise InvalidArgumentError(
                f"shard_rank: {self.shard_rank} is not a rank of shard_count={self.shard_count}"
            )

    def encode(self) -> bytes:
        """The canonical bytes the namespace digest covers."""
        fields = [
            self.model_id.encode(),
            self.weight_version.encode(),
            self.layout_fingerprint,
            struct.pack("<I", self.shard_rank),
            struct.pack("<I", self.shard_count),
            self.salt,
        ]
        return b"".join(struct.pack("<I", len(f)) + f for f in fields)


@runtime_checkable
class KeyScheme(Protocol):
    """How token blocks become keys. Keys are at most 32 bytes and start with
    :meth:`namespace_tag`, so a namespace can be purged from every tier. An engine connector may
    supply its own scheme. A scheme that also has ``engine_keys(namespace, block_hashes)``
    (as :class:`Blake2bChainKeys` does) serves the store's ``*_engine_blocks`` calls, which
    adopt an engine's own block hashes."""

    name: str

    def namespace_tag(self, namespace: Namespace) -> bytes: ...

    def block_keys(
        self, namespace: Namespace, tokens: np.ndarray, block_size: int
    ) -> list[bytes]: ...

    def tail_key(
        self, namespace: Namespace, parent: bytes | None, session_id: str, tail: np.ndarray
    ) -> bytes: ...


class Blake2bChainKeys:
    """The default scheme, ``blake2b-chain-v1`` (see the module docstring).

    Args:
      secret: the deployment secret keying every hash (1 to 64 bytes).
    """

    name = "blake2b-chain-v1"

    def __init__(self, secret: bytes = DEFAULT_SECRET) -> None:
        if not isinstance(secret, bytes) or not 1 <= len(secret) <= MAX_SECRET_BYTES:
            raise InvalidArgumentError(
                "secret: expected 1 to 64 bytes (BLAKE2b's key limit), got "
                + (f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__)
            )
        self._secret = secret
        self._digests: dict[Namespace, bytes] = {}

    def namespace_digest(self, namespace: Namespace) -> bytes:
        digest = self._digests.get(namespace)
        if digest is None:
            digest = hashlib.blake2b(
                namespace.encode(),
                digest_size=_DIGEST_BYTES,
                key=self._secret,
                person=b"tpusync-ns-v1",
            ).digest()
            self._digests[namespace] = digest
        return digest

    def namespace_tag(self, namespace: Namespace) -> bytes:
        return self.namespace_digest(namespace)[:TAG_BYTES]

    def block_keys(self, namespace: Namespace, tokens: np.ndarray, block_size: int) -> list[bytes]:
        digest = self.namespace_digest(namespace)
        tag = digest[:TAG_BYTES]
        n_full = len(tokens) // block_size
        data = np.ascontiguousarray(tokens[: n_full * block_size], dtype="<u4")
        # the chain in C (hashlib's per-call cost dominates a block; 0004); tests pin it to
        # hashlib's answer and to the golden vectors
        return _core.blake2b_chain(
            digest, data.view(np.uint8), block_size * 4, self._secret, _KV_PERSON, tag
        )

    def tail_key(
        self, namespace: Namespace, parent: bytes | None, session_id: str, tail: np.ndarray
    ) -> bytes:
        digest = self.namespace_digest(namespace)
        chain = digest if parent is None else parent[TAG_BYTES:]
        sid = session_id.encode()
        value = hashlib.blake2b(
            chain + struct.pack("<I", len(sid)) + sid + np.asarray(tail, "<u4").tobytes(),
            digest_size=_DIGEST_BYTES,
            key=self._secret,
            person=b"tpusync-tail-v1",
        ).digest()
        return digest[:TAG_BYTES] + value

    def engine_keys(self, namespace: Namespace, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Keys for blocks an engine has already hashed (vLLM's ``Request.block_hashes``,
        which chain the prefix, the tokens and any extra keys such as multimodal inputs): each
        is BLAKE2b-128, keyed by the secret, with personalisation ``tpusync-eng-v1``, over the
        namespace digest and the engine's hash (a little-endian uint32 length, then its bytes),
        behind the namespace tag. The engine's chaining names the prefix; the keyed hash puts
        it in this deployment's namespace, so nobody without the secret can forge a key."""
        digest = self.namespace_digest(namespace)
        tag = digest[:TAG_BYTES]
        secret = self._secret
        return [
            tag
            + hashlib.blake2b(
                digest + struct.pack("<I", len(h)) + h,
                digest_size=_DIGEST_BYTES,
                key=secret,
                person=_ENGINE_PERSON,
            ).digest()
            for h in block_hashes
        ]

    def __repr__(self) -> str:
        return f"Blake2bChainKeys({self.name})"  # never the secret


MAX_ENGINE_HASH_BYTES = 64


def check_engine_hashes(block_hashes: Any, argument: str = "block_hashes") -> list[bytes]:
    """An engine's block hashes as a list of bytes (1 to 64 bytes each); raises
    InvalidArgumentError naming ``argument``."""
    if isinstance(block_hashes, str | bytes) or not isinstance(block_hashes, Sequence):
        raise InvalidArgumentError(
            f"{argument}: expected a list of the engine's block hashes (bytes), got "
            f"{type(block_hashes).__name__}"
        )
    out = []
    for i, h in enumerate(block_hashes):
        if not isinstance(h, bytes) or not 1 <= len(h) <= MAX_ENGINE_HASH_BYTES:
            raise InvalidArgumentError(
                f"{argument}[{i}]: expected 1 to {MAX_ENGINE_HASH_BYTES} bytes, got "
                + (f"{len(h)} bytes" if isinstance(h, bytes) else type(h).__name__)
            )
        out.append(bytes(h))  # a bytes subclass (vLLM's BlockHash) hashes as its bytes
    return out


def check_tokens(tokens: Any, argument: str = "tokens") -> np.ndarray:
    """Token ids as a 1-D uint32 array; raises InvalidArgumentError naming ``argument``."""
    if isinstance(tokens, str | bytes):
        raise InvalidArgumentError(
            f"{argument}: expected a sequence of integer token ids, got {type(tokens).__name__}"
        )
    if isinstance(tokens, np.ndarray):
        array = tokens
    else:
        if not isinstance(tokens, Sequence) and not hasattr(tokens, "__array__"):
            raise InvalidArgumentError(
                f"{argument}: expected a sequence of integer token ids, got {type(tokens).__name__}"
            )
        if isinstance(tokens, Sequence) and any(
            isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in tokens
        ):
            bad = next(
                t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral)
            )
            raise InvalidArgumentError(
                f"{argument}: token ids must be integers, found {bad!r} ({type(bad).__name__})"
            )
        array = np.asarray(tokens)
        if array.size == 0:
            array = array.astype(np.int64)
    if array.ndim != 1:
        raise InvalidArgumentError(
            f"{argument}: expected a 1-D list of token ids, got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{argument}: token ids must be integers, got dtype {array.dtype}"
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) > 0xFFFFFFFF):
        raise InvalidArgumentError(
            f"{argument}: token ids must be in 0..2**32-1, got {int(array.min())}..."
            f"{int(array.max())}"
        )
    return array.astype(np.uint32, copy=False)
