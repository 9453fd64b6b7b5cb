"""TTFT of a real vLLM engine with tpusync's connector, beside vLLM's prefix cache and
ExampleConnector. A thin script over :mod:`tpusync.bench.vllm_ttft` (``tpusync bench
vllm_ttft`` in the vLLM environment); the command line is the same.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--tokens 1024,4096,8192] [--repeats 5]
"""

import sys

from tpusync.bench.vllm_ttft import main

if __name__ == "__main__":
    sys.exit(main())
