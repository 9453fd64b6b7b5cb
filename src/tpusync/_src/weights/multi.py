"""Trainers and samplers that span processes (multi-controller JAX, ``jax.distributed``):
every trainer process publishes the shards it holds and the first commits the version; every
sampler process pulls its own shards and the sampler's processes commit a version all or none.

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

A sampler whose target spans processes pulls each version in every process (a collective,
like a step) into that process's own devices; at the end of its pull each process shares
whether its part landed verified (:class:`SamplerGroup`), and the first to see every part,
or a failed one, or the deadline pass, records the decision once: every process then has
the version to commit, or none has.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import jax
from jax._src import distributed  # the coordination service's client: no public name yet

from tpusync.errors import WeightSyncError

__all__ = ["Controller", "SamplerGroup", "box_owners", "controller", "instance_number"]

_INSTANCES: dict[tuple[str, str], int] = {}


def instance_number(kind: str, name: str) -> int:
    """How many ``kind`` objects (publishers, samplers) of ``name`` this process made before
    this one: each process of a job makes them in the same order, so the number names one of
    them across the job (and its coordination keys apart from an earlier one's)."""
    _INSTANCES[kind, name] = _INSTANCES.get((kind, name), 0) + 1
    return _INSTANCES[kind, name]


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

    def counted(self, key: str) -> int:
        """Adds one to the counter at ``key``; its new value."""
        return int(self._client.key_value_increment(key, 1))

    def shared_under(self, directory: str) -> dict[str, Any]:
        """Every value shared under ``directory`` (none when it cannot be read now), by key."""
        try:
            pairs = self._client.key_value_dir_get(directory)
        except Exception:  # the service unreachable for a moment: asked again by the caller
            return {}
        found = {}
        for key, text in pairs:
            with contextlib.suppress(ValueError):
                found[key] = json.loads(text)
        return found


class SamplerGroup:
    """The processes of one sampler whose target spans them: each pull's outcome agreed."""

    _POLL_S = (0.002, 0.05)  # the first and the longest pause between looks at the parts

    def __init__(self, ctl: Controller, name: str) -> None:
        self._ctl = ctl
        self._prefix = f"tpusync/weights-sampler/{name}/{instance_number('sampler', name)}"
        self._pulls = 0  # pulls are collective: the same count in every process
        self._asks = 0

    def agree(self, version: int, failure: str | None, timeout_s: float) -> None:
        """Shares this process's outcome of pulling ``version`` (``failure``: what went wrong,
        None: its part landed verified) and returns once every process's part landed;
        WeightSyncError when one did not (failed, another version, not within ``timeout_s``),
        in every process alike."""
        ctl, pull = self._ctl, self._pulls
        self._pulls += 1
        directory = f"{self._prefix}/pull/{pull}"
        ctl.share(f"{directory}/part/{ctl.index}", {"version": version, "failure": failure})
        decision = None
        if failure is not None:
            decision = self._decide(directory, f"process {ctl.index}: {failure}")
        deadline = time.monotonic() + timeout_s
        pause = self._POLL_S[0]
        while decision is None:
            shared = ctl.shared_under(directory + "/")
            decision = shared.get(f"{directory}/decision")
            if decision is not None:
                break
            parts = {p: shared.get(f"{directory}/part/{p}") for p in range(ctl.count)}
            for p, part in parts.items():
                if isinstance(part, dict) and part.get("failure") is not None:
                    decision = self._decide(directory, f"process {p}: {part['failure']}")
                    break
                if isinstance(part, dict) and part.get("version") != version:
                    decision = self._decide(
                        directory, f"process {p} pulled version {part.get('version')}, "
                        f"process {ctl.index} version {version}"
                    )  # fmt: skip
                    break
            else:
                missing = [p for p, part in parts.items() if part is None]
                if not missing:
                    decision = self._decide(directory, None)
                elif time.monotonic() >= deadline:
                    decision = self._decide(
                        directory, f"process {missing[0]}'s part did not land within "
                        f"{timeout_s:g} s (it stopped, or is slower)"
                    )  # fmt: skip
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, self._POLL_S[1])
        if ctl.counted(f"{directory}/read") == ctl.count:  # the last to read the decision
            for p in range(ctl.count):
                ctl.forget(f"{directory}/part/{p}")
            ctl.forget(f"{directory}/decision")
            ctl.forget(f"{directory}/read")
        if not decision.get("committed"):
            raise WeightSyncError(
                f"version {version}: not every process of this sampler has it "
                f"({decision.get('why')}); none of them commits it"
            )

    def _decide(self, directory: str, why: str | None) -> dict[str, Any]:
        """The decision of a pull: committed when ``why`` (what failed) is None; the first
        process to record one decides for all."""
        return self._ctl.claim(f"{directory}/decision", {"committed": why is None, "why": why})

    def newest(self, find: Any, timeout_s: float) -> Any:
        """What ``find()`` returns in process 0 (within ``timeout_s``), in every process (its
        WeightSyncError too, naming it)."""
        ctl, ask = self._ctl, self._asks
        self._asks += 1
        key = f"{self._prefix}/ask/{ask}"
        if ctl.index == 0:
            try:
                value = find()
            except BaseException as error:  # the others stop waiting for it at once
                ctl.share(key, {"error": f"{type(error).__name__}: {error}"})
                raise
            ctl.share(key, {"value": value})
            return value
        answer = ctl.wait(key, timeout_s, "process 0's answer")
        if ctl.counted(f"{key}/read") == ctl.count - 1:  # the last to read it
            ctl.forget(key)
            ctl.forget(f"{key}/read")
        if "error" in answer:
            raise WeightSyncError(f"process 0: {answer['error']}")
        return answer.get("value")


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
