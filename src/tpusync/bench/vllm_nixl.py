"""vLLM's own disaggregation connector, ``NixlConnector``, as the peer of the disaggregation
benchmark (:mod:`tpusync.bench.vllm_disagg`): a producer engine and a consumer engine, each in
a process of its own and both alive while the consumer pulls, with NIXL's UCX backend on this
machine's CPU KV (``kv_buffer_device="cpu"``).

Per prompt, as a proxy does: the producer computes one token with
``{"do_remote_decode": True}``; its output's ``kv_transfer_params`` go to the consumer, which
pulls the KV and computes its first token. The consumer's TTFT is the wall time of that
generate; its transfer time is NIXL's own (vLLM's ``NixlKVConnectorStats.record_transfer``,
post to completion, observed in the consumer).

Two transports, the same connector:

* ``"cma"``: UCX's choice on one host, the consumer reading the producer's memory directly
  (``process_vm_readv``; control over loopback TCP). Same host and same user only.
* ``"tcp"``: ``UCX_TLS=tcp,self``, what NIXL uses between hosts without RDMA.

The peer gets its best setup here, none of which vLLM exposes as a setting (each set in the
child before its engine starts):

* NIXL's progress thread polls without pause (its wrapper sets ``pthrDelay`` 0), taking one
  of this machine's two cores; 100 us between polls takes almost none;
* on CPU the connector pins the engine to the last core; every thread gets both back;
* ``UCX_MODULES=^ib``: the InfiniBand module bundled in the wheel crashes at exit.

NIXL moves the blocks as they are: no checksum, nothing verified; tpusync's data plane
authenticates the peer and checks every block.

Needs ``nixl`` (and ``nixl-cu12``, which runs without CUDA) in the vLLM environment
(``scripts/_vllm_venv.sh`` installs them); :func:`nixl_missing` says when it is not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats as nixl_stats

from tpusync.bench.common import free_port
from tpusync.bench.vllm_ttft import engine, first_token

__all__ = ["TRANSPORTS", "measure_nixl", "nixl_missing"]

TRANSPORTS = ("cma", "tcp")
_POLL_DELAY_US = 100
_ANSWER_S = 900.0


def nixl_missing() -> str | None:
    """Why vLLM's NixlConnector cannot run here (None: it can). Nothing is imported: NIXL is
    loaded only in the engines' processes."""
    absent = [name for name in ("nixl", "nixl_cu12") if importlib.util.find_spec(name) is None]
    if absent:
        return f"{' and '.join(absent)} not installed here (scripts/_vllm_venv.sh installs them)"
    return None


def _tune_nixl() -> None:
    """The peer's best setup (see the module docstring): a progress thread that pauses."""
    import nixl._api as api  # optional heavy dependency

    make_agent = api.nixlBind.nixlAgent

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = _POLL_DELAY_US
        return make_agent(name, config)

    api.nixlBind.nixlAgent = agent


def _observe_transfers(into: list[float]) -> None:
    """Collects NIXL's duration of each transfer the consumer makes (then vLLM's own method)."""
    record = nixl_stats.NixlKVConnectorStats.record_transfer

    def recording(self: Any, result: Any) -> Any:
        if result is not None:
            into.append(result.xferDuration / 1e6)
        return record(self, result)

    nixl_stats.NixlKVConnectorStats.record_transfer = recording


def _every_core_back() -> None:
    cores = set(range(os.cpu_count() or 1))
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


def _serve(conn: Any, model: str, max_len: int, role: str, port: int, transport: str) -> None:
    """A child process with one engine: answers ``(prompt, params)`` with (seconds, first
    token, kv_transfer_params, NIXL transfer seconds) until it gets None."""
    try:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        os.environ["UCX_MODULES"] = "^ib"
        if transport == "tcp":
            os.environ["UCX_TLS"] = "tcp,self"
        _tune_nixl()
        transfers: list[float] = []
        _observe_transfers(transfers)
        options = {"kv_buffer_device": "cpu", "engine_id": f"nixl-{role}-{port}"}
        with engine(Path(model), max_len, "NixlConnector", {}, role, **options) as llm:
            _every_core_back()
            conn.send(("ready",))
            while (request := conn.recv()) is not None:
                prompt, params = request
                transfers.clear()
                seconds, token, answer = first_token(llm, prompt, params)
                conn.send(("ok", seconds, token, answer, list(transfers)))
        conn.send(("stopped",))
    except BaseException as error:  # the parent reports it
        conn.send(("error", f"{error!r}\n{traceback.format_exc()}"))


class _Engine:
    """An engine in a child process (spawned: no state of the benchmark's process)."""

    def __init__(self, model: Path, max_len: int, role: str, port: int, transport: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.role = role
        self.process = context.Process(
            target=_serve, args=(theirs, str(model), max_len, role, port, transport),
            name=f"tpusync-bench-nixl-{role}",
        )  # fmt: skip
        self.process.start()
        theirs.close()
        self._answer()

    def _answer(self) -> tuple[Any, ...]:
        if not self.conn.poll(_ANSWER_S):
            raise TimeoutError(f"the NIXL {self.role} engine did not answer in {_ANSWER_S:g} s")
        answer = self.conn.recv()
        if answer[0] == "error":
            raise RuntimeError(f"the NIXL {self.role} engine failed: {answer[1]}")
        return answer

    def first_token(
        self, prompt: list[int], params: dict[str, Any]
    ) -> tuple[float, int, Any, list[float]]:
        self.conn.send((prompt, params))
        _, seconds, token, answer, transfers = self._answer()
        return seconds, token, answer, transfers

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.conn.send(None)
                self.conn.poll(60) and self.conn.recv()
        except (OSError, EOFError):
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.conn.close()


def measure_nixl(
    model: Path,
    max_len: int,
    prompts: list[list[int]],
    expected: list[int],
    warm_up: list[int],
    transport: str,
) -> dict[str, Any]:
    """The consumer's TTFT and NIXL transfer seconds for each prompt (after one warm-up prompt,
    which also makes the first connection), and whether every first token is ``expected``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: one of {TRANSPORTS}, got {transport!r}")
    producer = consumer = None
    try:
        producer = _Engine(model, max_len, "kv_producer", free_port(), transport)
        consumer = _Engine(model, max_len, "kv_consumer", free_port(), transport)
        ttfts, transfers, equal = [], [], True
        for i, prompt in enumerate([warm_up, *prompts]):
            params = producer.first_token(prompt, {"do_remote_decode": True})[2]
            seconds, token, _, moved = consumer.first_token(prompt, params)
            if i:  # the warm-up is not counted
                ttfts.append(seconds)
                transfers.append(sum(moved) if moved else float("nan"))
                equal &= bool(moved) and token == expected[i - 1]
        return {"ttft_s_runs": ttfts, "load_s_runs": transfers, "outputs_equal": equal}
    finally:
        for child in (consumer, producer):
            if child is not None:
                child.close()
