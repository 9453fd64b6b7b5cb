"""Test and demo helpers: :mod:`tpusync.testing.model`, a small decoder-only transformer in pure
JAX with a paged KV cache (a test and demo model, not a store); :mod:`tpusync.testing.engine`, a
minimal serving loop of it over a KV store; :mod:`tpusync.testing.conformance`, the suites a tier
or registry author runs against their own implementation. Nothing in tpusync imports them."""
