"""Test and demo helpers. Not part of the store: nothing in :mod:`tpusync` imports this package.

:mod:`tpusync.testing.model` is a small decoder-only transformer in pure JAX with a paged KV cache,
used to prove that KV blocks saved and loaded by the store give exactly the same results.
:mod:`tpusync.testing.conformance` is the suite a tier or registry backend author runs against
their own implementation.
"""
