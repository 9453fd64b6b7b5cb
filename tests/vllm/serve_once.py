"""Serves one prompt with vLLM's default multi-process engine (an engine-core process and a
worker process beside this one) and the connector, then prints its greedy tokens, cached token
count and ``kv_transfer_params`` as JSON. Run by tests/vllm/test_connector.py and
test_disaggregation.py (as a producer) as a child process, started early: it imports vLLM,
prints ``ready``, then reads its request (one JSON line) from stdin."""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

# the imports this process spends most of its time in, done before the request comes
from engines import engine, generate_with, transfer_config
from vllm import LLM  # noqa: F401
from vllm.v1.engine.core_client import EngineCoreClient  # noqa: F401


def main() -> None:
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # the test ended without a request
    request = json.loads(line)
    kv = transfer_config(request["kv"], role=request.get("role", "kv_both"))
    with engine(request["model"], kv, distributed_executor_backend=request.get("executor")) as llm:
        ((tokens, cached, params),) = generate_with(
            llm, [request["prompt"]], request.get("max_tokens", 8)
        )
        # answered before the engine shuts down: a consumer may ask for the blocks while the
        # saves are still being written back
        print(json.dumps({"tokens": tokens, "cached": cached, "params": params}), flush=True)
        if request.get("hold"):  # serving its DRAM to a consumer: until told it is done
            sys.stdin.readline()


if __name__ == "__main__":
    main()
