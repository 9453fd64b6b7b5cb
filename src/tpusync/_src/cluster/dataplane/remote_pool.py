"""The remote tier: :class:`RemotePool`, the read side of the
:class:`~tpusync.tiers.LowerTier` interface over a :class:`~tpusync.cluster.BlockClient`."""

from __future__ import annotations

from collections.abc import Sequence

from tpusync._src.cluster.dataplane.client import BlockClient
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import BlocksMissingError, InvalidArgumentError, RemoteOperationUnsupportedError

__all__ = ["RemotePool"]


class RemotePool:
    """The read side of the :class:`~tpusync.tiers.LowerTier` interface over a
    :class:`BlockClient`: ``get`` pulls blocks into a HostPool; ``contains``, ``capacity`` and
    ``used`` ask the server.

    The tier is read-only for now: ``put``, ``delete`` and ``keys`` raise
    :class:`RemoteOperationUnsupportedError` (blocks reach a peer by its own saves; the
    registry says who holds what). ``close`` closes the client only when ``owns_client``.
    """

    read_only = True  # a store reads through it and never writes, demotes to or evicts from it

    def __init__(self, client: BlockClient, layout: PoolLayout, *, owns_client: bool = True):
        if not isinstance(client, BlockClient):
            raise InvalidArgumentError(
                f"client: expected a BlockClient, got {type(client).__name__}"
            )
        if not isinstance(layout, PoolLayout) or layout.fingerprint != client.fingerprint:
            raise InvalidArgumentError(
                f"layout: the server at {client.label} serves another block layout than this one"
            )
        self.client = client
        self.layout = layout
        self.stats = TierStats(f"remote:{client.label}")
        self._owns = owns_client

    @property
    def capacity(self) -> int:
        return self.client.stat()["capacity"]

    @property
    def used(self) -> int:
        return self.client.stat()["used"]

    def get(self, keys: Sequence[bytes], target: HostPool) -> None:
        """Loads the blocks under ``keys`` into ``target`` (see :meth:`BlockClient.pull`);
        raises BlocksMissingError with a ``loaded`` mask when any was not loaded."""
        result = self.client.pull_result(keys, target)
        hits = sum(result.loaded)
        self.stats.add(
            hits=hits,
            misses=len(result.loaded) - hits,
            bytes_out=hits * self.layout.payload_bytes,  # received, or read from the file
            checksum_failures=result.corrupt,
        )
        if hits < len(result.loaded):
            error = BlocksMissingError(
                f"keys: {len(result.loaded) - hits} of {len(result.loaded)} blocks not served by "
                f"{self.client.label} ({result.corrupt} failed verification"
                + ("" if result.released else ", the lease lapsed")
                + ")",
                loaded=result.loaded,
                corrupt=result.corrupt,
            )
            if result.error is not None:
                raise error from result.error
            raise error

    def get_scattered(self, keys: Sequence[bytes], scatter: Scatter) -> list[bool]:
        """Receives the blocks under ``keys`` (distinct) straight into the places ``scatter``
        gives them (see :meth:`BlockClient.pull_scattered`); returns which arrived verified."""
        return self.get_scattered_counted(keys, scatter)[0]

    def get_scattered_counted(
        self, keys: Sequence[bytes], scatter: Scatter
    ) -> tuple[list[bool], int]:
        """:meth:`get_scattered`, and how many blocks failed verification."""
        loaded, corrupt = self.client.pull_scattered_counted(keys, self.layout, scatter)
        hits = sum(loaded)
        self.stats.add(
            hits=hits,
            misses=len(loaded) - hits,
            bytes_out=hits * self.layout.payload_bytes,
            checksum_failures=corrupt,
        )
        return loaded, corrupt

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.client.contains(keys)

    def put(self, keys: Sequence[bytes], source: HostPool) -> int:
        raise RemoteOperationUnsupportedError(
            "put: a RemotePool is read-only; the peer stores blocks from its own saves"
        )

    def delete(self, keys: Sequence[bytes]) -> int:
        raise RemoteOperationUnsupportedError("delete: a RemotePool is read-only")

    def keys(self) -> list[bytes]:
        raise RemoteOperationUnsupportedError(
            "keys: a RemotePool does not list its peer's keys; ask the registry"
        )

    def close(self) -> None:
        if self._owns:
            self.client.close()

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
