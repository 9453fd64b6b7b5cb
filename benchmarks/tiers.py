"""GB/s of the DRAM, disk and shared-FS tiers against their limits (memory copy, fio).

A thin script: the benchmark lives in the package (:mod:`tpusync._src.bench.tiers`, also run by
``tpusync bench tiers``); the command line is the same.

    python benchmarks/tiers.py [--total-mib 1024] [--repeats 9] [--json tiers.json]
        [--disk-dir DIR] [--shared-dir DIR] [--shm-dir /dev/shm]
"""

import sys

from tpusync._src.bench.tiers import main

if __name__ == "__main__":
    sys.exit(main())
