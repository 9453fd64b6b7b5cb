"""The registry server's wire codecs: keys as hex (or packed), lookup answers in the compact
form (see :mod:`tpusync._src.cluster.registry.server`)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

from tpusync._src.cluster.registry.base import MAX_KEY_BYTES, Holder, check_keys
from tpusync.errors import InvalidArgumentError, RegistryUnavailableError


def _keys_from_hex(value: Any) -> list[bytes]:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"keys: expected a list of hex strings, got {value!r:.200}")
    try:
        return check_keys([bytes.fromhex(item) for item in value])
    except (TypeError, ValueError):
        pass  # find which one, below
    out = []
    for i, item in enumerate(value):
        try:
            out.append(bytes.fromhex(item))
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"keys[{i}]: expected a hex string, got {item!r:.100}"
            ) from None
    return check_keys(out)


def _holders_to_wire(found: Sequence[Sequence[Holder]]) -> dict[str, Any]:
    """A lookup's answer in the compact wire form (see the module's docstring)."""
    table: list[list[str]] = []
    holder_at: dict[int, int] = {}  # id(holder) -> its index (the holders outlive this call)
    rows: list[list[int]] = []
    row_at: dict[tuple[int, ...], int] = {}  # the ids of a row's holders -> its index
    runs: list[list[int]] = []
    last: Any = None
    for held in found:
        if runs and (held is last or (len(held) == 1 and len(last) == 1 and held[0] is last[0])):
            runs[-1][1] += 1  # the same holders as the key before (the common case)
            continue
        last = held
        ids = tuple(map(id, held))
        r = row_at.get(ids)
        if r is None:
            row = []
            for h in held:
                i = holder_at.get(id(h))
                if i is None:
                    i = holder_at[id(h)] = len(table)
                    table.append([h.node_id, h.tier])
                row.append(i)
            r = row_at[ids] = len(rows)
            rows.append(row)
        if runs and runs[-1][0] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return {"holders": table, "rows": rows, "runs": runs}


def _holders_from_wire(result: Any, method: str) -> list[list[Holder]]:
    """The compact wire form (or the plain one: a list per key of [node, tier]) as holder
    lists, each sorted by node id."""
    try:
        if isinstance(result, list):  # the plain form
            out = [
                sorted((Holder(str(n), str(t)) for n, t in held), key=_holder_node)
                for held in result
            ]
        else:
            table = [Holder(str(n), str(t)) for n, t in result["holders"]]
            rows = [sorted((table[i] for i in row), key=_holder_node) for row in result["rows"]]
            out = []
            for r, count in result["runs"]:  # a list of its own per key, copied at C speed
                out.extend(map(list.copy, itertools.repeat(rows[r], count)))
    except (TypeError, ValueError, KeyError, IndexError):
        raise RegistryUnavailableError(f"malformed {method} answer: {result!r:.200}") from None
    return out


def _holder_node(holder: Holder) -> str:
    return holder.node_id


def _keys_to_wire(keys: list[bytes]) -> Any:
    """Keys as the ``prefix`` method takes them: packed where they are all of a size."""
    sizes = set(map(len, keys))
    if len(sizes) == 1:
        return {"hex": b"".join(keys).hex(), "size": sizes.pop()}
    return [k.hex() for k in keys]


def _keys_from_wire(value: Any) -> list[bytes]:
    """The keys of a ``prefix`` request: a list of hex strings, or packed (one size)."""
    if not isinstance(value, dict):
        return _keys_from_hex(value)
    packed, size = value.get("hex"), value.get("size")
    if set(value) != {"hex", "size"} or not isinstance(packed, str) or type(size) is not int:
        raise InvalidArgumentError(f"keys: expected {{hex, size}}, got {value!r:.200}")
    if not 1 <= size <= MAX_KEY_BYTES:
        raise InvalidArgumentError(f"keys.size: expected 1 to {MAX_KEY_BYTES}, got {size}")
    try:
        raw = bytes.fromhex(packed)
    except ValueError:
        raise InvalidArgumentError(f"keys.hex: not hex: {packed!r:.100}") from None
    if len(raw) % size:
        raise InvalidArgumentError(f"keys.hex: {len(raw)} bytes, not a multiple of {size}")
    return list(struct.unpack(f"{size}s" * (len(raw) // size), raw))  # C speed: no slicing loop
