"""The data plane's client: :class:`BlockClient` pulls blocks from a
:class:`~tpusync.cluster.BlockServer` straight into a local HostPool's slots, and pushes them to
a store node (the protocol: :mod:`tpusync._src.cluster.dataplane`)."""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpusync._src.cluster._handshake import _check_secret, _ProtocolError, check_transport
from tpusync._src.cluster.circuit import PeerCircuits, is_deadline_miss
from tpusync._src.cluster.dataplane._answers import check_lease
from tpusync._src.cluster.dataplane._connection import Connection
from tpusync._src.cluster.dataplane._lease_keeper import LeaseKeeper
from tpusync._src.cluster.dataplane._pushing import push_stripe
from tpusync._src.cluster.dataplane._receiving import Link, receive_stripe
from tpusync._src.cluster.dataplane.deadlines import Deadline, check_limit, limit_for
from tpusync._src.cluster.dataplane.frames import slot_addresses
from tpusync._src.cluster.dataplane.local_reads import PoolFileReader, lease_slots, whole_slots
from tpusync._src.cluster.dataplane.protocol import (
    DEADLINE_FRACTION,
    MAX_KEYS_PER_REQUEST,
    StreamError,
    parse_path,
)
from tpusync._src.cluster.dataplane.stripes import PoolStripe, ScatterStripe, _Stripe
from tpusync._src.cluster.registry.base import check_keys
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync.errors import (
    AuthenticationError,
    FrameError,
    InvalidArgumentError,
    PeerUnavailableError,
    RemoteOperationUnsupportedError,
)

__all__ = ["BlockClient", "HeldBlocks", "PullResult"]

log = logging.getLogger(__name__)

# (reader, key indices, their slots, their checksums) -> verified per index, or None (use TCP)
_LocalLanding = Callable[[PoolFileReader, np.ndarray, np.ndarray, np.ndarray], "np.ndarray | None"]


@dataclass
class PullResult:
    """What a pull did: ``loaded[i]`` for ``keys[i]``; ``corrupt`` blocks failed verification;
    ``error`` is the first transport or protocol failure (None when there was none);
    ``released`` is False when the lease lapsed, or was not released because a deadline was
    missed (the peer stalled: asking it would wait out another); then nothing was committed."""

    loaded: list[bool]
    corrupt: int = 0
    error: BaseException | None = None
    released: bool = True
    bytes_received: int = field(default=0)
    local_blocks: int = 0  # of the loaded ones, read from the server's pool file on this host


@dataclass
class HeldBlocks:
    """What :meth:`BlockClient.hold` holds: ``present[i]`` and ``checksums[i]`` for
    ``keys[i]``; ``lapsed`` turns True when a renewal failed (the server may drop them)."""

    keys: list[bytes]
    present: list[bool]
    checksums: list[int]
    lapsed: bool = False


class BlockClient:
    """Pulls blocks from one :class:`BlockServer` into local HostPools.

    Give ``address`` (``"host:port"``) or ``addresses`` (paths to the same server: each
    ``"host:port"`` or ``"local>host:port"``, where the local address is bound before
    connecting, e.g. ``"10.0.1.5>10.0.1.9:7000"`` to use one NIC per path); ``connections``
    (default: one per address) sockets are opened, path ``i % len(addresses)`` each, and a pull's
    keys are striped over them, one thread per connection.

    Connects and authenticates at once. ``timeout_s`` is each control request's deadline
    (connecting included) and the longest silence of a pull or push; ``lease_ttl_s`` is asked
    of the server (which may grant less); a pull stops receiving after DEADLINE_FRACTION of the
    granted TTL, moved on by each renewal the server grants (the timing rule of
    :mod:`tpusync._src.cluster.dataplane.leases`), but never past ``max_pull_s`` after the pull
    started; a push ends within ``max_push_s`` (its request, frames and answers together), however
    slowly the server takes them. Either limit defaults (None) to 30 s plus the bytes at
    32 MiB/s (:mod:`tpusync._src.cluster.dataplane.deadlines`); a missed one is a
    :class:`~tpusync.errors.DeadlineExceededError` (the pull's keys are False, with
    :attr:`PullResult.error`; a push's keys are False, logged, or PeerUnavailableError from it
    when nothing got through) and opens the server's circuit.
    One pull or push at a time per client (calls are serialized).

    ``layout`` names the block layout this client moves; a server of several layouts (a store
    node, :mod:`tpusync._src.cluster.store_node`) serves that one, and a plain BlockServer ignores
    it (pulls compare fingerprints). :meth:`push` needs a server that accepts blocks (a store node).

    ``same_host`` (default True): when the server runs on this host as this user and its pool
    is a named /dev/shm pool, pulls copy the blocks from its pool file instead of receiving
    them over TCP, verified the same way (:mod:`tpusync._src.cluster.dataplane.local_reads`);
    :attr:`local_blocks` counts them. False: always TCP.

    ``circuits`` (default: the client's own): the circuit of the server's address
    (:mod:`tpusync._src.cluster.circuit`). Every request and pull goes through it: after
    consecutive failures or a missed deadline, requests fail at once with
    :class:`~tpusync.errors.CircuitOpenError` (a PeerUnavailableError) until the back-off is
    over and one probe succeeds. Pass one :class:`PeerCircuits` to several clients (e.g. one
    per node of a cluster) to keep each peer's circuit across reconnections.

    Raises:
      AuthenticationError: the server and this client do not share ``secret``.
      PeerUnavailableError: the server cannot be reached or is not a block server.
      InvalidArgumentError: the addresses lead to different servers.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        addresses: Sequence[str] | None = None,
        connections: int | None = None,
        secret: bytes,
        timeout_s: float = 10.0,
        lease_ttl_s: float | None = None,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
        layout: PoolLayout | None = None,
        same_host: bool = True,
        circuits: PeerCircuits | None = None,
        max_pull_s: float | None = None,
        max_push_s: float | None = None,
    ) -> None:
        if (address is None) == (addresses is None):
            raise InvalidArgumentError("address, addresses: give exactly one of them")
        paths_text = [address] if address is not None else list(addresses or [])
        if not paths_text:
            raise InvalidArgumentError("addresses: expected at least one address")
        paths = [parse_path(p) for p in paths_text]
        for _, remote in paths:
            check_transport(remote[0], tls, insecure, "addresses")
        count = len(paths) if connections is None else connections
        if type(count) is not int or not 1 <= count <= 64:
            raise InvalidArgumentError(f"connections: expected 1 to 64, got {connections!r}")
        self._secret = _check_secret(secret)
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise InvalidArgumentError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        if lease_ttl_s is not None and (
            not isinstance(lease_ttl_s, int | float) or not 0 < lease_ttl_s <= 3600
        ):
            raise InvalidArgumentError(f"lease_ttl_s: expected (0, 3600] s, got {lease_ttl_s!r}")
        if layout is not None and not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout or None, got {type(layout).__name__}"
            )
        if not isinstance(same_host, bool):
            raise InvalidArgumentError(f"same_host: expected True or False, got {same_host!r}")
        if circuits is not None and not isinstance(circuits, PeerCircuits):
            raise InvalidArgumentError(
                f"circuits: expected a PeerCircuits or None, got {type(circuits).__name__}"
            )
        self.circuits = circuits if circuits is not None else PeerCircuits()
        self.max_pull_s = check_limit(max_pull_s, "max_pull_s")
        self.max_push_s = check_limit(max_push_s, "max_push_s")
        self.same_host = same_host
        self.pool_file: PoolFileReader | None = None
        self.local_blocks = 0  # blocks pulled from the server's pool file on this host
        self._timeout = float(timeout_s)
        self._link = Link(self._ensure, self._timeout)
        self._ttl = lease_ttl_s
        self._lock = threading.Lock()
        described = None if layout is None else layout.describe()
        self._conns = [
            Connection(
                *paths[i % len(paths)],
                paths_text[i % len(paths)],
                secret,
                self._timeout,
                tls,
                described,
                self._check_same_server,
            )
            for i in range(count)
        ]
        self.label = paths_text[0]
        self._executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="tpusync-pull")
        # Lease renewals during a pull go over a connection of their own: the others stream.
        self._control = Connection(
            *paths[0], paths_text[0], secret, self._timeout, tls, described,
            self._check_same_server,
        )  # fmt: skip
        self._closed = False
        self._holding: set[Connection] = set()  # the connections of holds in progress
        self._new_connection = lambda: Connection(
            *paths[0], paths_text[0], secret, self._timeout, tls, described,
            self._check_same_server,
        )  # fmt: skip
        self.server_id: str | None = None
        try:
            with self._circuit() as outcome:
                for conn in self._conns:
                    try:
                        conn.connect()
                    except BaseException as exc:
                        outcome.error = exc
                        raise
        except BaseException:
            self.close()
            raise
        hello = self._conns[0].hello
        self.fingerprint = bytes.fromhex(str(hello.get("fingerprint", "")))
        self.payload_bytes = int(hello.get("payload_bytes", 0))
        self.server_capacity = int(hello.get("capacity", 0))
        self.writable = hello.get("writable") is True
        self._local_reader()  # maps the server's pool file now, if it may be read

    @contextlib.contextmanager
    def _circuit(self) -> Iterator[_Outcome]:
        """Runs one operation through the server's circuit: raises CircuitOpenError at once
        while it is open; afterwards notes the operation's failure (set ``outcome.error``, or
        raise) or its success."""
        self.circuits.admit(self.label)
        outcome = _Outcome()
        try:
            yield outcome
        except BaseException as exc:
            outcome.error = outcome.error or exc
            raise
        finally:
            error = outcome.error
            if error is None:
                self.circuits.succeeded(self.label)
            elif _peer_failed(error):
                self.circuits.failed(self.label, error)
            else:  # e.g. a refused argument, a full target: no verdict on the peer's health
                self.circuits.release(self.label)

    def _check_same_server(self, conn: Connection) -> None:
        server_id = conn.hello.get("server_id")
        if self.server_id is None:
            self.server_id = server_id
        elif server_id != self.server_id:
            raise InvalidArgumentError(
                f"addresses: {conn.label} leads to another block server than {self.label}; "
                "every path of a client must reach the same server"
            )

    def _ensure(self, conn: Connection) -> None:
        if self._closed:  # close() ends a pull in progress: no reconnecting behind it
            raise PeerUnavailableError(f"the client of {self.label} is closed")
        conn.ensure()  # a new connection's hello is checked by _check_same_server

    # --- queries ----------------------------------------------------------------------------

    def _request(self, conn: Connection, method: str, params: dict[str, Any]) -> Any:
        """One control request on ``conn``, retried once on a fresh connection when the server
        had closed the old one. (A retried ``acquire`` may leave a lease to expire; a retried
        ``release`` answers False, and the pull is discarded: both safe.)"""
        if self._closed:  # close() ends a pull in progress: no reconnecting behind it
            raise PeerUnavailableError(f"the client of {self.label} is closed")
        return conn.call(method, params)

    def _call(self, method: str, params: dict[str, Any]) -> Any:
        with self._lock:
            self._check_open()
            with self._circuit():
                return self._request(self._conns[0], method, params)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        out: list[bool] = []
        for i in range(0, len(keys), MAX_KEYS_PER_REQUEST):
            batch = keys[i : i + MAX_KEYS_PER_REQUEST]
            result = self._call("contains", {"keys": [k.hex() for k in batch]})
            if not isinstance(result, list) or len(result) != len(batch):
                raise PeerUnavailableError(f"malformed contains answer: {result!r:.200}")
            out.extend(bool(x) for x in result)
        return out

    def stat(self) -> dict[str, int]:
        result = self._call("stat", {})
        if not isinstance(result, dict):
            raise PeerUnavailableError(f"malformed stat answer: {result!r:.200}")
        return {"capacity": int(result.get("capacity", 0)), "used": int(result.get("used", 0))}

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this BlockClient is closed")

    # --- hold -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> Iterator[HeldBlocks]:
        """Leases ``keys`` on the server for as long as the ``with`` lasts, renewed every third
        of the TTL on a connection and thread of its own, so that the server keeps them (a
        weights publisher drops no version a puller holds), for at most the server's
        ``lease_max_s``: once it refuses a renewal, :attr:`HeldBlocks.lapsed` turns True. Pulls
        may run meanwhile."""
        keys = check_keys(keys)
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise InvalidArgumentError(
                f"keys: at most {MAX_KEYS_PER_REQUEST} a hold, got {len(keys)}"
            )
        self._check_open()
        conn = self._new_connection()
        self._holding.add(conn)  # close() drops it too
        if self._closed:  # closed since the check: close() may have missed it
            conn.close()
        stop = threading.Event()
        renewer: threading.Thread | None = None
        try:
            params: dict[str, Any] = {"keys": [k.hex() for k in keys]}
            ttl = self._ttl if ttl_s is None else ttl_s
            if ttl is not None:
                params["ttl_s"] = ttl
            with self._circuit():
                conn.connect()
                lease_id, present, checksums, granted = check_lease(
                    conn.call("acquire", params), len(keys)
                )
            held = HeldBlocks(keys, present.tolist(), checksums.tolist())

            def renew() -> None:
                while not stop.wait(granted / 3):
                    try:
                        ok = conn.call("renew", {"lease": lease_id, "ttl_s": granted}) is True
                    except (PeerUnavailableError, InvalidArgumentError):
                        ok = False
                    if not ok:
                        held.lapsed = True
                        return

            renewer = threading.Thread(target=renew, name="tpusync-hold", daemon=True)
            renewer.start()
            yield held
        finally:
            stop.set()
            if self._closed:  # closed meanwhile (e.g. at a caller's deadline): no release
                conn.drop()
            if renewer is not None:
                renewer.join(timeout=self._timeout)
                if not self._closed:
                    with contextlib.suppress(PeerUnavailableError, InvalidArgumentError, OSError):
                        conn.call("release", {"lease": lease_id})
            conn.drop()
            self._holding.discard(conn)

    # --- pull -------------------------------------------------------------------------------

    def pull(self, keys: Sequence[bytes], target: HostPool) -> list[bool]:
        """Copies the server's blocks under ``keys`` into ``target``; returns for each key
        whether ``target`` now holds it (keys it already held count as True).

        A key is False when the server lacks it, its block failed verification, the lease
        lapsed (see the module docstring), or the connection carrying it broke before the block
        was complete. Raises InvalidArgumentError (another block layout),
        :class:`~tpusync.errors.TierFullError` (too few free slots in ``target``; nothing is
        moved), AuthenticationError, or PeerUnavailableError when no lease could be taken.
        """
        return self.pull_result(keys, target).loaded

    def pull_result(self, keys: Sequence[bytes], target: HostPool) -> PullResult:
        """:meth:`pull`, with the counts and the first failure (see :class:`PullResult`)."""
        keys = check_keys(keys)
        self._check_pool(target, "target")
        total = PullResult(loaded=[])
        loaded: dict[bytes, bool] = {}
        with self._lock, self._circuit() as outcome:
            self._check_open()
            unique = list(dict.fromkeys(keys))
            cap = self._limit(len(unique), "pull")
            for i in range(0, len(unique), MAX_KEYS_PER_REQUEST):
                part = self._pull_batch(unique[i : i + MAX_KEYS_PER_REQUEST], target, loaded, cap)
                total.corrupt += part.corrupt
                total.bytes_received += part.bytes_received
                total.local_blocks += part.local_blocks
                total.released = total.released and part.released
                total.error = total.error or part.error
                if _peer_failed(part.error):
                    outcome.error = part.error
                    break  # the peer stalled or went: the other batches would wait it out too
        total.loaded = [loaded.get(k, False) for k in keys]
        return total

    def _limit(self, count: int, kind: str) -> Deadline:
        """The deadline nothing moves of a pull or push of ``count`` blocks, from now."""
        option = f"max_{kind}_s"
        limit = limit_for(getattr(self, option), count * self.payload_bytes)
        return Deadline.within(limit, option=option)

    def _pull_batch(
        self, keys: list[bytes], target: HostPool, loaded: dict[bytes, bool], cap: Deadline
    ) -> PullResult:
        reservation = target.reserve(keys)  # TierFullError: nothing taken
        reserved = set(reservation.keys)
        others = [k for k in keys if k not in reserved]
        if others:
            loaded.update(zip(others, target.contains(others), strict=True))
        if not reservation.keys:
            return PullResult(loaded=[])

        def land_locally(
            reader: PoolFileReader, indices: np.ndarray, slots: np.ndarray, sums: np.ndarray
        ) -> np.ndarray | None:
            with slot_addresses(target, reservation.slots[indices]) as addresses:
                return reader.land(target.layout, slots, sums, whole_slots(addresses))

        try:
            good, expected, result = self._receive_leased(
                reservation.keys,
                lambda indices, sums: PoolStripe(
                    reservation.keys, indices, sums, target, reservation.slots
                ),
                cap,
                land_locally=land_locally,
            )
        except BaseException:
            target.abort(reservation)  # no stripe writes into a slot any more
            raise
        if (~good).any():
            target.abort(reservation.subset(~good))
        if good.any():
            target.commit(reservation.subset(good), expected[good])
        loaded.update(zip(reservation.keys, good.tolist(), strict=True))
        return result

    def pull_scattered(
        self,
        keys: Sequence[bytes],
        layout: PoolLayout,
        scatter: Scatter,
        *,
        checksums: np.ndarray | None = None,
    ) -> list[bool]:
        """Receives the server's blocks under ``keys`` (distinct) straight into the places
        ``scatter`` gives each (see :class:`~tpusync.tiers.Scatter`), with
        no pool and no copy after; returns for each key whether its bytes arrived verified.

        ``layout`` is the server's block layout (its fingerprint and piece table check each
        block). ``checksums`` (optional, one per key) are what the blocks must be: one the
        server recorded otherwise is not fetched (e.g. a manifest's checksums, so that nothing
        but what it names is taken). A key is False as in :meth:`pull` or for that reason; its
        places may then hold anything. Raises
        InvalidArgumentError (repeated keys, a scatter that does not fit, another layout than
        the server's), AuthenticationError, or PeerUnavailableError when no lease could be
        taken."""
        return self.pull_scattered_counted(keys, layout, scatter, checksums=checksums)[0]

    def pull_scattered_counted(
        self,
        keys: Sequence[bytes],
        layout: PoolLayout,
        scatter: Scatter,
        *,
        checksums: np.ndarray | None = None,
    ) -> tuple[list[bool], int]:
        """:meth:`pull_scattered`, and how many blocks arrived but failed verification (for
        a tier's ``checksum_failures``)."""
        keys = check_keys(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("keys: each key once (a block lands in one place)")
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout, got {type(layout).__name__}"
            )
        if self.fingerprint and layout.fingerprint != self.fingerprint:
            raise InvalidArgumentError(
                "layout: not the block layout the server serves (its fingerprint differs)"
            )
        scatter = scatter.checked(len(keys), layout.payload_bytes)
        if not keys:
            return [], 0
        required = None
        if checksums is not None:
            required = np.asarray(checksums)
            if required.shape != (len(keys),) or required.dtype.kind not in "ui":
                raise InvalidArgumentError(
                    f"checksums: expected one unsigned 64-bit checksum per key ({len(keys)}), "
                    f"got shape {required.shape} of {required.dtype}"
                )
            required = required.astype(np.uint64)
        loaded: list[bool] = []
        corrupt = 0
        with self._lock, self._circuit() as outcome:
            self._check_open()
            cap = self._limit(len(keys), "pull")
            for i in range(0, len(keys), MAX_KEYS_PER_REQUEST):
                if outcome.error is not None:  # the peer stalled or went: the rest are misses
                    loaded.extend([False] * min(MAX_KEYS_PER_REQUEST, len(keys) - i))
                    continue
                batch = keys[i : i + MAX_KEYS_PER_REQUEST]
                base = np.arange(i, i + len(batch))

                def stripe(indices: np.ndarray, sums: np.ndarray, batch=batch, base=base) -> Any:
                    return ScatterStripe(batch, indices, sums, layout, scatter, base[indices])

                def land_locally(
                    reader: PoolFileReader,
                    indices: np.ndarray,
                    slots: np.ndarray,
                    sums: np.ndarray,
                    base: np.ndarray = base,
                ) -> np.ndarray | None:
                    return reader.land(layout, slots, sums, scatter.select(base[indices]))

                part = None if required is None else required[i : i + len(batch)]
                good, _, result = self._receive_leased(batch, stripe, cap, part, land_locally)
                loaded.extend(good.tolist())
                corrupt += result.corrupt
                if _peer_failed(result.error):
                    outcome.error = result.error
        return loaded, corrupt

    def _receive_leased(
        self,
        keys: list[bytes],
        make_stripe: Callable[[np.ndarray, np.ndarray], _Stripe],
        cap: Deadline,
        required: np.ndarray | None = None,
        land_locally: _LocalLanding | None = None,
    ) -> tuple[np.ndarray, np.ndarray, PullResult]:
        """Leases ``keys`` and receives them striped over the connections (``make_stripe``
        makes each connection's share from its key indices and their recorded checksums; a key
        recorded with another checksum than ``required`` is not fetched) before the lease's
        deadline and ``cap`` (the pull's), or, when the server's
        pool file can be read here, copies them from it (``land_locally(reader, indices, slots,
        sums)``: the verified mask over ``indices``, or None to go over TCP).
        Returns the mask of verified keys (none when the lease lapsed), their recorded
        checksums and the counts. When it raises, no stripe is receiving any more."""
        result = PullResult(loaded=[])
        n = len(keys)
        good = np.zeros(n, dtype=bool)
        jobs: list[Future[Any]] = []
        reader = self._local_reader() if land_locally is not None else None
        try:
            lease_conn = self._conns[0]
            start = time.monotonic()
            params: dict[str, Any] = {"keys": [k.hex() for k in keys]}
            if self._ttl is not None:
                params["ttl_s"] = self._ttl
            if reader is not None:
                params["slots"] = True
            lease = self._request(lease_conn, "acquire", params)
            lease_id, present, expected, ttl = check_lease(lease, n)
            deadline = cap.bounded(start + ttl * DEADLINE_FRACTION)
            if required is not None:
                present = present & (expected == required)
            wanted = np.flatnonzero(present)
            slots = lease_slots(lease, n) if reader is not None else None
            with LeaseKeeper(self._executor, lambda: self._renew(lease_id, ttl, deadline), ttl / 3):
                landed = None
                if reader is not None and slots is not None and len(wanted):
                    assert land_locally is not None
                    landed = land_locally(reader, wanted, slots[wanted], expected[wanted])
                if landed is not None:
                    ok = landed
                    good[wanted[ok]] = True
                    result.corrupt += int((~ok).sum())
                    result.local_blocks = int(ok.sum())
                    if result.corrupt:
                        log.warning(
                            "tpusync: pull from %s's pool file: %d blocks failed verification; "
                            "dropped",
                            self.label,
                            result.corrupt,
                        )
                else:
                    self._receive_stripes(
                        lease_id, wanted, expected, make_stripe, deadline, good, result, jobs
                    )
            released = False  # after a missed deadline the peer stalled: its circuit opens, and
            if not is_deadline_miss(result.error):  # a release would wait out another; it lapses
                try:
                    released = self._request(lease_conn, "release", {"lease": lease_id}) is True
                except (PeerUnavailableError, InvalidArgumentError) as exc:
                    result.error = result.error or exc
            result.released = released
            if not released:
                if good.any():
                    log.warning(
                        "tpusync: pull from %s: the lease lapsed or was not released; "
                        "discarding %d received blocks",
                        self.label,
                        int(good.sum()),
                    )
                good[:] = False
                result.local_blocks = 0
        except BaseException:
            wait(jobs)  # no stripe writes once it is aborted
            raise
        if result.error is not None:
            log.warning("tpusync: pull from %s: %s", self.label, result.error)
        self.local_blocks += result.local_blocks
        return good, expected, result

    def _receive_stripes(
        self,
        lease_id: int,
        wanted: np.ndarray,
        expected: np.ndarray,
        make_stripe: Callable[[np.ndarray, np.ndarray], _Stripe],
        deadline: Deadline,
        good: np.ndarray,
        result: PullResult,
        jobs: list[Future[Any]],
    ) -> None:
        """Receives the ``wanted`` keys over the connections, a stripe each, into ``good`` and
        ``result`` (``jobs``: the stripes received on pool threads, for the caller to wait on
        when this raises)."""
        shares = [wanted[c :: len(self._conns)] for c in range(len(self._conns))]
        # every stripe made before any receives: one that fails to be made stops none
        stripes = [
            (conn, make_stripe(share, expected))
            for conn, share in zip(self._conns, shares, strict=True)
            if len(share)
        ]
        # the last stripe is received on this thread: a pool thread would first have to wake
        # and take the GIL, which cost milliseconds in a busy engine process
        for conn, stripe in stripes[:-1]:
            jobs.append(
                self._executor.submit(receive_stripe, conn, lease_id, stripe, deadline, self._link)
            )
        outcomes = []
        try:
            if stripes:
                conn, stripe = stripes[-1]
                outcomes.append(receive_stripe(conn, lease_id, stripe, deadline, self._link))
        finally:
            wait(jobs)  # every stripe has stopped writing
        for ok, corrupt, nbytes, error in [*(job.result() for job in jobs), *outcomes]:
            good |= ok
            result.corrupt += corrupt
            result.bytes_received += nbytes
            result.error = result.error or error

    def _local_reader(self) -> PoolFileReader | None:
        """The server's pool file, when its hello advertised one this process may read (and
        ``same_host`` is on); followed across reconnections to a restarted server."""
        if not self.same_host:
            return None
        advert = self._conns[0].hello.get("local")
        reader = self.pool_file
        if reader is None or reader.advert != advert:
            if reader is not None:
                reader.close()
            reader = self.pool_file = PoolFileReader(advert, self.fingerprint)
            reader.warm()  # its pages mapped before the first pulls need them
        return reader if reader.usable else None

    def _renew(self, lease_id: int, ttl: float, deadline: Deadline) -> bool:
        """Renews the lease over the control connection and moves the stripes' deadline on
        (the timing rule holds per renewal: the deadline stays DEADLINE_FRACTION of a TTL
        after the renewal was asked), never past the pull's cap; False when it was refused or
        failed."""
        asked = time.monotonic()
        try:
            granted = self._request(self._control, "renew", {"lease": lease_id, "ttl_s": ttl})
        except (PeerUnavailableError, InvalidArgumentError) as exc:
            log.warning("tpusync: pull from %s: renewing the lease failed: %s", self.label, exc)
            return False
        if granted is not True:
            log.warning("tpusync: pull from %s: the server refused to renew the lease", self.label)
            return False
        deadline.move_to(asked + ttl * DEADLINE_FRACTION)
        return True

    # --- push -------------------------------------------------------------------------------

    def push(self, keys: Sequence[bytes], source: HostPool) -> list[bool]:
        """Copies ``source``'s blocks under ``keys`` to the server (a store node); returns for
        each key whether the server holds it now (keys it already held count as True; keys
        ``source`` lacks are False). Payloads go from ``source``'s slots (pinned meanwhile)
        straight to the sockets, striped over the connections; the server verifies each block
        against its checksum before it commits it, and commits nothing of a cut connection.

        A connection that breaks once the server has accepted its part of the push (e.g. the
        server dropped it for a damaged frame), or the push's deadline (``max_push_s``), makes
        that part's keys False (logged), not an error: the connection is re-made on the next
        push.

        Raises InvalidArgumentError (another block layout),
        :class:`RemoteOperationUnsupportedError` (the server does not accept blocks), or
        PeerUnavailableError when no connection could carry the request."""
        keys = check_keys(keys)
        self._check_pool(source, "source")
        if not self.writable:
            raise RemoteOperationUnsupportedError(
                f"push: the block server at {self.label} does not accept blocks; push to a "
                "store node (tpusync serve)"
            )
        stored: dict[bytes, bool] = {}
        errors: list[BaseException] = []
        carried = False  # some connection had its put accepted
        with self._lock, self._circuit() as outcome:
            self._check_open()
            unique = list(dict.fromkeys(keys))
            deadline = self._limit(len(unique), "push")  # one for every batch and stripe
            for i in range(0, len(unique), MAX_KEYS_PER_REQUEST):
                if any(is_deadline_miss(e) for e in errors):
                    break  # a stalled peer: the next batch would reconnect to it (its keys False)
                if deadline.left() <= 0:
                    errors.append(deadline.missed())
                    break
                batch = unique[i : i + MAX_KEYS_PER_REQUEST]
                pinned = source.pin(batch)  # no slot is reused while its bytes are sent
                try:
                    wanted = np.flatnonzero(pinned.present)
                    stripes = [wanted[c :: len(self._conns)] for c in range(len(self._conns))]
                    jobs = [
                        self._executor.submit(
                            push_stripe,
                            conn,
                            self._ensure,
                            [batch[j] for j in stripe.tolist()],
                            pinned.slots[stripe],
                            pinned.checksums[stripe],
                            source,
                            deadline,
                        )
                        for conn, stripe in zip(self._conns, stripes, strict=True)
                        if len(stripe)
                    ]
                    for job in jobs:
                        part, error, accepted = job.result()
                        stored.update(part)
                        carried |= accepted
                        if error is not None:
                            errors.append(error)
                finally:
                    source.unpin(pinned)
            stalled = [e for e in errors if is_deadline_miss(e)]
            if stalled or (errors and not carried and not any(stored.values())):
                outcome.error = (stalled or errors)[0]
        if errors and not carried and not any(stored.values()):
            raise PeerUnavailableError(f"push to {self.label} failed: {errors[0]}") from errors[0]
        for error in errors:
            log.warning("tpusync: push to %s: %s", self.label, error)
        return [stored.get(k, False) for k in keys]

    def _check_pool(self, pool: Any, argument: str) -> None:
        if not isinstance(pool, HostPool):
            raise InvalidArgumentError(
                f"{argument}: expected a HostPool, got {type(pool).__name__}"
            )
        if pool.layout.fingerprint != self.fingerprint:
            raise InvalidArgumentError(
                f"{argument}: the HostPool holds another block layout (model "
                f"{pool.layout.model_id!r}, {pool.layout.payload_bytes} B blocks) than the "
                f"server at {self.label} ({self.payload_bytes} B blocks)"
            )

    def close(self) -> None:
        """Closes every connection (a pull in progress fails)."""
        self._closed = True
        for conn in [*self._conns, self._control, *list(self._holding)]:
            conn.close()
        self._executor.shutdown(wait=False)
        if self.pool_file is not None:
            self.pool_file.close()  # after a copy from it in progress

    def __enter__(self) -> BlockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Outcome:
    """What an operation under a circuit ended with (None: it worked)."""

    error: BaseException | None = None


def _peer_failed(error: BaseException | None) -> bool:
    """Whether ``error`` says the peer failed (cannot be reached, stalled, broke the stream),
    as opposed to refusing an argument or a secret."""
    if error is None or isinstance(error, AuthenticationError | InvalidArgumentError):
        return False
    return isinstance(error, OSError | EOFError | StreamError | _ProtocolError | FrameError)


def call(client: BlockClient, method: str, params: dict[str, Any]) -> Any:
    """One request on the client's first connection, for the store node's calls beside the
    block client's own (``delete``, ``keys``)."""
    return client._call(method, params)
