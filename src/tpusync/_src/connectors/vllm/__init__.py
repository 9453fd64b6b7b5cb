"""The vLLM connector's implementation: the public names are in :mod:`tpusync.connectors.vllm`
(which imports vLLM only on first use of the connector, so that ``lookup_service`` needs none)."""
