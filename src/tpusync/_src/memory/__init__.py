"""What tpusync owns in memory: device pools it may write (``device_pool``, ``torch_tensors``),
host buffers (``host_buffer``), huge pages, fork guards.

The lowest Python layer above the native core: it imports nothing of the engines, the transfer
API or the tiers. This package imports none of its modules: ``import tpusync`` imports the fork
guard, which must not import JAX.
"""
