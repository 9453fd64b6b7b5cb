"""Disaggregated prefill -> decode with real vLLM engines: a kv_producer and a kv_consumer
through a store node, beside a cold prefill, the data plane's own pull of the same bytes and
ExampleConnector. A thin script over :mod:`tpusync._src.bench.vllm_disagg` (``tpusync bench
vllm_disagg`` in the vLLM environment); the command line is the same.

    .venv-vllm/bin/python benchmarks/vllm_disagg.py [--tokens 1024,4096,8192] [--repeats 3]
        [--rounds 3]
"""

import importlib.util
import sys

if __name__ == "__main__":
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        sys.exit(
            "vllm_disagg: needs vLLM; run it in the vLLM environment (scripts/test.sh makes "
            ".venv-vllm): .venv-vllm/bin/python benchmarks/vllm_disagg.py"
        )
    from tpusync._src.bench.vllm_disagg import main

    sys.exit(main())
