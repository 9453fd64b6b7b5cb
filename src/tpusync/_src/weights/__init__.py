"""RL weight sync: a trainer publishes each version of its (sharded) weights once
(:class:`Publisher`); samplers pull it resharded into their own layouts, verified, and switch to
it atomically (:class:`Subscriber`). A version is an ``int`` that rises (the training step).

Their options, grouped: :class:`WeightsPoolOptions` (the publisher's pool: versions kept, size,
chunk size, directory), :class:`WeightsServerOptions` (where the publisher serves, its leases),
:class:`WeightsClientOptions` (a subscriber's connections, timeouts and deadline) and
:class:`TlsOptions` (either side's TLS).

:mod:`tpusync._src.weights.plan` is the reshard plan (which bytes of which source shard each target
shard needs); :mod:`tpusync._src.weights.manifest` the version's manifest (its commit record)."""
