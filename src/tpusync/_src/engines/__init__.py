"""The transfer engines: one :class:`~tpusync._src.engines.base.Engine` interface, one module each.

:mod:`~tpusync._src.engines.native` (raw memory on the CPU backend; through
:mod:`~tpusync._src.engines.pjrt` on plugin backends), :mod:`~tpusync._src.engines.pure_jax` (runs
everywhere; the reference the native engine must equal). :mod:`~tpusync._src.engines.devices`
says which engine each device can get and why. Engines import memory and the native core,
never the transfer layer that chooses among them.
"""

from __future__ import annotations

from tpusync._src.engines.base import Engine

__all__ = ["Engine"]
