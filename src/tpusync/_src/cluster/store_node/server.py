"""The store node's server: :class:`StoreServer`, a block server of one HostPool per layout
that also accepts blocks (see :mod:`tpusync._src.cluster.store_node`)."""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster._handshake import _error, _send_json
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.frames import frame_receiver, slot_addresses
from tpusync._src.cluster.dataplane.protocol import MAX_KEYS_PER_REQUEST, keys_param
from tpusync._src.cluster.dataplane.server import BlockServer, Served
from tpusync._src.cluster.store_node._lending import (
    MAX_SLOT_BYTES,
    NAME_PATTERN,
    Lent,
    check_room_to_lend,
    checksums_param,
    recv_exactly,
    recv_header,
)
from tpusync._src.cluster.supervisor import SupervisedLoop
from tpusync._src.cluster.tcp_server import (
    AuthenticatedTcpServer,
    BlockServerOptions,
    options_of,
)
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.dram import DEFAULT_SHM_DIR, HostPool
from tpusync._src.tiers.dram.shm_admin import node_pool_name, read_pool_header
from tpusync._src.tiers.layout import PoolLayout
from tpusync.errors import (
    BlocksMissingError,
    FrameError,
    InvalidArgumentError,
    PoolFormatError,
    TpuSyncError,
)

__all__ = ["StoreServer"]

log = logging.getLogger(__name__)


class StoreServer(BlockServer):
    """A block server that lends ``dram_bytes`` of DRAM to peers (see the module docstring).

    Each block layout a client names gets its own HostPool of ``dram_bytes // max_layouts``
    bytes, made on first use (prefaulted then); a client naming one layout more than that is
    refused with a clear error. Connections that name no layout are refused too: a store node
    has no layout of its own.

    Args:
      dram_bytes: the DRAM to lend, all layouts together.
      secret, host, port, lease_ttl_s, handshake_timeout_s, io_timeout_s, max_connections,
        max_handshakes, tls, insecure, clock (keywords), or ``options``: as for
        :class:`~tpusync.cluster.BlockServer`.
      max_layouts: how many block layouts (models) share the DRAM.
      name: keep the pools in ``shm_dir`` as ``tpusync-<name>-<fingerprint>.pool``: a restarted
        node re-attaches them with their blocks.
      disk_dir, disk_bytes: also lend this much local disk (a DiskPool per layout under
        ``disk_dir``): DRAM's least recently used blocks are demoted there instead of dropped,
        and a peer's lease first moves disk blocks back up into DRAM (a block rests in one of
        the two, so the node holds their sum). A restarted node
        re-attaches the disk pools with their blocks.
      on_added, on_removed: told of the keys the node gained and lost (the registry link).

    Raises :class:`~tpusync.errors.TierFullError` (naming ``dram_bytes`` or ``disk_bytes``)
    when this host has less memory available (``MemAvailable``), room in ``shm_dir`` (named
    pools) or room on the disk than asked for, and
    :class:`~tpusync.errors.InvalidArgumentError` when ``disk_dir`` (or ``shm_dir``, with a
    name) is missing or not writable; a restarted node's own files count as room.
    """

    _thread_name = "tpusync-store-node"
    _label = "store node"

    def __init__(
        self,
        dram_bytes: int,
        *,
        max_layouts: int = 1,
        name: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        on_added: Callable[[list[bytes]], None] | None = None,
        on_removed: Callable[[list[bytes]], None] | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        options: BlockServerOptions | None = None,
        **keywords: Any,
    ) -> None:
        if disk_dir is not None and (type(disk_bytes) is not int or disk_bytes < 1 << 20):
            raise InvalidArgumentError(
                f"disk_bytes: expected an integer of at least 1 MiB with disk_dir, got "
                f"{disk_bytes!r}"
            )
        if type(dram_bytes) is not int or dram_bytes < 1 << 20:
            raise InvalidArgumentError(
                f"dram_bytes: expected an integer of at least 1 MiB, got {dram_bytes!r}"
            )
        if type(max_layouts) is not int or not 1 <= max_layouts <= 64:
            raise InvalidArgumentError(f"max_layouts: expected 1 to 64, got {max_layouts!r}")
        if name is not None and (not isinstance(name, str) or not NAME_PATTERN.match(name)):
            raise InvalidArgumentError(
                f"name: {name!r} must be letters, digits, '.', '_' or '-' (at most 81)"
            )
        check_room_to_lend(dram_bytes, name, shm_dir, disk_dir, disk_bytes)
        options = options_of(BlockServerOptions, options, keywords)  # checked before any room
        self._listen(options)
        self.dram_bytes = dram_bytes
        self.max_layouts = max_layouts
        self.layout_bytes = dram_bytes // max_layouts
        self.name, self.shm_dir = name, shm_dir
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self.disk_layout_bytes = disk_bytes // max_layouts
        self._clock = options.clock
        self.on_added, self.on_removed = on_added, on_removed
        self._lent: dict[bytes, Lent] = {}
        self._lent_lock = threading.Lock()
        try:
            if name is not None:
                self._attach_named()
        except BaseException:
            self._sock.close()
            self._close_pools()
            raise
        self._start()

    # --- pools, one per layout -----------------------------------------------------------------

    def _pool_name(self, layout: PoolLayout) -> str:
        assert self.name is not None
        return node_pool_name(self.name, layout.fingerprint)  # what `tpusync shm remove` finds

    def _attach_named(self) -> None:
        """Re-attaches the pools a previous run of this node left in ``shm_dir``."""
        for path in sorted(Path(self.shm_dir).glob(f"tpusync-{self.name}-*.pool")):
            try:
                header = read_pool_header(path)  # no wait on a FIFO, no link followed
                layout = header.layout
            except (OSError, PoolFormatError, KeyError, TypeError, ValueError) as exc:
                log.warning("store node: skipping %s: %s", path, exc)
                continue
            if path.name != f"tpusync-{self._pool_name(layout)}.pool":
                continue
            if len(self._lent) >= self.max_layouts:
                log.warning("store node: more pools than max_layouts; skipping %s", path)
                continue
            pool = HostPool(
                layout, header.n_slots, name=self._pool_name(layout), shm_dir=self.shm_dir
            )
            self._lent[layout.fingerprint] = Lent(
                pool,
                self._clock,
                self._open_disk(layout),
                self._lease_failed,
                lease_max_s=self.options.lease_lifetime_s,
            )
            log.info("store node: re-attached %s (%d of %d blocks)", path, pool.used, pool.capacity)

    def _lent_for(self, layout: PoolLayout) -> Lent:
        with self._lent_lock:
            lent = self._lent.get(layout.fingerprint)
            if lent is not None:
                return lent
            if len(self._lent) >= self.max_layouts:
                raise InvalidArgumentError(
                    f"layout: this store node lends DRAM to {self.max_layouts} block layout(s) "
                    "and has no room for another; start it with more --layouts (or another "
                    "node for this model)"
                )
            slots = self.layout_bytes // layout.slot_bytes
            if slots < 1:
                raise InvalidArgumentError(
                    f"layout: a block of {layout.slot_bytes} B does not fit in the "
                    f"{self.layout_bytes} B this node lends per layout; give it more --dram"
                )
            name = None if self.name is None else self._pool_name(layout)
            pool = HostPool(layout, slots, name=name, shm_dir=self.shm_dir)
            try:
                disk = self._open_disk(layout)
            except BaseException:
                pool.close()
                raise
            lent = self._lent[layout.fingerprint] = Lent(
                pool,
                self._clock,
                disk,
                self._lease_failed,
                lease_max_s=self.options.lease_lifetime_s,
            )
            if disk is not None and disk.used and self.on_added is not None:
                self.on_added(disk.keys())  # a restarted node's disk blocks
            log.info(
                "store node: lending %d slots of %d B to model %r",
                slots,
                layout.slot_bytes,
                layout.model_id,
            )
            return lent

    def _open_disk(self, layout: PoolLayout) -> DiskPool | None:
        if self.disk_dir is None:
            return None
        slots = self.disk_layout_bytes // layout.slot_bytes
        if slots < 1:
            raise InvalidArgumentError(
                f"layout: a block of {layout.slot_bytes} B does not fit in the "
                f"{self.disk_layout_bytes} B of disk this node lends per layout"
            )
        directory = self.disk_dir / f"{self.name or 'node'}-{layout.fingerprint.hex()[:16]}"
        try:  # 0700: under a umask of 002 the group could write it, and DiskPool refuses that
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(f"disk_dir: cannot create {directory}: {exc}") from None
        return DiskPool(layout, slots, directory)

    def _loops(self) -> dict[str, SupervisedLoop]:
        loops = AuthenticatedTcpServer._loops(self)  # no pool of its own: one per layout
        with self._lent_lock:
            for lent in self._lent.values():
                loop = lent.served.leases.loop
                loops[f"lease expiry {lent.pool.layout.fingerprint.hex()[:16]}"] = loop
        return loops

    def _lent_of(self, served: Served) -> Lent:
        return self._lent[served.pool.layout.fingerprint]

    @property
    def pools(self) -> list[HostPool]:
        """The pools lent so far, one per layout."""
        with self._lent_lock:
            return [lent.pool for lent in self._lent.values()]

    def keys(self) -> list[bytes]:
        """Every key the node holds (DRAM and disk), all layouts together."""
        with self._lent_lock:
            lent = list(self._lent.values())
        return [key for item in lent for key in item.keys()]  # noqa: SIM118

    # --- the connection's binding --------------------------------------------------------------

    def _initial_binding(self) -> Served | None:
        return None  # nothing until the hello names a layout

    def _bind(self, params: dict[str, Any], served: Served | None) -> Served:
        description = params.get("layout")
        if not isinstance(description, dict):
            raise InvalidArgumentError(
                "layout: a store node serves the layout its client names; connect with "
                "BlockClient(..., layout=...) or StoreNodePool"
            )
        try:
            layout = PoolLayout.from_description(description)
            slot_bytes = layout.slot_bytes
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgumentError(f"layout: not a block layout description: {exc}") from None
        if not 0 < slot_bytes <= MAX_SLOT_BYTES:
            raise InvalidArgumentError(f"layout: blocks of {slot_bytes} B are not accepted")
        return self._lent_for(layout).served

    def _streams(
        self,
    ) -> dict[str, Callable[[socket.socket, Served, int, dict[str, Any]], bool]]:
        return {"get": self._handle_get, "put": self._handle_put}

    def _handlers(self, served: Served) -> dict[str, Callable[[dict[str, Any]], Any]]:
        handlers = super()._handlers(served)
        lent = self._lent_of(served)
        handlers["delete"] = lambda p: self._delete(served, keys_param(p.get("keys")))
        handlers["keys"] = lambda p: self._keys_page(served, p)
        handlers["contains"] = lambda p: lent.contains(keys_param(p.get("keys")))
        handlers["stat"] = lambda p: {
            "capacity": lent.pool.capacity + (0 if lent.disk is None else lent.disk.capacity),
            "used": len(lent.keys()),
        }
        return handlers

    def _acquire(self, served: Served, params: dict[str, Any]) -> dict[str, Any]:
        lent = self._lent_of(served)
        if lent.disk is not None:
            try:
                keys = keys_param(params.get("keys"))
            except InvalidArgumentError:
                keys = []  # the lease below says what was wrong
            self._promote(lent, keys)
        return super()._acquire(served, params)

    def _promote(self, lent: Lent, keys: list[bytes]) -> None:
        """Moves the keys a peer is about to lease up from disk into DRAM."""
        assert lent.disk is not None
        pool, disk = lent.pool, lent.disk
        left: list[bytes] = []
        with lent.lock:
            in_dram = pool.contains(keys)
            want = [
                k
                for k, here, there in zip(keys, in_dram, disk.contains(keys), strict=True)
                if there and not here
            ]
            if not want:
                return
            for key in (k for k, here in zip(keys, in_dram, strict=True) if here):
                lent.lru.move_to_end(key)  # what the peer reads is not made room for
            keep = set(keys)
            # A swap, a few blocks at a time: each step demotes no more DRAM victims than the
            # disk has free slots, then frees as many disk slots by moving blocks up (tiers are
            # exclusive: a block rests in DRAM or on disk, so the node holds their sum).
            while want:
                step = want[: max(1, min(disk.free, pool.capacity))]
                want = want[len(step) :]
                left += self._make_room(lent, len(step), keep=keep)
                step = step[: pool.free]
                if not step:
                    break  # DRAM is pinned full
                try:
                    disk.get(step, pool)
                    loaded = step
                except BlocksMissingError as missing:
                    loaded = [k for k, ok in zip(step, missing.loaded, strict=True) if ok]
                except (TpuSyncError, OSError) as error:
                    log.warning("store node: moving blocks up from disk failed: %s", error)
                    loaded = [k for k, ok in zip(step, pool.contains(step), strict=True) if ok]
                for key in loaded:
                    lent.lru[key] = None
                    lent.lru.move_to_end(key)
                disk.delete(loaded)
                for key in loaded:
                    lent.disk_lru.pop(key, None)
        if left and self.on_removed is not None:
            self.on_removed(left)

    def _read(self, served: Served, keys: list[bytes]) -> None:
        self._lent_of(served).touch(keys)

    # --- put -------------------------------------------------------------------------------

    def _handle_put(
        self, conn: socket.socket, served: Served, rid: int, params: dict[str, Any]
    ) -> bool:
        """Receives one ``put`` (see the module docstring); False when the connection must
        close (it broke the stream: nothing in flight was committed)."""
        lent = self._lent_of(served)
        pool = lent.pool
        try:
            keys = keys_param(params.get("keys"))
            sums = checksums_param(params.get("checksums"), len(keys))
            if len(set(keys)) != len(keys):
                raise InvalidArgumentError("keys: each key at most once per put")
            present = lent.contains(keys)  # in DRAM or on disk: stored already
            reservation = self._reserve(
                lent, [k for k, p in zip(keys, present, strict=True) if not p]
            )
        except InvalidArgumentError as exc:
            _send_json(conn, _error(rid, "InvalidArgumentError", str(exc)))
            return True
        taken = dict(zip(reservation.keys, range(len(reservation.keys)), strict=True))
        accept = [k in taken for k in keys]
        expected = np.zeros(len(reservation.keys), dtype=np.uint64)
        for key, checksum in zip(keys, sums, strict=True):
            if key in taken:
                expected[taken[key]] = checksum
        ok = np.zeros(len(reservation.keys), dtype=bool)
        # every frame must arrive within lease_max_s: a peer that sends a byte now and then
        # holds the reserved slots (and this thread) no longer
        deadline = Deadline.within(
            self.options.lease_lifetime_s,
            option="lease_max_s",
            what=f"a put of {len(keys)} blocks",
            fix="the peer sends too slowly; raise the server's lease_max_s for slower links",
        )
        try:
            _send_json(conn, {"id": rid, "result": {"accept": accept, "present": present}})
            verified = self._receive_put(conn, pool, rid, reservation, expected, ok, deadline)
        except FrameError as exc:  # the peer's misbehaviour, not ours: one line, a count
            pool.abort(reservation)
            self._misbehaved(conn, f"damaged put frame ({exc.reason})", str(exc))
            return False  # the stream's position is lost: close; nothing in flight committed
        except BaseException:
            pool.abort(reservation)
            raise  # the connection closes (OSError, EOFError): nothing committed
        picked = np.flatnonzero(ok & ~verified)  # not hashed as they landed: hashed now
        if len(picked):
            ok[picked] = pool.hash_slots(reservation.slots[picked]) == expected[picked]
        corrupt = int(len(ok) - ok.sum())
        if corrupt:
            log.warning("store node: %d pushed blocks failed verification; dropped", corrupt)
            pool.stats.add(checksum_failures=corrupt)
            pool.abort(reservation.subset(~ok))
        good = reservation.subset(ok)
        if len(good.keys):
            pool.commit(good, expected[ok])
            lent.touch(good.keys)
            if self.on_added is not None:
                self.on_added(list(good.keys))
        stored = [
            p or bool(k in taken and ok[taken[k]]) for k, p in zip(keys, present, strict=True)
        ]
        _send_json(conn, {"id": rid, "result": {"stored": stored}})
        return True

    def _receive_put(
        self,
        conn: socket.socket,
        pool: HostPool,
        rid: int,
        reservation: Any,
        expected: np.ndarray,
        ok: np.ndarray,
        deadline: Deadline,
    ) -> np.ndarray:
        """Receives the BLOCK frames of the accepted keys (in order) and the END frame before
        ``deadline``; ``ok[i]`` is set for each complete block whose frame matches its
        declaration. Returns which blocks were also verified as they landed (the rest are hashed
        afterwards)."""
        keys = list(reservation.keys)
        size = pool.layout.payload_bytes

        def one_block(i: int, header_bytes: bytes | None = None) -> None:
            """Block ``i`` a frame at a time (its header read here unless given)."""
            header = wire.decode_header(
                header_bytes or recv_header(conn, deadline), max_payload=size
            )
            if header.frame_type != wire.BLOCK or header.request_id != rid or header.key != keys[i]:
                raise FrameError(
                    f"expected the BLOCK frame of {keys[i].hex()} for request {rid}", "stream"
                )
            if header.payload_length != size:
                raise FrameError(f"a block of {header.payload_length} B, expected {size}")
            with pool.slot_memory(int(reservation.slots[i])) as memory, memory[:size] as payload:
                recv_exactly(conn, payload, deadline)
            ok[i] = header.fingerprint == pool.layout.fingerprint and header.checksum == int(
                expected[i]
            )

        if isinstance(conn, ssl.SSLSocket):  # TLS decrypts in Python: a frame at a time
            for i in range(len(keys)):
                one_block(i)
            self._check_put_end(rid, recv_header(conn, deadline))
            return np.zeros(len(keys), dtype=bool)
        silence = conn.gettimeout() or 1e6
        with slot_addresses(pool, reservation.slots) as addresses:
            receiver = frame_receiver(conn, rid, keys, pool.layout, expected, addresses)
            try:
                while (status := receiver.run(deadline.left(), silence)) != _core.FRAMES_DONE:
                    if status == _core.FRAMES_SILENT:
                        raise TimeoutError(f"the peer sent nothing for {silence} s mid-put")
                    if status == _core.FRAMES_TIMEOUT:
                        if deadline.left() <= 0:
                            raise deadline.missed()
                        continue
                    if status == _core.FRAMES_HEADER:  # not the frame declared: Python's turn
                        one_block(receiver.index, receiver.header)
                        receiver.resume(receiver.index + 1)
                self._check_put_end(rid, receiver.header)
            finally:
                verified = receiver.results == 1
                del receiver  # before the pool's memory may go
        ok |= verified
        return verified

    @staticmethod
    def _check_put_end(rid: int, header_bytes: bytes) -> None:
        header = wire.decode_header(header_bytes, max_payload=0)
        if header.frame_type != wire.END or header.request_id != rid:
            raise FrameError(f"expected the END frame of request {rid}", "stream")

    def _reserve(self, lent: Lent, keys: list[bytes]) -> Any:
        """Reserves slots for as many of ``keys`` as fit, first ones first, making room (see
        :meth:`_make_room`)."""
        pool = lent.pool
        with lent.lock:
            left = self._make_room(lent, len(keys))
            reservation = pool.reserve(keys[: max(0, min(len(keys), pool.free))])
        if left and self.on_removed is not None:
            self.on_removed(left)
        return reservation

    def _make_room(
        self, lent: Lent, blocks: int, keep: frozenset[bytes] | set[bytes] = frozenset()
    ) -> list[bytes]:
        """Frees DRAM slots for ``blocks`` by dropping the least recently used unpinned blocks
        (demoting them to disk first, when the node has a disk); returns the keys that left the
        node altogether. Call with ``lent.lock`` held."""
        pool = lent.pool
        need = min(blocks, pool.capacity) - pool.free
        left: list[bytes] = []
        candidates = iter([k for k in lent.lru if k not in keep])
        evicted = 0
        while need > 0:
            victims = [k for _, k in zip(range(need), candidates, strict=False)]
            if not victims:
                break  # the rest is pinned (being read)
            if lent.disk is not None:
                left += self._demote(lent, victims, keep)
            pool.delete(victims)
            gone = [k for k, held in zip(victims, pool.contains(victims), strict=True) if not held]
            for key in gone:
                lent.lru.pop(key, None)
            evicted += len(gone)
            if lent.disk is None:
                left += gone
            else:
                left += [k for k, d in zip(gone, lent.disk.contains(gone), strict=True) if not d]
            need = min(blocks, pool.capacity) - pool.free
        if evicted:
            pool.stats.add(evictions=evicted)
        return left

    def _demote(
        self, lent: Lent, victims: list[bytes], keep: frozenset[bytes] | set[bytes]
    ) -> list[bytes]:
        """Writes DRAM victims the disk lacks to it, dropping the disk's least recently used
        blocks (never those in ``keep``: being moved up) for room; returns the keys that left
        the node (dropped from disk, not in DRAM)."""
        disk, pool = lent.disk, lent.pool
        assert disk is not None
        fresh = [k for k, d in zip(victims, disk.contains(victims), strict=True) if not d]
        left: list[bytes] = []
        room = min(len(fresh), disk.capacity) - disk.free
        spare = set(victims) | set(keep)
        candidates = iter([k for k in lent.disk_lru if k not in spare])
        while room > 0:
            drop = [k for _, k in zip(range(room), candidates, strict=False)]
            if not drop:
                break
            disk.delete(drop)
            gone = [k for k, d in zip(drop, disk.contains(drop), strict=True) if not d]
            for key in gone:
                lent.disk_lru.pop(key, None)
            left += [k for k, d in zip(gone, pool.contains(gone), strict=True) if not d]
            room = min(len(fresh), disk.capacity) - disk.free
        fresh = fresh[: disk.free]
        try:
            disk.put(fresh, pool)
        except (TpuSyncError, OSError) as error:  # those victims are simply dropped
            log.warning("store node: demoting %d blocks to disk failed: %s", len(fresh), error)
        for key in (k for k, d in zip(victims, disk.contains(victims), strict=True) if d):
            lent.disk_lru[key] = None
            lent.disk_lru.move_to_end(key)
        return left

    # --- delete, keys ----------------------------------------------------------------------

    def _delete(self, served: Served, keys: list[bytes]) -> int:
        lent = self._lent_of(served)
        with lent.lock:
            dropped = lent.pool.delete(keys)
            if lent.disk is not None:
                dropped += lent.disk.delete(keys)
                for key, d in zip(keys, lent.disk.contains(keys), strict=True):
                    if not d:
                        lent.disk_lru.pop(key, None)
            gone = [k for k, held in zip(keys, lent.contains(keys), strict=True) if not held]
            for key, held in zip(keys, lent.pool.contains(keys), strict=True):
                if not held:
                    lent.lru.pop(key, None)
        if gone and self.on_removed is not None:
            self.on_removed(gone)
        return dropped

    def _keys_page(self, served: Served, params: dict[str, Any]) -> list[str]:
        start, limit = params.get("start", 0), params.get("limit", MAX_KEYS_PER_REQUEST)
        if type(start) is not int or start < 0:
            raise InvalidArgumentError(f"start: expected an index >= 0, got {start!r:.50}")
        if type(limit) is not int or not 1 <= limit <= MAX_KEYS_PER_REQUEST:
            raise InvalidArgumentError(
                f"limit: expected 1 to {MAX_KEYS_PER_REQUEST}, got {limit!r:.50}"
            )
        keys = sorted(self._lent_of(served).keys())
        return [k.hex() for k in keys[start : start + limit]]

    # --- close -----------------------------------------------------------------------------

    def _close_pools(self) -> None:
        with self._lent_lock:
            lent, self._lent = list(self._lent.values()), {}
        for item in lent:
            item.served.leases.close()
            item.pool.close()
            if item.disk is not None:
                item.disk.close()

    def close(self) -> None:
        """Stops serving, releases every lease and closes the pools (named ones stay in
        ``shm_dir`` for the next run)."""
        AuthenticatedTcpServer.close(self)
        self._close_pools()
