#!/usr/bin/env python
"""Fuzzes the on-disk formats of the disk tier (index and slab files), the shared-filesystem tier
(block files) and session manifests with mutations of real files (tpusync._src.testing.file_fuzz).

Usage: python scripts/fuzz_files.py [--seconds S (per format, default 60)] [--seed N]
                                    [--directory DIR (default: a fresh temporary directory)]

Each iteration restores a real tier's pristine files, damages them (bit flips, truncations,
extensions, random bytes, fields rewritten with their checksums fixed, huge numbers, records
copied or swapped, JSON edits with the digest recomputed), then opens and reads them. Anything
but the format's documented error, or a stored key served with bytes other than its own, is a
failure: the script prints it (with the mutation, iteration and seed that replay it) and exits
1. At the end it prints, per format, how often each outcome happened.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

from tpusync._src.testing import file_fuzz

FORMATS = {
    "disk": file_fuzz.fuzz_disk_pool,
    "shared_fs": file_fuzz.fuzz_shared_fs,
    "manifests": file_fuzz.fuzz_manifests,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per format")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--directory", type=Path, default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # every damaged file is logged: expected, and many
    seed = random.randrange(1 << 32) if args.seed is None else args.seed
    print(f"fuzz_files: seed {seed}, {args.seconds:g} s per format")
    with tempfile.TemporaryDirectory(dir=args.directory) as scratch:
        for name, fuzz in FORMATS.items():
            work = Path(scratch) / name
            work.mkdir(mode=0o700)
            start = time.monotonic()
            try:
                counts = fuzz(work, seconds=args.seconds, seed=seed)
            except file_fuzz.FuzzFailure as failure:
                print(f"{name}: FAILED: {failure}")
                return 1
            total = sum(counts.values())
            summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(f"{name}: {total} outcomes in {time.monotonic() - start:.1f} s: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
