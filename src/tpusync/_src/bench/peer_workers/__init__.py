"""Programs that time a peer (Google TPU Sync, Mooncake) in the peer's own environment.

Each file here runs as a script under the peer's interpreter (``benchmarks/peers/setup.sh``
makes those environments), imports nothing of tpusync but :mod:`.protocol`, and answers the
benchmark over its stdin and stdout (:func:`tpusync._src.bench.external.start_peer` starts one)."""
