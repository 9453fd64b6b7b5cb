"""Serves one prompt with vLLM's default multi-process engine (an engine-core process and a
worker process beside this one) and the connector, then prints its greedy tokens and cached
token count as JSON. Run by tests/vllm/test_connector.py as a child process."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    request = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from engines import engine, generate, transfer_config

    kv = transfer_config(request["kv"])
    with engine(request["model"], kv, distributed_executor_backend=request.get("executor")) as llm:
        ((tokens, cached),) = generate(llm, [request["prompt"]])
    print(json.dumps({"tokens": tokens, "cached": cached}), flush=True)


if __name__ == "__main__":
    main()
