"""tpusync's implementation. Private: import the public modules instead (see :mod:`tpusync`);
nothing here is kept stable. The layers, bottom to top: ``memory``, ``engines``, ``transfer``,
``tiers``, ``kv``, ``cluster``, then ``weights`` and ``connectors``, then the commands."""
