"""A store node as a writable lower tier of a KV store: :class:`StoreNodePool`."""

from __future__ import annotations

import logging
import ssl
import sys
from collections.abc import Sequence

from tpusync._src.cluster.dataplane.client import BlockClient, call
from tpusync._src.cluster.dataplane.protocol import MAX_KEYS_PER_REQUEST
from tpusync._src.cluster.dataplane.remote_pool import RemotePool
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import BlocksMissingError, InvalidArgumentError

__all__ = ["StoreNodePool"]

log = logging.getLogger(__name__)


class StoreNodePool(RemotePool):
    """A store node as a writable lower tier of a KV store (see the module docstring).

    ``put`` pushes DRAM blocks to the node, ``get`` pulls them back (leased and verified like
    every pull), ``delete`` and ``keys`` act on the node's blocks of this layout. The node makes
    room itself (it evicts its least recently used blocks, whoever put them), so the store never
    evicts from it: :attr:`free` is unbounded.

    Args:
      address / addresses, connections, secret, timeout_s, tls, insecure, same_host: as for
        :class:`~tpusync.cluster.BlockClient`.
      layout: the store's block layout (its DRAM tier's).
    """

    read_only = False

    def __init__(
        self,
        address: str | None = None,
        *,
        layout: PoolLayout,
        secret: bytes,
        addresses: Sequence[str] | None = None,
        connections: int | None = None,
        timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
        same_host: bool = True,
    ) -> None:
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout, got {type(layout).__name__}"
            )
        client = BlockClient(
            address,
            addresses=addresses,
            connections=connections,
            secret=secret,
            timeout_s=timeout_s,
            tls=tls,
            insecure=insecure,
            layout=layout,
            same_host=same_host,
        )
        try:
            if not client.writable:
                raise InvalidArgumentError(
                    f"address: {client.label} is a block server, not a store node "
                    "(`tpusync serve`); use RemotePool to read from it"
                )
            super().__init__(client, layout)
        except BaseException:
            client.close()
            raise
        self.stats = TierStats(f"node:{client.label}")

    @property
    def free(self) -> int:
        return sys.maxsize  # the node makes room itself

    def get(self, keys: Sequence[bytes], target: HostPool) -> None:
        """Loads the blocks under ``keys`` into ``target``, at most the node's DRAM slots per
        lease (blocks on the node's disk are moved up into its DRAM for the lease); raises
        BlocksMissingError with a ``loaded`` mask when any was not loaded."""
        keys = list(keys)
        step = max(1, self.client.server_capacity)
        loaded: list[bool] = []
        corrupt = 0
        for i in range(0, len(keys), step):
            part = keys[i : i + step]
            try:
                super().get(part, target)
                loaded += [True] * len(part)
            except BlocksMissingError as missing:
                loaded += list(missing.loaded)
                corrupt += missing.corrupt
        if not all(loaded):
            raise BlocksMissingError(
                f"keys: {loaded.count(False)} of {len(keys)} blocks not served by "
                f"{self.client.label} ({corrupt} failed verification)",
                loaded=loaded,
                corrupt=corrupt,
            )

    def get_scattered_counted(
        self, keys: Sequence[bytes], scatter: Scatter
    ) -> tuple[list[bool], int]:
        """:meth:`RemotePool.get_scattered_counted`, at most the node's DRAM slots per
        lease."""
        keys = list(keys)
        step = max(1, self.client.server_capacity)
        if len(keys) <= step:
            return super().get_scattered_counted(keys, scatter)
        loaded: list[bool] = []
        corrupt = 0
        for i in range(0, len(keys), step):
            part = range(i, min(i + step, len(keys)))
            got, bad = super().get_scattered_counted(keys[i : part.stop], scatter.select(part))
            loaded += got
            corrupt += bad
        return loaded, corrupt

    def put(self, keys: Sequence[bytes], source: HostPool) -> int:
        """Pushes ``source``'s blocks under ``keys`` to the node; returns how many it stored
        now (keys it held already are not counted). Raises BlocksMissingError (with
        ``loaded``) when ``source`` lacks some keys, before pushing anything."""
        if not isinstance(source, HostPool):
            raise InvalidArgumentError(f"source: expected a HostPool, got {type(source).__name__}")
        in_source = source.contains(keys)
        if not all(in_source):
            raise BlocksMissingError(
                f"keys: {in_source.count(False)} of {len(in_source)} blocks are not in the "
                "source pool",
                loaded=in_source,
            )
        held = self.client.contains(keys)
        fresh = [k for k, h in zip(keys, held, strict=True) if not h]
        if not fresh:
            return 0
        # a put lands in the node's DRAM: never more at once than it holds (with a disk, each
        # batch demotes the one before)
        step = max(1, self.client.server_capacity)
        written = sum(
            sum(self.client.push(fresh[i : i + step], source)) for i in range(0, len(fresh), step)
        )
        self.stats.add(bytes_in=written * self.layout.payload_bytes, puts=written)
        return written

    def delete(self, keys: Sequence[bytes]) -> int:
        keys = list(keys)
        dropped = 0
        for i in range(0, len(keys), MAX_KEYS_PER_REQUEST):
            batch = [k.hex() for k in keys[i : i + MAX_KEYS_PER_REQUEST]]
            dropped += int(call(self.client, "delete", {"keys": batch}))
        self.stats.add(deletes=dropped)
        return dropped

    def keys(self) -> list[bytes]:
        out: list[bytes] = []
        while True:
            page = call(self.client, "keys", {"start": len(out), "limit": MAX_KEYS_PER_REQUEST})
            if not isinstance(page, list):
                raise InvalidArgumentError(f"keys: malformed answer {page!r:.100}")
            out += [bytes.fromhex(k) for k in page]
            if len(page) < MAX_KEYS_PER_REQUEST:
                return out
