"""TTFT of a real vLLM engine with tpusync's connector, beside vLLM's prefix cache and
ExampleConnector. A thin script over :mod:`tpusync._src.bench.vllm_ttft` (``tpusync bench
vllm_ttft`` in the vLLM environment); the command line is the same.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--tokens 1024,4096,8192] [--repeats 11]
"""

import importlib.util
import sys

if __name__ == "__main__":
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        sys.exit(
            "vllm_ttft: needs vLLM; run it in the vLLM environment (scripts/test.sh makes "
            ".venv-vllm): .venv-vllm/bin/python benchmarks/vllm_ttft.py"
        )
    from tpusync._src.bench.vllm_ttft import main

    sys.exit(main())
