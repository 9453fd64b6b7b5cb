"""Device<->host GB/s of tpusync.transfer against the memory-copy limit and the pure-JAX path.

A thin script: the benchmark lives in the package (:mod:`tpusync._src.bench.transfer`, also run by
``tpusync bench transfer``); the command line is the same.

    python benchmarks/transfer.py [--total-mib 1024] [--repeats 5] [--block-kib 64 ...]
        [--json transfer.json]
"""

import sys

from tpusync._src.bench.transfer import main

if __name__ == "__main__":
    sys.exit(main())
