"""GB/s of tpusync's block data plane against the TCP limit and jax.experimental.transfer;
striping over two rate-limited paths; registry lookups per second.

A thin script: the benchmark lives in the package (:mod:`tpusync._src.bench.network`, with
``network_procs`` and ``network_peers``; also run by ``tpusync bench network``); the command
line is the same.

    python benchmarks/network.py [--total-mib 1024] [--block-kib 2048] [--repeats 5]
        [--connections 1,2,4] [--netns-mib 256] [--rate-mbit 1000] [--skip-netns]
        [--lookup-s 0.5] [--json FILE]
"""

import sys

from tpusync._src.bench.network import main
from tpusync._src.bench.network_procs import Puller, start_child

__all__ = ["Puller", "main", "start_child"]  # network_tuning.py uses the first two

if __name__ == "__main__":
    sys.exit(main())
