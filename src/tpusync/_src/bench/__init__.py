"""Benchmarks against physical limits: the limits every published figure is divided by
(:mod:`tpusync._src.bench.limits`), the benchmarks (transfer, tiers, prefix, network, mac_cost),
their results scheme and RESULTS.md (:mod:`tpusync._src.bench.results`), and ``tpusync bench``
(:mod:`tpusync._src.bench.command`)."""
