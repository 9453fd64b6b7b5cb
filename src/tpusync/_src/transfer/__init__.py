"""transfer() and transfer_batch(): validate everything, plan the blocks, choose one engine, run it.

The layer's steps, one module each: :mod:`~tpusync._src.transfer.endpoints` (classify and check
each side), :mod:`~tpusync._src.transfer.plan` (block lists into Moves),
:mod:`~tpusync._src.transfer.select` (the engine), :mod:`~tpusync._src.transfer.api` (the calls and
their futures). The engines themselves live in :mod:`tpusync._src.engines`.
"""

from __future__ import annotations

from tpusync._src.transfer.api import TransferFuture, transfer, transfer_batch
from tpusync._src.transfer.plan import Transfer

__all__ = ["Transfer", "TransferFuture", "transfer", "transfer_batch"]
