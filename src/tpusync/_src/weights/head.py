"""A publisher's head: the versions it keeps, newest last, each with its structure's digest
(:func:`~tpusync._src.weights.manifest.structure_digest`), so that a subscriber finds the
newest version and tells a changed tree without being told, and without reading a manifest.

The head is a few hundred bytes of JSON answered by the publisher's block server
(:class:`WeightsServer`, the ``head`` request beside the data plane's own), not a pool block:
asking it costs one small round trip, where a block would move a whole chunk, so a subscriber
may ask it every few tens of milliseconds while it waits for a newer version. It is read
after the handshake (the deployment secret), and bounded and checked when parsed
(:func:`head_of`): it comes from a peer.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpusync._src.cluster.dataplane import BlockClient, BlockServer, Served
from tpusync._src.cluster.dataplane.client import call
from tpusync._src.weights.manifest import check_version
from tpusync.errors import InvalidArgumentError, WeightSyncError

__all__ = ["Head", "WeightsServer", "head_of", "read_head", "read_manifest"]

MAX_LISTED = 1024  # versions a head lists (the newest ones when more are kept)
MANIFEST_ANSWER_BYTES = 8 << 20  # longer manifests are read as pool blocks (a frame's bound)
_DIGEST = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Head:
    """The versions a publisher keeps, oldest first, each ``(version, structure digest)``."""

    versions: tuple[tuple[int, str], ...] = ()

    @property
    def latest(self) -> int | None:
        return self.versions[-1][0] if self.versions else None

    def digest_of(self, version: int) -> str | None:
        return dict(self.versions).get(version)

    def to_json(self) -> dict[str, Any]:
        return {"versions": [[v, d] for v, d in self.versions[-MAX_LISTED:]]}


def head_of(answer: Any, source: str) -> Head:
    """The head in a peer's ``answer``, checked; WeightSyncError naming ``source`` if it is
    malformed."""
    try:
        listed = answer.get("versions") if isinstance(answer, dict) else None
        if not isinstance(listed, list) or len(listed) > MAX_LISTED:
            raise ValueError(f"versions: expected a list of at most {MAX_LISTED}")
        versions = []
        for item in listed:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError("a version entry is not [version, digest]")
            version = check_version(item[0])
            if not isinstance(item[1], str) or not _DIGEST.fullmatch(item[1]):
                raise ValueError(f"version {version}: a malformed structure digest")
            if versions and version <= versions[-1][0]:
                raise ValueError("versions do not rise")
            versions.append((version, item[1]))
    except (ValueError, InvalidArgumentError) as error:
        raise WeightSyncError(f"a malformed head from {source}: {error}") from None
    return Head(tuple(versions))


def read_head(client: BlockClient) -> Head:
    """The head of the publisher ``client`` is connected to."""
    return head_of(call(client, "head", {}), client.label)


def read_manifest(client: BlockClient, version: int) -> bytes | None:
    """The manifest of ``version`` as its publisher wrote it (length field first), answered
    whole: a pool block would move a whole chunk for a few kilobytes. None when the publisher
    has it only as pool blocks (too long for one answer)."""
    answer = call(client, "manifest", {"version": version})
    text = answer.get("manifest") if isinstance(answer, dict) else None
    if text is None:
        return None
    try:
        if not isinstance(text, str) or len(text) > 2 * MANIFEST_ANSWER_BYTES:
            raise ValueError("too long, or not text")
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error) as error:
        raise WeightSyncError(f"a malformed manifest from {client.label}: {error}") from None


class WeightsServer(BlockServer):
    """A publisher's block server: its pool's chunks, its :attr:`head` (replaced whole by the
    publisher at each change; read by the connection threads as it stands) and the manifests
    of the versions it keeps or a subscriber still holds (:attr:`manifests`)."""

    _thread_name = "tpusync-weights-server"
    head: Head = Head()

    def __init__(self, *args: Any, **keywords: Any) -> None:
        self.manifests: dict[int, bytes] = {}  # set and dropped by the publisher
        super().__init__(*args, **keywords)

    def _handlers(self, served: Served) -> dict[str, Callable[[dict[str, Any]], Any]]:
        handlers = super()._handlers(served)
        handlers["head"] = lambda p: self.head.to_json()
        handlers["manifest"] = self._manifest
        return handlers

    def _manifest(self, params: dict[str, Any]) -> dict[str, Any]:
        data = self.manifests.get(check_version(params.get("version")))
        if data is None or len(data) > MANIFEST_ANSWER_BYTES:
            return {"manifest": None}
        return {"manifest": base64.b64encode(data).decode()}
