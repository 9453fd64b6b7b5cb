"""Serving-engine connectors: tpusync as the KV store of an engine.

:mod:`tpusync.connectors.vllm` (vLLM's KV connector), :mod:`tpusync.connectors.sglang` (SGLang's
HiCache storage) and :mod:`tpusync.connectors.tpu_inference` (vLLM on TPU). Each imports its
engine; importing this package imports none of them."""
