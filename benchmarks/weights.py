"""RL weight sync: a trainer publishes ~1.4 GiB of bf16 (mesh 8x1); samplers in other processes
pull each version into mesh 2x4 from /dev/shm and over the data plane, beside the memory limit,
a plain BlockClient pull and an in-process jax.device_put reshard.

A thin script: the benchmark lives in the package (:mod:`tpusync._src.bench.weights`, also run by
``tpusync bench all``); the command line is the same.

    python benchmarks/weights.py [--scale 1100] [--repeats 5] [--json PATH]
"""

import sys

from tpusync._src.bench.weights import main

if __name__ == "__main__":
    sys.exit(main())
