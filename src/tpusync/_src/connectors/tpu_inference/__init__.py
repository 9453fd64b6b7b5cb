"""The tpu-inference connector's implementation: the public names are in
:mod:`tpusync.connectors.tpu_inference`."""
