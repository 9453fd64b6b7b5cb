"""vLLM's plugin hook for tpusync (entry point group ``vllm.general_plugins``): registers the
connector name ``TpuSyncConnector`` so that a ``kv_transfer_config`` needs no module path.

A top-level module, apart from the ``tpusync`` package, because vLLM loads general plugins in
every engine process at start: registering imports neither tpusync (nor jax) nor the
connector; vLLM imports the connector only when an engine asks for it."""

from __future__ import annotations

import logging

NAME = "TpuSyncConnector"
MODULE = "tpusync.connectors.vllm"


def register() -> None:
    """Registers ``TpuSyncConnector`` with vLLM's connector factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:  # registered already: by an earlier call in this process, or by vLLM
        logging.getLogger("tpusync.connectors.vllm").debug("%s was registered already", NAME)
