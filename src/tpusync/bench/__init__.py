"""Benchmarks against physical limits: the limits every published figure is divided by
(:mod:`tpusync.bench.limits`), the benchmarks (transfer, tiers, prefix, network, mac_cost),
their results scheme and RESULTS.md (:mod:`tpusync.bench.results`), and ``tpusync bench``
(:mod:`tpusync.bench.command`)."""
