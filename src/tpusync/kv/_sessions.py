"""Offloaded agent sessions: which blocks hold a paused session's KV, kept across restarts.

A session's manifest (its id, tokens and block keys, and the model id and KV layout it belongs
to) is a small JSON file in the sessions
directory beside the tier that survives a restart (the named /dev/shm pool, else the disk tier),
written to a temporary name and renamed, with a BLAKE2b digest of its content; a manifest that
fails to parse or to match its digest is ignored and removed (its blocks are then ordinary cache
blocks). Without such a tier the manifests live in memory only.
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

log = logging.getLogger("tpusync.kv")

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    tokens: np.ndarray  # uint32
    keys: tuple[bytes, ...]  # full blocks, then the tail block if any


class SessionManifests:
    """Session records in memory, mirrored to ``directory`` when given."""

    def __init__(self, directory: Path | None, owner: tuple[str, str]) -> None:
        self.directory = directory
        self.owner = owner  # (model id, layout fingerprint hex): whose sessions these are
        self._records: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for path in sorted(directory.glob("*.json")):
                record = _read(path, owner)
                if record is None:
                    # damaged, or left by another model or KV layout (whose tier was recreated
                    # cold): its KV is gone, so the session is too
                    log.warning(
                        "tpusync kv: dropping session manifest %s (damaged or of "
                        "another model or layout)",
                        path,
                    )
                    path.unlink(missing_ok=True)
                else:
                    self._records[record.session_id] = record
            for stale in directory.glob("*.tmp*"):
                stale.unlink(missing_ok=True)

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            return self._records.get(session_id)

    def all(self) -> list[SessionRecord]:
        with self._lock:
            return list(self._records.values())

    def put(self, record: SessionRecord) -> SessionRecord | None:
        """Stores a record; returns the one it replaced."""
        with self._lock:
            old = self._records.get(record.session_id)
            self._records[record.session_id] = record
            if self.directory is not None:
                _write(self._path(record.session_id), record, self.owner)
            return old

    def pop(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            record = self._records.pop(session_id, None)
            if record is not None and self.directory is not None:
                self._path(session_id).unlink(missing_ok=True)
            return record

    def _path(self, session_id: str) -> Path:
        assert self.directory is not None
        name = hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()
        return self.directory / f"{name}.json"


def _body(record: SessionRecord, owner: tuple[str, str]) -> dict[str, object]:
    return {
        "version": MANIFEST_VERSION,
        "model_id": owner[0],
        "layout": owner[1],
        "session_id": record.session_id,
        "tokens": record.tokens.astype(int).tolist(),
        "keys": [k.hex() for k in record.keys],
    }


def _digest(body: dict[str, object]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _write(path: Path, record: SessionRecord, owner: tuple[str, str]) -> None:
    body = _body(record, owner)
    text = json.dumps({"body": body, "digest": _digest(body)})
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _read(path: Path, owner: tuple[str, str]) -> SessionRecord | None:
    try:
        data = json.loads(path.read_text())
        body = data["body"]
        if data["digest"] != _digest(body) or body["version"] != MANIFEST_VERSION:
            return None
        if (body["model_id"], body["layout"]) != owner:
            return None
        tokens = np.asarray(body["tokens"], dtype=np.int64)
        if tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF)):
            return None
        keys = tuple(bytes.fromhex(k) for k in body["keys"])
        return SessionRecord(str(body["session_id"]), tokens.astype(np.uint32), keys)
    except (OSError, ValueError, KeyError, TypeError):
        return None
