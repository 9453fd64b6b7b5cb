"""A trainer that spans processes (multi-controller JAX, ``jax.distributed``): every process
publishes the shards it holds, and the first commits the version.

Each process runs a :class:`~tpusync.weights.Publisher` of the same name and calls ``publish``
with the same version (a collective, like a training step). A box (a distinct shard) is staged
by one process: the lowest-numbered one holding a replica of it (:func:`box_owners`), from its
own devices, without gathering; each process serves its part from its own pool. A process
shares what it staged (its address, its chunks' checksums, where each of its boxes starts)
through the JAX coordination service's key-value store; the first process waits for every
part, writes the version's manifest once, naming the process that holds each box, announces
it, and says so; the others wait for that. A process that dies mid-publish leaves nothing
visible: the first times out waiting for its part (``WeightsServerOptions.parts_timeout_s``),
and every process removes what it staged.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import jax
from jax._src import distributed  # the coordination service's client: no public name yet

from tpusync.errors import WeightSyncError

__all__ = ["Controller", "box_owners", "controller"]


@dataclass(frozen=True)
class Controller:
    """This process's place in a multi-controller job and its coordination service."""

    index: int
    count: int
    _client: Any

    def share(self, key: str, value: dict[str, Any]) -> None:
        self._client.key_value_set(key, json.dumps(value))

    def wait(self, key: str, timeout_s: float, what: str) -> dict[str, Any]:
        """The value shared under ``key``; WeightSyncError saying ``what`` at the timeout."""
        try:
            text = self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
        except Exception as error:  # the service's own error types are not public
            raise WeightSyncError(f"{what} did not come within {timeout_s:g} s ({error})") from None
        try:
            value = json.loads(text)
        except ValueError as error:
            raise WeightSyncError(f"{what}: a malformed value ({error})") from None
        if not isinstance(value, dict):
            raise WeightSyncError(f"{what}: a malformed value")
        return value

    def claim(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        """Sets ``key`` to ``value`` unless it is set: the value that holds, whoever set it
        first (the service refuses to overwrite a key)."""
        try:
            self._client.key_value_set(key, json.dumps(value))
            return value
        except Exception:  # set already: the first decision holds
            return self.wait(key, 10.0, f"the decision at {key}")

    def forget(self, key: str) -> None:
        with contextlib.suppress(Exception):  # a key already gone, or the service going away
            self._client.key_value_delete(key)


def controller() -> Controller | None:
    """This process's :class:`Controller` in a ``jax.distributed`` job of several processes;
    None in a job of one."""
    client = distributed.global_state.client  # the service jax.distributed.initialize started
    if client is None:  # checked first: jax.process_count() would start the backend
        return None
    if jax.process_count() == 1:
        return None
    return Controller(jax.process_index(), jax.process_count(), client)


def box_owners(sharding: Any, shape: tuple[int, ...], of_device: dict[Any, int]) -> list[int]:
    """Per box of ``sharding`` (numbered by ``of_device``), the lowest process index of the
    devices holding it: the process that stages it."""
    owners: dict[int, int] = {}
    for device in sharding.devices_indices_map(shape):
        box = of_device[device]
        owners[box] = min(owners.get(box, device.process_index), device.process_index)
    return [owners[b] for b in range(len(owners))]
