"""The KV cache store: prefix caching of paged KV blocks across memory tiers.

``KVCacheStore`` keys each full block of tokens by a hash chained over the prefix under a keyed
namespace digest (``Namespace``, ``Blake2bChainKeys``), keeps blocks in DRAM (anonymous or
/dev/shm), local disk and a shared filesystem with LRU demotion and promotion, and loads a
cached prefix straight into the engine's ``DevicePool``.
"""
