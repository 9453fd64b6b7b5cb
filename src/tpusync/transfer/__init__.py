"""transfer() and transfer_batch(): validate everything, plan the blocks, choose one engine, run it.

The layer's steps, one module each: :mod:`~tpusync.transfer.endpoints` (classify and check
each side), :mod:`~tpusync.transfer.plan` (block lists into Moves),
:mod:`~tpusync.transfer.select` (the engine), :mod:`~tpusync.transfer.api` (the calls and
their futures). The engines themselves live in :mod:`tpusync.engines`.
"""

from __future__ import annotations

from tpusync.transfer.api import TransferFuture, transfer, transfer_batch
from tpusync.transfer.plan import Transfer

__all__ = ["Transfer", "TransferFuture", "transfer", "transfer_batch"]
