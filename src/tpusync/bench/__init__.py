"""Benchmark support: the physical limits every published figure is divided by
(:mod:`tpusync.bench.limits`)."""
