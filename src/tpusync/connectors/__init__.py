"""Serving-engine connectors: tpusync as the KV store of an engine (vLLM today).

Each engine's connector is a subpackage that imports its engine; importing this package
imports none of them."""
