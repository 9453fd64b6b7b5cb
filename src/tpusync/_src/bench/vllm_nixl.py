"""vLLM's own disaggregation connector, ``NixlConnector``, as the peer of the disaggregation
benchmark (:mod:`tpusync._src.bench.vllm_disagg`): a producer engine and a consumer engine, each in
a process of its own and both alive while the consumer pulls, with NIXL's UCX backend on this
machine's CPU KV (``kv_buffer_device="cpu"``).

Per prompt, as a proxy does: the producer computes one token with
``{"do_remote_decode": True}``; its output's ``kv_transfer_params`` go to the consumer, which
pulls the KV and computes its first token. The consumer's TTFT is the wall time of that
generate; its transfer time and bytes are NIXL's own (vLLM's
``NixlKVConnectorStats.record_transfer``, from post to completion, observed in the consumer):
the wire time only, where tpusync's figure (``LoadResult.seconds``) also holds the lookup, the
verification and the copy into the tensors.

Two transports, the same connector:

* ``"cma"`` (``UCX_TLS=cma,tcp,self``, what UCX picks by itself on one host): the consumer
  reads the producer's memory directly (``process_vm_readv``; control over loopback TCP).
  Same host and same user only.
* ``"tcp"``: ``UCX_TLS=tcp,self``, what NIXL uses between hosts without RDMA.

The peer gets its best setup here, none of which vLLM exposes as a setting (each set in the
child before its engine starts):

* NIXL's progress thread polls without pause (its wrapper sets ``pthrDelay`` 0), taking one
  of the cores; 100 us between polls takes almost none;
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

from tpusync._src.bench.common import listen_port
from tpusync._src.bench.vllm_ttft import engine, first_token

__all__ = ["TRANSPORTS", "measure_nixl", "nixl_missing"]

TRANSPORTS = ("cma", "tcp")
_POLL_DELAY_US = 100
_START_TIMEOUT_S = 600.0  # an engine's start, model load included
_ANSWER_TIMEOUT_S = 120.0  # one prompt


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


def _observe_transfers(into: list[tuple[float, int]]) -> None:
    """Collects NIXL's own figures of each transfer the consumer makes, (seconds from post to
    completion, bytes), then calls vLLM's method."""
    # imports nixl itself: only in the engines' processes
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # optional heavy dependency
        stats as nixl_stats,
    )

    record = nixl_stats.NixlKVConnectorStats.record_transfer

    def recording(self: Any, result: Any) -> Any:
        if result is not None:
            into.append((result.xferDuration / 1e6, int(result.totalBytes)))
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
        # cma: direct reads of the producer's memory, control messages over TCP
        os.environ["UCX_TLS"] = "tcp,self" if transport == "tcp" else "cma,tcp,self"
        _tune_nixl()
        transfers: list[tuple[float, int]] = []
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
            name=f"tpusync-bench-nixl-{role}", daemon=True,
        )  # fmt: skip
        self.process.start()
        theirs.close()
        try:
            self._answer(_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout_s: float) -> tuple[Any, ...]:
        try:
            if not self.conn.poll(timeout_s):
                raise TimeoutError(f"the NIXL {self.role} engine did not answer in {timeout_s:g} s")
            answer = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the NIXL {self.role} engine ended (exit code {self.process.exitcode})"
            ) from None
        if answer[0] == "error":
            raise RuntimeError(f"the NIXL {self.role} engine failed: {answer[1]}")
        return answer

    def first_token(
        self, prompt: list[int], params: dict[str, Any]
    ) -> tuple[float, int, Any, list[tuple[float, int]]]:
        self.conn.send((prompt, params))
        _, seconds, token, answer, transfers = self._answer(_ANSWER_TIMEOUT_S)
        return seconds, token, answer, transfers

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            if self.process.is_alive():
                self.conn.send(None)
                if self.conn.poll(60):
                    self.conn.recv()
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
    """The consumer's TTFT and NIXL's transfer seconds and bytes for each prompt (after one
    warm-up prompt, which also makes the first connection), whether every first token is
    ``expected``, and whether every prompt's KV was seen moving."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: one of {TRANSPORTS}, got {transport!r}")
    producer = consumer = None
    try:
        producer = _Engine(model, max_len, "kv_producer", listen_port(), transport)
        consumer = _Engine(model, max_len, "kv_consumer", listen_port(), transport)
        ttfts, seconds_runs, bytes_runs = [], [], []
        equal = moved_all = True
        for i, prompt in enumerate([warm_up, *prompts]):
            params = producer.first_token(prompt, {"do_remote_decode": True})[2]
            seconds, token, _, moved = consumer.first_token(prompt, params)
            if i:  # the warm-up is not counted
                ttfts.append(seconds)
                seconds_runs.append(sum(s for s, _ in moved) if moved else float("nan"))
                bytes_runs.append(sum(n for _, n in moved))
                equal &= token == expected[i - 1]
                moved_all &= bool(moved)
        return {
            "ttft_s_runs": ttfts,
            "load_s_runs": seconds_runs,
            "load_bytes_runs": bytes_runs,
            "outputs_equal": equal,
            "transfers_seen": moved_all,
        }
    finally:
        for child in (consumer, producer):
            if child is not None:
                child.close()
