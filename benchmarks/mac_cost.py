"""What a keyed MAC of every block costs: Poly1305 tags beside DRAM put/get and the shared-FS
tier with ``mac_key`` on and off, against the memory limit.

A thin script: the benchmark lives in the package (:mod:`tpusync._src.bench.mac_cost`, also run by
``tpusync bench all``); the command line is the same.

    python benchmarks/mac_cost.py [--total-mib 512] [--repeats 7] [--json PATH]
"""

import sys

from tpusync._src.bench.mac_cost import main

if __name__ == "__main__":
    sys.exit(main())
