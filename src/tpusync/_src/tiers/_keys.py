"""Checking block keys once for every tier: bytes, 1 to ``MAX_KEY_BYTES`` long."""

from __future__ import annotations

from collections.abc import Sequence

from tpusync._src.tiers.blocks import MAX_KEY_BYTES
from tpusync.errors import InvalidArgumentError

__all__ = ["check_keys"]


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    if isinstance(keys, list | tuple) and (
        not keys
        or (
            set(map(type, keys)) == {bytes}
            and min(map(len, keys)) > 0
            and max(map(len, keys)) <= MAX_KEY_BYTES
        )
    ):
        return list(keys)  # the common case, checked at C speed
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray | memoryview):
            raise InvalidArgumentError(f"keys[{i}]: expected bytes, got {type(key).__name__}")
        key = bytes(key)
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgumentError(
                f"keys[{i}]: {len(key)} bytes; keys are 1 to {MAX_KEY_BYTES} bytes"
            )
        out.append(key)
    return out
