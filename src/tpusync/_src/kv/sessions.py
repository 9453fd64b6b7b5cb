"""Offloaded agent sessions: which blocks hold a paused session's KV, kept across restarts.

A session's manifest (its id, tokens and block keys, and the model id and KV layout it belongs
to) is a small JSON file in the sessions directory beside the tier that survives a restart (the
named /dev/shm pool, else the disk tier), with a BLAKE2b digest of its content. It is written
whole or not at all (a temporary name, then a rename; the file 0600, the directory 0700); a
failed write raises :class:`~tpusync.errors.TierFullError` (no room) or
:class:`~tpusync.errors.TierIOError`, naming the file, and changes nothing. Without such a tier
the manifests live in memory only.

On open, a manifest that is not a whole, valid one of this model and layout — unparsable, a
digest mismatch, a field of the wrong type or range, keys that do not fit its tokens, a name
that is not its session's, or no regular file of this uid at all (a FIFO, a symlink, a
directory) — is a :class:`ManifestError` (:func:`decode_manifest`): it is ignored and removed,
and its blocks are then ordinary cache blocks. The directory itself must be this uid's and not
writable by others (:class:`~tpusync.errors.UnsafeFileError` otherwise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpusync._src.tiers.blocks import MAX_KEY_BYTES
from tpusync._src.tiers.files import (
    TEMP_MARK,
    file_error,
    make_directory,
    open_file,
    write_file_atomically,
)
from tpusync.errors import UnsafeFileError

log = logging.getLogger("tpusync.kv")

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 28  # far above any real session (a few bytes a token), never a hog
_MAX_TOKEN = 0xFFFFFFFF
_SUFFIX = ".json"


class ManifestError(ValueError):
    """A session manifest that is not a whole, valid one of this store (the reason is the
    message): ignored and removed on open, never loaded."""


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    tokens: np.ndarray  # uint32
    keys: tuple[bytes, ...]  # full blocks, then the tail block if any


class SessionManifests:
    """Session records in memory, mirrored to ``directory`` when given.

    ``owner`` is (model id, layout fingerprint hex): whose sessions these are; with
    ``block_size``, a manifest's key count must fit its tokens (one key per started block).
    """

    def __init__(
        self, directory: Path | None, owner: tuple[str, str], block_size: int | None = None
    ) -> None:
        self.directory = directory
        self.owner = owner
        self.block_size = block_size
        self._records: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()
        if directory is not None:
            try:
                make_directory(directory)
            except UnsafeFileError:
                raise
            except OSError as exc:
                raise file_error(exc, directory, "creating the sessions directory") from exc
            self._load(directory)

    def _load(self, directory: Path) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            path = Path(entry.path)
            if TEMP_MARK in entry.name or ".tmp" in entry.name:  # a writer that died
                _remove(path)
            elif entry.name.endswith(_SUFFIX):
                try:
                    record = read_manifest(path, self.owner, self.block_size)
                    if path.name != self.path_of(record.session_id).name:
                        raise ManifestError(f"holds session {record.session_id!r}, not its own")
                except ManifestError as exc:
                    # damaged, or left by another model or KV layout (whose tier was recreated
                    # cold): its KV is gone, so the session is too
                    log.warning("tpusync kv: dropping session manifest %s: %s", path, exc)
                    _remove(path)
                else:
                    self._records[record.session_id] = record

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            return self._records.get(session_id)

    def all(self) -> list[SessionRecord]:
        with self._lock:
            return list(self._records.values())

    def put(self, record: SessionRecord) -> SessionRecord | None:
        """Stores a record (its manifest first); returns the one it replaced. A failed write
        raises TierFullError or TierIOError naming the manifest and changes nothing."""
        with self._lock:
            if self.directory is not None:
                text = encode_manifest(record, self.owner)
                path = self.path_of(record.session_id)
                write_file_atomically(path, text, what="writing the session manifest")
            old = self._records.get(record.session_id)
            self._records[record.session_id] = record
            return old

    def pop(self, session_id: str) -> SessionRecord | None:
        """Forgets a record (its manifest first); returns it, or None if there was none. A
        manifest that cannot be removed raises TierIOError naming it and changes nothing."""
        with self._lock:
            record = self._records.get(session_id)
            if record is None:
                return None
            if self.directory is not None:
                path = self.path_of(session_id)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise file_error(exc, path, "removing the session manifest") from exc
            del self._records[session_id]
            return record

    def path_of(self, session_id: str) -> Path:
        assert self.directory is not None
        name = hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()
        return self.directory / f"{name}{_SUFFIX}"


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # e.g. a directory: it is never read, so it only costs this line
        log.warning("tpusync kv: cannot remove %s: %s", path, exc.strerror or exc)


# --- the manifest format -----------------------------------------------------------------------


def _body(record: SessionRecord, owner: tuple[str, str]) -> dict[str, object]:
    return {
        "version": MANIFEST_VERSION,
        "model_id": owner[0],
        "layout": owner[1],
        "session_id": record.session_id,
        "tokens": record.tokens.astype(int).tolist(),
        "keys": [k.hex() for k in record.keys],
    }


def manifest_digest(body: object) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def encode_manifest(record: SessionRecord, owner: tuple[str, str]) -> bytes:
    """A manifest file's bytes."""
    body = _body(record, owner)
    return json.dumps({"body": body, "digest": manifest_digest(body)}).encode()


def read_manifest(path: Path, owner: tuple[str, str], block_size: int | None) -> SessionRecord:
    """Reads and decodes the manifest at ``path`` (opened safely: no link followed, no FIFO
    opened, this uid's regular file only). Raises :class:`ManifestError` saying what is wrong."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except UnsafeFileError as exc:
        raise ManifestError(str(exc)) from None
    except OSError as exc:
        raise ManifestError(f"cannot open: {exc.strerror or exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{size} bytes, more than a manifest ({MAX_MANIFEST_BYTES})")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size -= len(chunk)
            if size < 0:
                raise ManifestError("grew while it was read")
    except OSError as exc:
        raise ManifestError(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return decode_manifest(b"".join(chunks), owner, block_size)


def decode_manifest(data: bytes, owner: tuple[str, str], block_size: int | None) -> SessionRecord:
    """Parses and checks a manifest of ``owner``'s sessions; raises :class:`ManifestError`
    saying what is wrong (and nothing else, whatever ``data`` holds)."""
    try:
        document = json.loads(data.decode("utf-8"))
        if not isinstance(document, dict) or set(document) != {"body", "digest"}:
            raise ManifestError("not a session manifest (fields)")
        body, digest = document["body"], document["digest"]
        if (
            not isinstance(body, dict)
            or not isinstance(digest, str)
            or digest != manifest_digest(body)
        ):
            raise ManifestError("damaged (digest mismatch)")
    except RecursionError:
        raise ManifestError("not a session manifest (nested too deeply)") from None
    except (ValueError, TypeError) as exc:  # ManifestError is a ValueError too
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"not JSON ({exc})") from None
    version = body.get("version")
    if type(version) is not int or version != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {version!r}; this build reads {MANIFEST_VERSION}")
    if (body.get("model_id"), body.get("layout")) != owner:
        raise ManifestError("belongs to another model or KV layout")
    session_id, tokens, keys = body.get("session_id"), body.get("tokens"), body.get("keys")
    if not isinstance(session_id, str) or not session_id:
        raise ManifestError("bad session_id")
    if not isinstance(tokens, list) or not all(
        type(t) is int and 0 <= t <= _MAX_TOKEN for t in tokens
    ):
        raise ManifestError("bad tokens (expected a list of 32-bit token ids)")
    if not isinstance(keys, list) or not all(_is_key_hex(k) for k in keys):
        raise ManifestError(f"bad keys (expected a list of 1 to {MAX_KEY_BYTES}-byte hex keys)")
    if block_size is not None and len(keys) != -(-len(tokens) // block_size):
        raise ManifestError(f"{len(keys)} keys for {len(tokens)} tokens in blocks of {block_size}")
    try:
        session_id.encode()
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: not a real id
        raise ManifestError("bad session_id (not encodable)") from None
    return SessionRecord(
        session_id,
        np.array(tokens, dtype=np.uint32),
        tuple(bytes.fromhex(k) for k in keys),
    )


def _is_key_hex(value: object) -> bool:
    if not isinstance(value, str) or not 2 <= len(value) <= 2 * MAX_KEY_BYTES:
        return False
    try:
        return bytes.fromhex(value).hex() == value  # lowercase, no spaces: as written
    except ValueError:
        return False
