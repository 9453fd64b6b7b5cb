"""The SGLang HiCache storage backend's implementation: the public name is in
:mod:`tpusync.connectors.sglang`."""
