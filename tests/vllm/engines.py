"""Real vLLM engines on this machine's CPU for the connector tests: a tiny random-weight Llama
built at test time (no hub), engines in this process (``uni`` executor, no engine-core
process), their greedy outputs, and the connector's worker side of a live engine."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fronts import mapped_shm_files

from tpusync._src.tiers.dram.pool_file import COMMITTED, RECORD_DTYPE, decode_header

# before vLLM is imported or an engine made: engines in this process, a 1 GiB KV space
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK = 32
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 128, 4, 2, 1024


def build_model(path: Path, seed: int) -> Path:
    """A 2-layer Llama (head_dim 32) with random weights, scaled up so that greedy decoding
    has few near-ties (a test's reference prompt has none: :func:`reference_tokens`)."""
    from tpusync._src.testing.hf_llama import build_random_llama

    return build_random_llama(
        path, layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=256,
        vocab=VOCAB, max_len=4096, seed=seed, scale=8.0,
    )  # fmt: skip


def transfer_config(
    extra: dict[str, Any] | None, policy: str = "fail", role: str = "kv_both", **kw: Any
) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="TpuSyncConnector",
        kv_connector_module_path="tpusync.connectors.vllm",
        kv_role=role,
        kv_connector_extra_config=extra or {},
        kv_load_failure_policy=policy,
        **kw,
    )


@contextlib.contextmanager
def engine(model: Path, kv: Any = None, **options: Any) -> Iterator[Any]:
    """An ``LLM`` in this process, shut down (its connector's store closed) on exit."""
    from vllm import LLM

    settings: dict[str, Any] = dict(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=2048,
        distributed_executor_backend="uni",
        enable_prefix_caching=True,
        num_gpu_blocks_override=256,
    )
    settings.update(options)
    shm = Path("/dev/shm")
    before = set(shm.glob("vllm_dist_*"))
    llm = LLM(kv_transfer_config=kv, **settings)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()  # in process: the connector's store closes
        del llm
        gc.collect()
        # vLLM 0.32's CPU communicator (tensor parallelism) leaves its /dev/shm files behind;
        # one another live process maps is another engine's (a test session beside this one)
        others = mapped_shm_files(other_than=os.getpid())
        for leftover in set(shm.glob("vllm_dist_*")) - before:
            if str(leftover) not in others:
                leftover.unlink(missing_ok=True)


def generate(
    llm: Any, prompts: list[list[int]], max_tokens: int = 8
) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and ``num_cached_tokens`` (vLLM's and the connector's)."""
    return [(tokens, cached) for tokens, cached, _ in generate_with(llm, prompts, max_tokens)]


def _greedy(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    logprobs: int | None = None,
) -> list[Any]:
    """vLLM's outputs of greedy requests for ``prompts``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args=extra,
        logprobs=logprobs,
    )
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def generate_with(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int = 8,
    kv_transfer_params: dict[str, Any] | None = None,
) -> list[tuple[list[int], int, dict[str, Any] | None]]:
    """:func:`generate` with ``kv_transfer_params`` given to each request (as a proxy in front
    of disaggregated engines passes them), and each output's own."""
    return [
        (list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), o.kv_transfer_params)
        for o in _greedy(llm, prompts, max_tokens, kv_transfer_params)
    ]


# The tests' model has bf16 logits 0.25 apart at their size: engines whose reductions run in
# another order can differ by an ulp or two, which flips a greedy step whose top two are closer.
MIN_MARGIN = 1.0


def _near_tie(output: Any) -> str | None:
    """The first greedy step of ``output`` whose top two tokens are within
    :data:`MIN_MARGIN` (logprob), described, or None."""
    for step, candidates in enumerate(output.outputs[0].logprobs):
        first, second = sorted((c.logprob for c in candidates.values()), reverse=True)[:2]
        if first - second < MIN_MARGIN:
            return f"greedy step {step} is a near-tie ({first:.3f} vs {second:.3f})"
    return None


def reference_tokens(llm: Any, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """The greedy tokens of ``prompt``, for other engines' outputs to equal. Fails, naming
    the step, where the top two tokens of a step are within :data:`MIN_MARGIN` (logprob):
    a near-tie that numerics alone can flip, so the prompt is a bad reference."""
    (output,) = _greedy(llm, [prompt], max_tokens, logprobs=2)
    tie = _near_tie(output)
    assert tie is None, f"the reference prompt's {tie}: choose another prompt seed"
    return list(output.outputs[0].token_ids)


def choose_prompt(
    llm: Any, length: int, seed: int, max_tokens: int = 8, tries: int = 20
) -> tuple[list[int], list[int]]:
    """A prompt of ``length`` random tokens (drawn from ``seed``) none of whose greedy steps
    is a near-tie on this machine, and its greedy tokens: chosen here, at run time, because
    which prompts tie depends on the CPU's arithmetic (a seed fixed on one machine may tie on
    another)."""
    rng = np.random.default_rng(seed)
    ties = []
    for _ in range(tries):
        prompt = rng.integers(1, VOCAB - 24, length).tolist()
        (output,) = _greedy(llm, [prompt], max_tokens, logprobs=2)
        tie = _near_tie(output)
        if tie is None:
            return prompt, list(output.outputs[0].token_ids)
        ties.append(tie)
    raise AssertionError(f"no prompt of {tries} without a near-tie: {ties}")


def first_logprobs(llm: Any, prompt: list[int], top: int = 5) -> tuple[list[int], int, dict]:
    """``prompt``'s greedy tokens, ``num_cached_tokens`` and the first step's ``top``
    logprobs ({token: logprob}): what the engine computed from the prompt's KV."""
    (output,) = _greedy(llm, [prompt], 8, logprobs=top)
    steps = output.outputs[0].logprobs or [{}]  # none: the request failed
    first = {token: c.logprob for token, c in steps[0].items()}
    return list(output.outputs[0].token_ids), int(output.num_cached_tokens or 0), first


@contextlib.contextmanager
def small_worker(socket_dir: Path, engine_id: str) -> Iterator[Any]:
    """A connector worker side on its own (no engine): a 16-block DRAM tier and two layers of
    vLLM-shaped CPU KV (8 blocks of BLOCK tokens, 2 KV heads of 64, random bf16) registered
    as one buffer, closed on exit."""
    import torch

    from tpusync._src.connectors.vllm.settings import read_settings
    from tpusync._src.connectors.vllm.worker import WorkerSide

    settings = read_settings(
        {"dram": {"capacity_blocks": 16}, "socket_dir": str(socket_dir)},
        model="m", block_size=BLOCK, tp_rank=0, tp_size=1, num_blocks=8, engine_id=engine_id,
    )  # fmt: skip
    buffer = torch.randn(2, 8, 2, BLOCK, 64).to(torch.bfloat16)
    side = WorkerSide(settings, num_blocks=8)
    try:
        side.register({f"layer{i}": buffer[i] for i in range(2)})
        yield side
    finally:
        side.close()


def vllm_request(tokens: list[int], req_id: str = "req-1") -> Any:
    """A real vLLM request with vLLM's own block hashes (sha256, as the engine computes them)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        req_id, tokens, SamplingParams(max_tokens=1), None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )  # fmt: skip


def matched_when_answered(scheduler: Any, request: Any, timeout_s: float = 10.0) -> int:
    """The scheduler side's count of ``request``'s stored tokens, asked again until its lookup
    answers, as vLLM asks at each step (never a load below DRAM here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        tokens, is_async = scheduler.matched_tokens(request, 0)
        if tokens is not None:
            assert not is_async
            return tokens
        if time.monotonic() >= deadline:
            raise AssertionError(f"the scheduler got no answer in {timeout_s:g} s")
        time.sleep(0.01)  # a scheduling step's pace


def worker_of(llm: Any) -> Any:
    """The connector's worker side of a live in-process engine."""
    from tpusync._src.connectors.vllm.worker import local_worker

    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    worker = local_worker(engine_id)
    assert worker is not None, "no worker side registered for this engine"
    return worker


def settle(worker: Any) -> dict[str, Any]:
    """The store's stats once its saves are durable; asserts nothing is pinned or held."""
    store = worker.store
    assert store.flush(timeout=30)
    stats = store.stats()
    assert stats["store"]["open_handles"] == 0, stats["store"]
    assert not worker._pins, worker._pins
    for pool in store.pools:
        assert pool.held_blocks() == [], pool
    return stats


def tier_asked(
    store: Any, methods: tuple[str, ...] = ("get", "get_scattered"), then: Any = None
) -> threading.Event:
    """An event set when ``store`` (a KVCacheStore) first calls one of ``methods`` of one of
    its lower tiers, just before the call goes on (after ``then()``, when given: e.g. stopping
    the peer the call is about to ask)."""
    asked = threading.Event()
    for tier in store._stack.tiers[1:]:
        for name in methods:
            method = getattr(tier, name, None)
            if method is not None:

                def asking(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                    if not asked.is_set() and then is not None:
                        then()
                    asked.set()
                    return _method(*args, **kwargs)

                setattr(tier, name, asking)
    return asked


def connected_to(ports: set[int], timeout_s: float) -> bool:
    """Whether an established IPv4 TCP connection to one of ``ports`` (on this network
    namespace, read from /proc/net/tcp) shows up within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) in ports:
                return True
        time.sleep(0.002)
    return False


def damage_one_block(path: Path) -> None:
    """Overwrites the payload of one committed block of the DRAM pool file at ``path`` (a named
    pool in /dev/shm) with random bytes, its checksum record left as it was: every layer's KV of
    that block wrong, so a forward that used it would give other tokens. The pool's owner may
    have it mapped (MAP_SHARED): it sees the damage at once."""
    data = path.read_bytes()
    header = decode_header(data, len(data))
    records = np.frombuffer(data, RECORD_DTYPE, count=header.n_slots, offset=header.records_offset)
    slots = np.flatnonzero(records["state"] == COMMITTED)
    assert len(slots) >= 4, slots
    with open(path, "r+b") as f:
        f.seek(header.data_offset + int(slots[len(slots) // 2]) * header.slot_bytes)
        f.write(os.urandom(header.layout.payload_bytes))
