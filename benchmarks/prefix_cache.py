"""Time to first token cold vs warm with tpusync's KV cache store, and the load GB/s vs its limit.

A thin script: the benchmark lives in the package (:mod:`tpusync._src.bench.prefix`, also run by
``tpusync bench prefix``); the command line is the same.

    python benchmarks/prefix_cache.py [--tokens 1024,4096,8192] [--repeats 9] [--json FILE]
        [--shm-dir /dev/shm]
"""

import sys

from tpusync._src.bench.prefix import main

if __name__ == "__main__":
    sys.exit(main())
