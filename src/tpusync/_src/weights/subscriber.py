"""The sampler's side of weight sync: :class:`Subscriber` pulls a published version into its
own layout (any mesh, any sharding), verifies every byte that lands, and switches to it at
once on :meth:`Subscriber.commit`.

A pull reads only the chunks its own shards need, through its data-plane client: from the
publisher's /dev/shm pool file when it runs on the same host (read-only, the same user and
boot: the client's same-host reads), else over the authenticated data plane. The reshard plan
(:mod:`tpusync._src.weights.plan`) cuts each chunk into its runs in the target shards; then each
chunk's checksum is computed over the bytes where they landed and compared with the manifest's,
so nothing is trusted between the trainer's arrays and the sampler's. A chunk that fails is
fetched again (the same way); failing twice fails the pull.

Shadow mode (the default): the pull fills new buffers; the committed version is untouched until
:meth:`commit`, which only swaps references, and a failed pull leaves it as it was. In-place mode
(``in_place=True``, when memory is short) writes into the committed arrays' own buffers: the
caller must not run steps on them during the pull, and a failed pull leaves them torn (a mix of
versions) until a later pull succeeds.

On CPU the shard buffers are this process's memory, handed to JAX without a copy (device memory
is host memory there); elsewhere each shard is staged in host memory and placed with
``jax.device_put`` (the pure-JAX path).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane import BlockClient, Scatter
from tpusync._src.cluster.dataplane.deadlines import MAX_LIMIT_S
from tpusync._src.cluster.registry import Registry
from tpusync._src.engines import native
from tpusync._src.tiers.dram import HostPool
from tpusync._src.weights._stream import Rows, piece_rows, scatter_runs, split_at_chunks
from tpusync._src.weights.head import Head, read_head, read_manifest
from tpusync._src.weights.manifest import (
    Manifest,
    announcement_key,
    check_name,
    check_version,
    chunk_key,
    chunk_layout,
    manifest_key,
    publisher_node_id,
    structure_digest,
    tree_paths,
)
from tpusync._src.weights.multi import SamplerGroup, controller
from tpusync._src.weights.options import (
    TlsOptions,
    WeightsClientOptions,
    check_registry,
    options_or_default,
)
from tpusync._src.weights.plan import leaf_plan, shard_boxes
from tpusync._src.weights.relayed import Waits, relay_addresses, take_all
from tpusync._src.weights.structure import PublishedStructure, structure_of
from tpusync._src.weights.transforms import FP8, Landing, check_scales, converts, fp8_scales
from tpusync.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    PeerUnavailableError,
    ShapeMismatchError,
    StructureChangedError,
    TpuSyncError,
    VersionUnavailableError,
    WeightSyncError,
)

__all__ = ["PullReport", "Subscriber", "published_structure"]

log = logging.getLogger("tpusync.weights")

_PAGE = 4096


@dataclass
class PullReport:
    """What :meth:`Subscriber.pull` did: the bytes that landed in this process's shards, the
    chunks read from /dev/shm and over the network, the chunks fetched again after a failed
    check, and the seconds it took."""

    version: int
    nbytes: int
    chunks_local: int
    chunks_network: int
    chunks_retried: int
    seconds: float
    leaves_kept: int = 0  # of a partial version: leaves copied from the committed version
    chunks_relayed: int = 0  # taken from relays (not counted in chunks_network)


@dataclass(frozen=True)
class _Target:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any
    boxes: tuple[Any, ...]
    devices: tuple[Any, ...]  # this process's devices of the sharding
    box_of: tuple[int, ...]  # per device

    def shard_shape(self, box: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.boxes[box])


def _target(path: str, leaf: Any) -> _Target:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise InvalidArgumentError(
            f"target{path}: expected a jax.Array or a jax.ShapeDtypeStruct with a sharding, "
            f"got {type(leaf).__name__}"
        )
    shape = tuple(int(d) for d in leaf.shape)
    boxes, of_device = shard_boxes(sharding, shape)
    devices = tuple(d for d in sharding.addressable_devices_indices_map(shape))
    return _Target(
        path,
        shape,
        np.dtype(leaf.dtype),
        sharding,
        boxes,
        devices,
        tuple(of_device[d] for d in devices),
    )


class _Buffers:
    """One page-aligned region per (leaf, device) in one mapping: the shards' memory."""

    def __init__(self, targets: list[_Target]) -> None:
        self.offsets: list[list[int]] = []
        total = 0
        for t in targets:
            per = []
            for box in t.box_of:
                per.append(total)
                nbytes = int(np.prod(t.shard_shape(box))) * t.dtype.itemsize
                total += -(-nbytes // _PAGE) * _PAGE
            self.offsets.append(per)
        self.mapping = _core.Mapping(max(total, _PAGE), populate=True, huge_pages=True)
        self.bytes = np.frombuffer(self.mapping, dtype=np.uint8)
        self.base = int(self.bytes.ctypes.data)
        # per leaf, what its bytes here are (Manifest.leaf_sources) after a pull that
        # succeeded; None while a pull writes them, or after one failed
        self.sources: tuple[Any, ...] | None = None
        self.scales: dict[str, np.ndarray] = {}  # of the fp8 leaves, with the sources

    def view(self, t: _Target, leaf: int, device: int) -> np.ndarray:
        shape = t.shard_shape(t.box_of[device])
        start = self.offsets[leaf][device]
        nbytes = int(np.prod(shape)) * t.dtype.itemsize
        return self.bytes[start : start + nbytes].view(t.dtype).reshape(shape)


@dataclass
class _Pulled:
    version: int
    tree: Any
    buffers: _Buffers | None
    zero_copy: bool  # the arrays are the buffers (CPU): in-place writes reach them
    scales: dict[str, np.ndarray]  # of the leaves taken as fp8, by path


def _sized(pool: HostPool | None, name: str, chunk_bytes: int, slots: int) -> HostPool:
    """``pool`` if it holds chunks of ``chunk_bytes``, else a new one of ``slots`` (the old one
    closed): a staging pool kept across pulls."""
    if pool is not None and pool.layout.payload_bytes == chunk_bytes:
        return pool
    if pool is not None:
        pool.close()
    return HostPool(chunk_layout(name, chunk_bytes), slots)


_LANDED = 1 << 56  # a row's relative address at or past it: in the landing area


class Subscriber:
    """Pulls versions of the weights called ``name`` into the layout of ``target``.

    Args:
      name: the publisher's weights name.
      target: a pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct`` (with a ``sharding``): the
        structure, shapes, dtypes and shardings versions are pulled into.
      secret: the deployment secret (the publisher's).
      address: the publisher's ``host:port``; or ``registry``, where versions are announced
        (give exactly one).
      client: the connections to the publisher, the deadlines and the same-host reads
        (:class:`~tpusync.weights.WeightsClientOptions`; default: 2 connections, 10 s a
        request, 120 s a pull, same-host reads on).
      tls: the data plane's TLS (:class:`~tpusync.weights.TlsOptions` with a client context
        that trusts the publisher's certificate); required off loopback unless it says
        ``insecure``.
      in_place: write into the committed arrays (see the module docstring).
      kv_stores: :class:`tpusync.kv.KVCacheStore` objects whose ``weight_version`` follows each
        commit (KV of other weights is never served again).
      fp8_scales: how a target leaf of an fp8 dtype is scaled: ``"tensor"`` (one scale per
        leaf, the default) or ``"channel"`` (one per channel of its last axis); see
        :attr:`scales`. A target leaf of another float dtype than the published one is
        converted as it lands (float32 and bfloat16 to float32, bfloat16, float8_e4m3fn or
        float8_e5m2; fp8 needs ``Publisher(amax=True)``), bit for bit ``jnp.astype``.
      relays: take chunks from the :class:`~tpusync.weights.Relay` nodes that list a version
        in ``registry`` (a pull waits up to the client options' ``relay_wait_s`` for one), each
        checked against the SHA-256 in the publisher's manifest (``Publisher(relays=True)``);
        a chunk a relay lacks or fails comes from the publisher; a relay's ``host:port`` (the
        one on this host): that relay first (default False).
    """

    def __init__(
        self,
        name: str,
        target: Any,
        *,
        secret: bytes,
        address: str | None = None,
        registry: Registry | None = None,
        client: WeightsClientOptions | None = None,
        tls: TlsOptions | None = None,
        in_place: bool = False,
        kv_stores: Any = (),
        fp8_scales: str = "tensor",
        relays: bool | str = False,
    ) -> None:
        self.name = check_name(name)
        if not isinstance(relays, bool | str) or (isinstance(relays, str) and ":" not in relays):
            raise InvalidArgumentError(
                f"relays: expected True, False or a relay's 'host:port', got {relays!r}"
            )
        if relays and registry is None:
            raise InvalidArgumentError("relays: relays are found in a registry; give registry=")
        self.relays = relays
        self._relay_pick = secrets.randbelow(1 << 30)  # spreads subscribers over relays
        self._relay_staging: HostPool | None = None
        self._hashers: ThreadPoolExecutor | None = None
        self.fp8_scales = check_scales(fp8_scales)
        if (address is None) == (registry is None):
            raise InvalidArgumentError("address, registry: give exactly one of them")
        check_registry(registry)
        self.client_options = options_or_default(WeightsClientOptions, client, "client")
        self.tls = options_or_default(TlsOptions, tls, "tls")
        paths, leaves, self._treedef = tree_paths(target)
        self._targets = [_target(p, x) for p, x in zip(paths, leaves, strict=True)]
        spans = any(not t.sharding.is_fully_addressable for t in self._targets)
        ctl = controller() if spans else None
        # a target over several processes' devices: they pull and commit together
        self._group = None if ctl is None else SamplerGroup(ctl, self.name)
        # structures known to fit the target: its own, and those a check found it can take
        self._fits = {structure_digest([(t.path, t.shape, t.dtype.name) for t in self._targets])}
        self._secret = secret
        self._address, self._registry = address, registry
        self.in_place = bool(in_place)
        self.kv_stores = list(kv_stores)
        for store in self.kv_stores:
            if not hasattr(store, "set_weight_version"):
                raise InvalidArgumentError(
                    "kv_stores: expected tpusync.kv.KVCacheStore objects, got "
                    f"{type(store).__name__}"
                )
        self._clients: dict[str, BlockClient] = {}
        # a wait_for_newer in another thread may connect while close() runs
        self._clients_lock = threading.Lock()
        self._manifest_staging: HostPool | None = None
        self._rows_cache: dict[Any, tuple[Rows, Landing, tuple[int, ...]]] = {}
        self._landing: _core.Mapping | None = None  # converted leaves land here first
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpusync-weights")
        self._converters: ThreadPoolExecutor | None = None  # made at the first conversion
        # a thread made now: commit() hands it the next buffers, never waits for one to start
        self._executor.submit(int)
        self._live: _Pulled | None = None
        self._shadow: _Pulled | None = None
        self._retired: _Pulled | None = None
        self._spare_job: Future[tuple[_Buffers, Any]] | None = None
        self.torn = False
        self.last_commit_seconds = 0.0
        self._closing = threading.Event()  # wakes a wait_for_newer at close()

    # --- what is committed ---------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The committed version (None before the first commit)."""
        return None if self._live is None else self._live.version

    @property
    def params(self) -> Any:
        """The committed version's arrays, in the target's structure."""
        if self.torn:
            raise WeightSyncError(
                "an in-place pull failed: the arrays hold a mix of versions; pull again"
            )
        if self._live is None:
            raise InvalidArgumentError("no version committed yet: pull(version), then commit()")
        return self._live.tree

    @property
    def scales(self) -> dict[str, np.ndarray]:
        """The committed version's fp8 scales, by leaf path (``jax.tree_util.keystr``): float32,
        shape ``()`` per tensor or ``(channels,)`` per channel; a leaf ``q`` stands for
        ``q * scale`` (channels: the last axis). Empty when no leaf is taken as fp8. In place
        (``in_place=True``) the arrays change during a pull and the scales at its commit:
        run no step between the two."""
        if self.torn:
            raise WeightSyncError(
                "an in-place pull failed: the arrays hold a mix of versions; pull again"
            )
        if self._live is None:
            raise InvalidArgumentError("no version committed yet: pull(version), then commit()")
        return dict(self._live.scales)

    def commit(self) -> Any:
        """Switches to the last pulled version and returns its arrays (only references move;
        KV stores given as ``kv_stores`` switch their ``weight_version`` with it)."""
        start = time.perf_counter()
        shadow = self._shadow
        if shadow is None:
            raise InvalidArgumentError("nothing to commit: pull(version) first")
        self._shadow = None
        # the old version is freed at the next pull, not here: unmapping its buffers and
        # dropping its arrays would cost more than the switch itself
        self._retired = self._live
        self._live = shadow
        self.torn = False
        if not self.in_place:  # the next version's buffers, made while this one serves
            self._spare_job = self._executor.submit(self._make_spare)
        for store in self.kv_stores:  # a KV namespace names weights by a string: the one place
            store.set_weight_version(str(shadow.version))
        self.last_commit_seconds = time.perf_counter() - start
        return shadow.tree

    def prepare(self) -> None:
        """Makes the next pull's buffers now (after a commit they are made on a worker thread
        while the committed version serves; this waits for that), so that the pull only copies
        and verifies."""
        if self.in_place and self._live is not None:
            return
        if self._spare_job is None:
            self._spare_job = self._executor.submit(self._make_spare)
        concurrent.futures.wait([self._spare_job])

    def update(self, version: int, *, deadline_s: float | None = None) -> Any:
        """:meth:`pull` then :meth:`commit`."""
        self.pull(version, deadline_s=deadline_s)
        return self.commit()

    # --- finding versions ---------------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest version the publisher keeps (None when it has published none yet, or
        when ``registry`` lists no publisher of this name): one small request to it, bounded
        by the client options' ``timeout_s``.

        In a multi-controller sampler (see :meth:`pull`) every process calls it and gets
        process 0's answer.

        Raises WeightSyncError (the publisher cannot be reached or the registry read)."""
        if self._group is not None:
            limit = self.client_options.deadline_s
            return self._group.newest(lambda: self._head().latest, limit)
        return self._head().latest

    def wait_for_newer(self, after: int | None = None, *, timeout_s: float) -> int | None:
        """Waits until the publisher keeps a version above ``after`` (default: the committed
        version; before the first commit, any version) and returns the newest, or None when
        ``timeout_s`` passes first. Asks the publisher every ``poll_s`` of the client options;
        a publisher that cannot be reached (restarting) is asked again until the timeout.

        A structure not seen before is checked against the target by reading that version's
        manifest (bounded by the client options' ``deadline_s``, past ``timeout_s``); one
        Subscriber is used from one thread (a wait and a pull share its connection), but
        :meth:`close` from another ends a wait.

        Raises StructureChangedError when that version's structure does not fit the target
        (its ``structure`` builds a new target), VersionUnavailableError when it was dropped
        before its manifest was read, WeightSyncError when the publisher could not be reached
        at the last attempt before the timeout, or when :meth:`close` is called meanwhile.
        In a multi-controller sampler (see :meth:`pull`) every process calls it and gets
        process 0's answer."""
        if after is None:
            after = -1 if self.version is None else self.version
        elif type(after) is not int:
            raise InvalidArgumentError(f"after: expected a version (an int), got {after!r}")

        def find() -> list[Any] | None:
            head = self._wait_for_head(after, timeout_s)
            return None if head is None else [head.latest, head.digest_of(head.latest)]

        if self._group is None:
            found = find()
        else:
            found = self._group.newest(find, timeout_s + self.client_options.deadline_s)
        if found is None:
            return None
        newest, digest = found
        self._check_structure(newest, digest)
        return newest

    def _wait_for_head(
        self, after: int, timeout_s: float, argument: str = "timeout_s"
    ) -> Head | None:
        """The publisher's head once it keeps a version above ``after``; None at the
        timeout ``timeout_s`` (given as ``argument``; see :meth:`wait_for_newer`)."""
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not timeout_s >= 0
        ):
            raise InvalidArgumentError(f"{argument}: expected seconds >= 0, got {timeout_s!r}")
        deadline = time.monotonic() + float(timeout_s)
        while True:
            failure: WeightSyncError | None = None
            try:
                head = self._head()
            except WeightSyncError as error:
                failure, head = error, Head()
            newest = head.latest
            if newest is not None and newest > after:
                return head
            left = deadline - time.monotonic()
            if left <= 0:
                if failure is not None:
                    raise failure
                return None
            if self._closing.wait(min(self.client_options.poll_s, left)):
                raise WeightSyncError("this Subscriber was closed while waiting for a version")

    def _check_structure(self, version: int, digest: str | None) -> None:
        """StructureChangedError unless ``version`` (its structure's ``digest``) fits the
        target: the same structure, or one a pull takes (other float dtypes it converts),
        found by reading its manifest once per structure."""
        if digest in self._fits:
            return
        limit = self.client_options.deadline_s
        with self._manifest_of(version, limit, "reading its structure") as (_, _, manifest):
            try:
                self._check_targets(manifest)
            except (InvalidArgumentError, ShapeMismatchError, DtypeMismatchError) as error:
                structure = structure_of(manifest)
                raise StructureChangedError(
                    f"version {version} of {self.name!r} has another structure than this "
                    f"subscriber's target ({error}): build a new target from the error's "
                    "structure (structure.target(mesh)) and subscribe with it",
                    version=version,
                    structure=structure,
                ) from None
        if digest is not None:
            self._fits.add(digest)

    def _head(self) -> Head:
        """The publisher's head (an empty one when the registry lists no publisher)."""
        address = self._publisher_address()
        if address is None:
            return Head()
        client = self._connect(address, "its versions")
        try:
            return read_head(client)
        except (PeerUnavailableError, OSError) as error:
            self._drop_client(client)
            raise WeightSyncError(
                f"the publisher at {client.label} cannot be reached, or is not a weights "
                f"publisher ({error})"
            ) from error
        except InvalidArgumentError as error:  # closed by close() or a pull's watchdog meanwhile
            raise WeightSyncError(f"asking {client.label} for its versions: {error}") from error

    def _publisher_address(self) -> str | None:
        """The publisher's address: given, or its node in the registry (None: not listed)."""
        if self._address is not None:
            return self._address
        assert self._registry is not None
        try:
            nodes = self._registry.nodes()
        except TpuSyncError as error:
            raise WeightSyncError(f"the registry cannot be read ({error})") from error
        node_id = publisher_node_id(self.name)
        for node in nodes:
            if node.node_id == node_id and node.addresses:
                return node.addresses[0]
        return None

    # --- pull -----------------------------------------------------------------------------------

    def pull(self, version: int, *, deadline_s: float | None = None) -> PullReport:
        """Pulls ``version`` into shadow buffers (or in place); :meth:`commit` switches to it.

        A target that spans the processes of a ``jax.distributed`` job (a multi-controller
        sampler) makes the pull a collective: every process calls it with the same version,
        pulls its own devices' shards, and it returns once every process's part landed
        verified; else it raises WeightSyncError in every process and none commits. Then
        every process calls :meth:`commit` at the same step.

        Raises InvalidArgumentError (a version not above the committed one),
        VersionUnavailableError (not published or no longer kept), ShapeMismatchError /
        DtypeMismatchError / InvalidArgumentError (the target does not match the version's
        tree; before any chunk moves), AuthenticationError (a wrong secret) or
        WeightSyncError (what failed: a chunk failing its checksum twice, the publisher gone,
        the deadline). The committed version is untouched by a failure (but see in-place)."""
        if self._group is None:
            return self._pull(version, deadline_s)
        limit = self.client_options.deadline_s if deadline_s is None else float(deadline_s)
        try:
            report = self._pull(version, deadline_s)
        except BaseException as error:  # whatever it was: the others wait for it otherwise
            with contextlib.suppress(WeightSyncError):
                self._group.agree(version, f"{type(error).__name__}: {error}", limit)
            raise
        try:
            self._group.agree(version, None, limit)
        except WeightSyncError:
            shadow, self._shadow = self._shadow, None
            live = self._live
            if shadow is not None and live is not None and shadow.buffers is live.buffers:
                self.torn = True  # in place: this process's shards hold the version
                shadow.buffers.sources = None
            raise
        return report

    def _pull(self, version: int, deadline_s: float | None) -> PullReport:
        check_version(version)
        current = self.version
        if current is not None and version <= current:
            raise InvalidArgumentError(
                f"version: {version} is not above the committed version {current}"
            )
        self._retired = None
        start = time.perf_counter()
        limit = self.client_options.deadline_s if deadline_s is None else float(deadline_s)
        deadline = time.monotonic() + limit
        with self._manifest_of(
            version, limit, "the pull", "; the committed version is untouched", self._fail_in_place
        ) as (client, held, manifest):
            self._check_targets(manifest)
            report = self._pull_chunks(client, manifest, deadline, start)
            if held.lapsed:
                raise WeightSyncError(
                    f"version {version}: the hold on it lapsed during the pull; the "
                    "publisher may have dropped it"
                )
        return report

    def structure(self, version: int, *, deadline_s: float | None = None) -> PublishedStructure:
        """What ``version`` looks like (each leaf's path, shape, dtype and the publisher's
        sharding, and the tree they sit in), read from its manifest without pulling a chunk:
        :meth:`PublishedStructure.target` builds a target on this process's mesh from it.
        ``deadline_s`` bounds it as it bounds a pull (default: the client options').

        Raises VersionUnavailableError (not published or no longer kept) or WeightSyncError
        (the publisher gone, a malformed manifest, the deadline)."""
        check_version(version)
        limit = self.client_options.deadline_s if deadline_s is None else float(deadline_s)
        with self._manifest_of(version, limit, "reading its structure") as (_, _, manifest):
            return structure_of(manifest)

    @contextlib.contextmanager
    def _manifest_of(
        self,
        version: int,
        limit: float,
        doing: str,
        untouched: str = "",
        on_failure: Callable[[], None] = lambda: None,
    ) -> Iterator[tuple[BlockClient, Any, Manifest]]:
        """Holds ``version`` at its publisher and yields ``(client, hold, manifest)``. At the
        deadline (``limit`` s) the client is closed: its sockets shut down, whatever the caller
        waits on fails at once. A missed deadline and a publisher gone become WeightSyncError
        naming what was ``doing``; ``on_failure`` runs first on those and on any other
        WeightSyncError."""
        announce = announcement_key(self.name, version)
        client = self._client(version, announce)
        expired = threading.Event()
        # at the deadline every client closes: the publisher's and its trainer parts'
        watchdog = threading.Timer(limit, lambda: (expired.set(), self._close_clients(False)))
        watchdog.daemon = True
        watchdog.start()
        try:
            with client.hold([announce], ttl_s=max(1.0, min(limit, 60.0))) as held:
                if not held.present[0]:
                    raise VersionUnavailableError(
                        f"version: {version} of {self.name!r} is not published by "
                        f"{client.label} (or no longer kept)"
                    )
                yield client, held, self._read_manifest(client, version, announce)
        except (TpuSyncError, OSError) as error:
            if expired.is_set():
                on_failure()
                raise WeightSyncError(
                    f"version {version}: {doing} missed its deadline ({limit:g} s) waiting "
                    f"for {client.label}{untouched}"
                ) from error
            if isinstance(error, PeerUnavailableError | OSError):
                self._drop_client(client)
                on_failure()
                raise WeightSyncError(
                    f"version {version}: the publisher at {client.label} went away ({error})"
                ) from error
            if isinstance(error, WeightSyncError):
                on_failure()
            raise
        finally:
            watchdog.cancel()
            if expired.is_set():
                self._close_clients(False)  # closed: the next pull connects afresh

    def _fail_in_place(self) -> None:
        if self.in_place and self._live is not None and self._shadow is None:
            self.torn = True

    def _client(self, version: int, announce: bytes) -> BlockClient:
        """A client of the publisher of ``version``: at ``address``, or found in the registry
        by the version's announcement key ``announce``."""
        if self._address is not None:
            address = self._address
        else:
            assert self._registry is not None
            try:
                holders = self._registry.holders([announce])[0]
                nodes = {n.node_id: n for n in self._registry.nodes()}
            except TpuSyncError as error:
                raise WeightSyncError(f"the registry cannot be read ({error})") from error
            # the publisher's own node only: a relay (or anyone else holding the secret) that
            # lists the key is not taken for it, so manifests come from the publisher alone
            ours = publisher_node_id(self.name)
            found = [nodes[h.node_id] for h in holders if h.node_id == ours and ours in nodes]
            found = [n.addresses[0] for n in found if n.addresses]
            # else the publisher's own node: its head may list a version a moment before the
            # registry does, and its pool says whether it has it
            address = found[0] if found else self._publisher_address()
            if address is None:
                raise VersionUnavailableError(
                    f"version: {version} of {self.name!r} is not announced in the registry "
                    "(not published yet, or no longer kept)"
                )
        return self._connect(address, f"version {version}")

    def _connect(self, address: str, what: str) -> BlockClient:
        """This subscriber's client of the publisher at ``address`` (made on first use);
        WeightSyncError starting with ``what`` when it cannot be reached. Connects outside the
        lock, so that close() does not wait for a handshake."""
        with self._clients_lock:
            if self._closing.is_set():
                raise WeightSyncError(f"{what}: this Subscriber is closed")
            client = self._clients.get(address)
        if client is not None:
            return client
        try:  # an AuthenticationError (a wrong secret) goes to the caller as it is
            options = self.client_options
            client = BlockClient(
                address,
                secret=self._secret,
                connections=options.connections,
                timeout_s=options.timeout_s,
                tls=self.tls.context,
                insecure=self.tls.insecure,
                same_host=options.same_host,
                # a pull's absolute limit is this subscriber's deadline_s (its watchdog
                # closes the client then), not the client's default scaled from the bytes
                max_pull_s=MAX_LIMIT_S,
            )
        except PeerUnavailableError as error:
            raise WeightSyncError(f"{what}: {address} cannot be reached ({error})") from error
        with self._clients_lock:
            closing = self._closing.is_set()
            known = None if closing else self._clients.setdefault(address, client)
        if known is not client:  # closed meanwhile, or another thread connected first
            client.close()
            if known is None:
                raise WeightSyncError(f"{what}: this Subscriber is closed")
        return known

    def _close_clients(self, closing: bool) -> None:
        """Closes every client (and, ``closing``, this subscriber to new ones)."""
        with self._clients_lock:
            if closing:
                self._closing.set()
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()

    def _drop_client(self, client: BlockClient) -> None:
        with self._clients_lock:
            for address, known in list(self._clients.items()):
                if known is client:
                    del self._clients[address]
        client.close()

    def _manifest_pool(self, chunk_bytes: int) -> HostPool:
        """The one-slot pool manifest parts land in (made again for another chunk size)."""
        self._manifest_staging = _sized(self._manifest_staging, self.name, chunk_bytes, 1)
        return self._manifest_staging

    def _read_manifest(self, client: BlockClient, version: int, announce: bytes) -> Manifest:
        """The manifest of ``version``, whose first part is its announcement ``announce``."""
        data = read_manifest(client, version)
        if data is not None:
            return Manifest.from_bytes(data, name=self.name, version=version)
        chunk_bytes = client.payload_bytes  # a manifest too long for one answer: its blocks
        staging = self._manifest_pool(chunk_bytes)
        parts = [self._pull_one(client, staging, announce)]
        length = int.from_bytes(parts[0][:8], "little")
        n_parts = -(-(length + 8) // chunk_bytes)
        if n_parts > 1 << 16:
            raise WeightSyncError(f"version {version}: a manifest of {length} bytes is too long")
        for p in range(1, n_parts):
            parts.append(self._pull_one(client, staging, manifest_key(self.name, version, p)))
        return Manifest.from_bytes(b"".join(parts), name=self.name, version=version)

    def _pull_one(self, client: BlockClient, staging: HostPool, key: bytes) -> bytes:
        staging.delete([key])
        if not client.pull([key], staging)[0]:
            raise WeightSyncError(f"a manifest part could not be pulled from {client.label}")
        slot = staging.slot_of(key)
        assert slot is not None
        with staging.slot_memory(slot) as memory:
            data = bytes(memory[: staging.layout.payload_bytes])
        staging.delete([key])
        return data

    def _check_targets(self, manifest: Manifest) -> None:
        if len(manifest.leaves) != len(self._targets):
            raise InvalidArgumentError(
                f"target: {len(self._targets)} leaves, but version {manifest.version} has "
                f"{len(manifest.leaves)}; the target must have the published tree's structure"
            )
        for entry, t in zip(manifest.leaves, self._targets, strict=True):
            if entry.path != t.path:
                raise InvalidArgumentError(
                    f"target{t.path}: the published tree has {entry.path} here; the target "
                    "must have the published tree's structure"
                )
            if entry.shape != t.shape:
                raise ShapeMismatchError(
                    f"target{t.path}: shape {t.shape}, published {entry.shape}"
                )
            converts(t.path, entry, t.dtype, manifest.version)  # DtypeMismatchError if not

    # --- moving the chunks ----------------------------------------------------------------------

    def _rows(
        self, manifest: Manifest, buffers: _Buffers, kept: frozenset[int]
    ) -> tuple[Rows, Landing, tuple[int, ...]]:
        """Every run the target shards need (first replica of each box; none for the leaves
        ``kept`` from the committed version), sorted by offset in the run of all the streams
        the version reads (:attr:`Manifest.streams`) and cut at chunk ends, addresses relative
        to the buffers' base (or, at ``_LANDED`` and past it, to the landing area's); the
        landing area's plan and the leaves it converts. Cached per pair of layouts."""
        key = (manifest.layout_key, kept)
        cached = self._rows_cache.get(key)
        if cached is not None:
            return cached
        converted = tuple(
            i
            for i, (e, t) in enumerate(zip(manifest.leaves, self._targets, strict=True))
            if i not in kept and converts(t.path, e, t.dtype, manifest.version)
        )
        firsts: list[dict[int, int]] = []  # per leaf: box -> its first device
        for t in self._targets:
            first_device: dict[int, int] = {}
            for d, box in enumerate(t.box_of):
                first_device.setdefault(box, d)
            firsts.append(first_device)
        landing = Landing.plan(
            manifest.leaves,
            {
                (i, d): int(np.prod(self._targets[i].shard_shape(box)))
                * manifest.leaves[i].np_dtype.itemsize
                for i in converted
                for box, d in firsts[i].items()
            },
            {i for i in converted if self._targets[i].dtype.name in FP8},
        )
        parts: list[Rows] = []
        for i, (entry, t) in enumerate(zip(manifest.leaves, self._targets, strict=True)):
            if not int(np.prod(t.shape)) or i in kept:
                continue
            itemsize = entry.np_dtype.itemsize  # the published dtype's: what travels
            plan = leaf_plan(t.shape, itemsize, entry.boxes, t.boxes)
            for box, d in firsts[i].items():
                if (i, d) in landing.shards:
                    at = _LANDED + landing.shards[(i, d)]
                else:
                    at = buffers.offsets[i][d]
                for piece in plan.pieces[box]:
                    start = manifest.stream_start(manifest.stream_of(entry, piece.source))
                    parts.append(piece_rows(piece, start + entry.offsets[piece.source], at))
            if i in landing.maxima:
                assert entry.amax is not None
                parts.append(
                    Rows(
                        [manifest.stream_start(("v", manifest.origin_of(entry))) + entry.amax],
                        [_LANDED + landing.maxima[i]],
                        [4 * entry.channels],
                    )
                )
        rows = split_at_chunks(Rows.join(parts).sorted(), manifest.chunk_bytes)
        cached = (rows, landing, converted)
        self._rows_cache = {key: cached}  # one layout pair at a time
        return cached

    def _landing_area(self, nbytes: int) -> np.ndarray:
        """The landing area's bytes (made, or made larger, for ``nbytes``)."""
        if self._landing is None or self._landing.size < nbytes:
            self._landing = _core.Mapping(max(nbytes, _PAGE), populate=True, huge_pages=True)
        return np.frombuffer(self._landing, dtype=np.uint8)

    def _convert(
        self,
        manifest: Manifest,
        buffers: _Buffers,
        landing: Landing,
        converted: tuple[int, ...],
        landed: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """Converts each converted leaf's landed (verified) first replicas into its target
        shards; returns the fp8 leaves' scales by path."""
        scales: dict[str, np.ndarray] = {}
        jobs = []
        for i in converted:
            entry, t = manifest.leaves[i], self._targets[i]
            factor = np.float32(1).reshape(())  # no scale: a float-to-float conversion
            if i in landing.maxima:
                at = landing.maxima[i]
                amax = landed[at : at + 4 * entry.channels].view(np.float32)
                scale, factor = fp8_scales(t.path, amax, t.dtype, self.fp8_scales)
                scales[t.path] = scale
            for d in sorted({d for (leaf, d) in landing.shards if leaf == i}):
                shape = t.shard_shape(t.box_of[d])
                at = landing.shards[(i, d)]
                nbytes = int(np.prod(shape)) * entry.np_dtype.itemsize
                source = landed[at : at + nbytes].view(entry.np_dtype).reshape(shape)
                if factor.ndim and len(t.shape) >= 2:  # one per channel: this box's
                    a, b = t.boxes[t.box_of[d]][-1]
                    factors = factor[a:b]
                else:
                    factors = factor.reshape(-1)
                target = buffers.view(t, i, d)
                if not source.ndim:  # a scalar: one row of one
                    source, target = source.reshape(1), target.reshape(1)
                jobs.append((source, target, np.ascontiguousarray(factors)))
        # cut along the first axis (C order: each part contiguous) to share the cores
        parts = max(1, native.copy_threads())
        cut = [
            (s, t, factors)
            for source, target, factors in jobs
            for s, t in zip(
                np.array_split(source, max(1, min(parts, len(source)))),
                np.array_split(target, max(1, min(parts, len(target)))),
                strict=True,
            )
            if s.size
        ]
        if len(cut) > 1:
            if self._converters is None:
                self._converters = ThreadPoolExecutor(parts, thread_name_prefix="tpusync-convert")
            list(self._converters.map(lambda job: _core.convert(*job), cut))
        elif cut:
            _core.convert(*cut[0])
        return scales

    def _pull_chunks(
        self, client: BlockClient, manifest: Manifest, deadline: float, start: float
    ) -> PullReport:
        live = self._live
        made: Any = None  # arrays over the buffers, made before the bytes land (zero-copy)
        if self.in_place and live is not None and live.buffers is not None and live.zero_copy:
            buffers = live.buffers
        else:
            buffers, made = self._take_spare()
        sources = manifest.leaf_sources()
        kept = self._kept_leaves(sources)
        if live is not None and buffers is live.buffers:  # in place: written from here on
            buffers.sources = None
            try:
                return self._pull_into(
                    client, manifest, deadline, start, buffers, made, kept, sources
                )
            except BaseException:
                self.torn, self._shadow = True, None  # the live arrays hold a mix now
                raise
        return self._pull_into(client, manifest, deadline, start, buffers, made, kept, sources)

    def _pull_into(
        self,
        client: BlockClient,
        manifest: Manifest,
        deadline: float,
        start: float,
        buffers: _Buffers,
        made: Any,
        kept: frozenset[int],
        sources: tuple[Any, ...],
    ) -> PullReport:
        """The pull of ``manifest`` into ``buffers`` (see :meth:`_pull_chunks`), whose leaves
        are ``sources`` (:meth:`Manifest.leaf_sources`)."""
        live = self._live
        relative, landing, converted = self._rows(manifest, buffers, kept)
        landed = self._landing_area(landing.nbytes) if converted else None
        base = np.int64(buffers.base)
        if landed is not None:
            at_landing = relative.address >= _LANDED
            base = np.where(at_landing, int(landed.ctypes.data) - _LANDED, buffers.base)
        rows = Rows(relative.offset, relative.address + base, relative.nbytes)
        C = manifest.chunk_bytes
        row_chunk = rows.offset // C
        # the rows are sorted: each chunk's first row starts a run of equal chunk numbers
        chunks = row_chunk[np.flatnonzero(np.diff(row_chunk, prepend=-1))]
        report = PullReport(manifest.version, int(rows.nbytes.sum()), 0, 0, 0, 0.0)
        read_locally = client.local_blocks
        if len(chunks) and self.relays:
            relayed = len(chunks)
            chunks = self._pull_relayed(manifest, rows, chunks, deadline)
            report.chunks_relayed = relayed - len(chunks)
        if len(chunks):
            report.chunks_retried = self._pull_chunk_rows(client, manifest, rows, chunks, deadline)
        # every chunk landed verified once, from the file or over the network (the client
        # counts the verified blocks it read from the file)
        report.chunks_local = client.local_blocks - read_locally
        report.chunks_network = len(chunks) - report.chunks_local
        scales = {}
        if kept:
            assert live is not None
            if live.buffers is not buffers:
                self._copy_leaves(live.buffers, buffers, kept)
            assert live.buffers is not None
            paths = {self._targets[i].path for i in kept}
            scales = {p: s for p, s in live.buffers.scales.items() if p in paths}
            report.leaves_kept = len(kept)
        if landed is not None:
            scales.update(self._convert(manifest, buffers, landing, converted, landed))
        self._replicate(buffers)
        tree, zero_copy = (made, True) if made is not None else self._arrays(buffers)
        buffers.sources, buffers.scales = sources, scales
        self._shadow = _Pulled(manifest.version, tree, buffers, zero_copy, scales)
        report.seconds = time.perf_counter() - start
        return report

    def _pull_relayed(
        self, manifest: Manifest, rows: Rows, chunks: np.ndarray, deadline: float
    ) -> np.ndarray:
        """Takes the chunks of ``chunks`` in the version's own stream from the relays that list
        it (see :mod:`~tpusync._src.weights.relay`), each checked against its SHA-256 in a
        staging slot and then copied to its rows' places; the chunks left for the publisher
        (all of them when the version has no digests or no relay lists it in time)."""
        own = chunks[chunks < manifest.n_chunks]
        if manifest.digests is None or not len(own):
            return chunks
        assert self._registry is not None
        version, C = manifest.version, manifest.chunk_bytes
        options = self.client_options
        # half of what is left at most, so that the publisher has the other half
        deadline = time.monotonic() + (deadline - time.monotonic()) / 2
        wait_until = min(deadline, time.monotonic() + options.relay_wait_s)
        addresses = relay_addresses(self._registry, self.name, version)
        while not addresses and time.monotonic() < wait_until:
            if self._closing.wait(options.poll_s):
                return chunks
            addresses = relay_addresses(self._registry, self.name, version)
        if not addresses:
            return chunks
        pick = self._relay_pick % len(addresses)
        order = addresses[pick:] + addresses[:pick]
        if isinstance(self.relays, str) and self.relays in order:  # this host's relay first
            order.remove(self.relays)
            order.insert(0, self.relays)
        staging = self._relay_pool(C)
        if self._hashers is None:
            self._hashers = ThreadPoolExecutor(
                max_workers=native.copy_threads(), thread_name_prefix="tpusync-weights-digest"
            )
        row_chunk = rows.offset // C

        def landed(keys: list[bytes], numbers: np.ndarray) -> None:
            self._copy_from_staging(staging, keys, numbers, rows, row_chunk, C)
            staging.delete(keys)

        waits = Waits(options.poll_s, options.relay_wait_s, deadline, self._closing)
        todo = own
        for address in order:
            try:
                client = self._connect(address, f"version {version}: a relay")
            except TpuSyncError as error:
                log.warning("tpusync weights: relay %s: %s", address, error)
                continue
            keys = [chunk_key(self.name, version, c) for c in todo.tolist()]
            taken = take_all(
                client, keys, todo, manifest.digests, staging, self._hashers, waits, landed
            )
            if not taken.all():
                self._drop_client(client)  # stalled or failed: connected afresh next time
            todo = todo[~taken]
            if not len(todo):
                break
        left = set(todo.tolist())
        return np.array([c for c in chunks.tolist() if c >= len(manifest.checksums) or c in left],
                        dtype=chunks.dtype)  # fmt: skip

    def _copy_from_staging(
        self,
        staging: HostPool,
        keys: list[bytes],
        numbers: np.ndarray,
        rows: Rows,
        row_chunk: np.ndarray,
        C: int,
    ) -> None:
        """Copies checked chunks ``numbers`` (under ``keys``) from their staging slots to
        their rows' places."""
        slots = np.array([staging.slot_of(k) for k in keys], dtype=np.int64)
        with staging.slot_addresses(slots) as addresses:
            copies = []
            for c, address in zip(numbers.tolist(), addresses.tolist(), strict=True):
                lo, hi = np.searchsorted(row_chunk, [c, c + 1])
                offsets = rows.offset[lo:hi]
                copies.append(
                    np.stack(
                        [address + offsets - c * C, rows.address[lo:hi], rows.nbytes[lo:hi]],
                        axis=1,
                    )
                )
            table = np.concatenate(copies).astype(np.uint64)
            table = table[table[:, 2] > 0]
            if len(table):
                native.engine().copy(table)

    def _relay_pool(self, chunk_bytes: int) -> HostPool:
        """The slots relayed chunks land in to be checked (made again for another size)."""
        slots = max(2, (64 << 20) // chunk_bytes)
        self._relay_staging = _sized(self._relay_staging, self.name, chunk_bytes, slots)
        return self._relay_staging

    def _pull_chunk_rows(
        self,
        client: BlockClient,
        manifest: Manifest,
        rows: Rows,
        chunks: np.ndarray,
        deadline: float,
    ) -> int:
        """Pulls ``chunks`` straight into their rows' places (gaps hashed and dropped), each
        verified against the manifest's checksum as it lands: copied from the publisher's pool
        file when it is on this host (the client's ``same_host``), else received over the data
        plane; fetches the failed ones once more. Returns how many were fetched again.

        At the deadline the watchdog closes the client, which cuts the pull short, from the file
        as over TCP; a retry is not started past it."""
        layout = chunk_layout(self.name, manifest.chunk_bytes)
        todo, retried = chunks, 0
        for attempt in range(2):
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"version {manifest.version}: the pull missed its deadline with "
                    f"{len(todo)} chunks to go"
                )
            first, offsets, targets = scatter_runs(rows, todo, manifest.chunk_bytes)
            sources = manifest.chunk_sources(self.name, todo)
            stream_of = np.array([w for w, _, _ in sources], dtype=np.int64)
            loaded = np.zeros(len(todo), dtype=bool)
            for w in np.unique(stream_of).tolist():  # a stream each: a version, or a process
                mine = stream_of == w
                address = manifest.streams[w][2]
                first, offsets, targets = scatter_runs(rows, todo[mine], manifest.chunk_bytes)
                keys = [key for (v, _, key) in sources if v == w]
                sums = manifest.all_checksums[todo[mine]]
                if address is None:
                    loaded[mine] = client.pull_scattered(
                        keys, layout, Scatter(first, offsets, targets), checksums=sums
                    )
                    continue
                part = self._connect(address, f"version {manifest.version}: a trainer process")
                try:
                    loaded[mine] = part.pull_scattered(
                        keys, layout, Scatter(first, offsets, targets), checksums=sums
                    )
                except (TpuSyncError, OSError) as error:
                    if isinstance(error, PeerUnavailableError | OSError):
                        self._drop_client(part)
                    raise WeightSyncError(
                        f"version {manifest.version}: the trainer process at {address} "
                        f"failed ({error})"
                    ) from error
            todo = todo[~loaded]
            if not len(todo):
                return retried
            if not attempt:
                log.warning(
                    "tpusync weights: version %d: %d chunks arrived damaged or not at all; "
                    "fetching them again",
                    manifest.version,
                    len(todo),
                )
                retried = len(todo)
        kept = (
            "the arrays are torn (in place)"
            if self.in_place
            else "the committed version is untouched"
        )
        raise WeightSyncError(
            f"version {manifest.version}: chunks {todo.tolist()[:8]} could not be pulled "
            f"verified from {client.label} twice (damaged, or the publisher dropped the "
            f"version or stopped serving); {kept}"
        )

    def _kept_leaves(self, sources: tuple[Any, ...]) -> frozenset[int]:
        """The leaves whose bytes the committed version's buffers hold already (a partial
        version's unchanged leaves, on the base they hold): the same stream, the same place,
        verified when they landed. Their bytes are what the last pull that succeeded into
        those buffers wrote (in place: committed or not); none after one failed."""
        live = self._live
        held = None if live is None or live.buffers is None else live.buffers.sources
        if self.torn or held is None or len(held) != len(sources):
            return frozenset()
        return frozenset(i for i, source in enumerate(sources) if held[i] == source)

    def _copy_leaves(
        self, source: _Buffers | None, target: _Buffers, leaves: frozenset[int]
    ) -> None:
        """Copies ``leaves``' shards (every device's) from ``source``'s buffers to ``target``'s."""
        assert source is not None
        rows = []
        for i in sorted(leaves):
            t = self._targets[i]
            for d, box in enumerate(t.box_of):
                nbytes = int(np.prod(t.shard_shape(box))) * t.dtype.itemsize
                if nbytes:
                    rows.append(
                        (
                            source.base + source.offsets[i][d],
                            target.base + target.offsets[i][d],
                            nbytes,
                        )
                    )
        if rows:
            native.engine().copy(np.array(rows, dtype=np.uint64))

    def _replicate(self, buffers: _Buffers) -> None:
        """Copies each box's first replica to its other devices (after it was verified)."""
        rows = []
        for i, t in enumerate(self._targets):
            first: dict[int, int] = {}
            for d, box in enumerate(t.box_of):
                if box in first:
                    nbytes = int(np.prod(t.shard_shape(box))) * t.dtype.itemsize
                    src = buffers.base + buffers.offsets[i][first[box]]
                    rows.append((src, buffers.base + buffers.offsets[i][d], nbytes))
                else:
                    first[box] = d
        rows = [r for r in rows if r[2]]
        if rows:
            native.engine().copy(np.array(rows, dtype=np.uint64))

    def _take_spare(self) -> tuple[_Buffers, Any]:
        """The buffers of the next shadow copy and, where JAX takes them without a copy, the
        arrays over them: made after the last commit on a worker thread (off the pull's path),
        else now."""
        job, self._spare_job = self._spare_job, None
        if job is not None:
            try:
                return job.result()
            except (TpuSyncError, MemoryError, RuntimeError) as error:
                log.warning("tpusync weights: preparing the next buffers failed: %s", error)
        return self._make_spare()

    def _make_spare(self) -> tuple[_Buffers, Any]:
        self._retired = None  # the version before the committed one: its memory is reused
        buffers = _Buffers(self._targets)
        tree, zero_copy = self._arrays(buffers)
        return buffers, (tree if zero_copy else None)

    def _arrays(self, buffers: _Buffers) -> tuple[Any, bool]:
        """The arrays over the buffers, and whether JAX took them without a copy. New array
        objects even in place: JAX caches an array's host value, which a write beneath it would
        leave stale."""
        views = [
            [buffers.view(t, i, d) for d in range(len(t.devices))]
            for i, t in enumerate(self._targets)
        ]
        placed = jax.device_put(views, [list(t.devices) for t in self._targets])  # one batch
        zero_copy = all(
            shard.unsafe_buffer_pointer() == view.ctypes.data
            for per_views, per_shards in zip(views, placed, strict=True)
            for view, shard in zip(per_views, per_shards, strict=True)
            if view.size
        )
        leaves = [
            jax.make_array_from_single_device_arrays(t.shape, t.sharding, shards)
            for t, shards in zip(self._targets, placed, strict=True)
        ]
        for leaf in leaves:
            # JAX makes an array's per-device list on its first use, and not atomically: two
            # threads using a new array at once (a sampler's step loop and its main thread)
            # can see it half made ("list index out of range" in np.asarray). Made here,
            # before any other thread sees the array.
            leaf.addressable_shards  # noqa: B018
        return jax.tree_util.tree_unflatten(self._treedef, leaves), zero_copy

    # --- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connections and the manifest's staging pool (committed arrays stay
        usable)."""
        self._close_clients(True)
        self._spare_job = None
        if self._manifest_staging is not None:
            self._manifest_staging.close()
            self._manifest_staging = None
        self._executor.shutdown(wait=True)
        if self._converters is not None:
            self._converters.shutdown(wait=True)
        if self._hashers is not None:
            self._hashers.shutdown(wait=True)
        if self._relay_staging is not None:
            self._relay_staging.close()
            self._relay_staging = None

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def published_structure(
    name: str,
    version: int | None = None,
    *,
    secret: bytes,
    address: str | None = None,
    registry: Registry | None = None,
    client: WeightsClientOptions | None = None,
    tls: TlsOptions | None = None,
    deadline_s: float | None = None,
    wait_s: float = 0.0,
) -> PublishedStructure:
    """:meth:`Subscriber.structure` for a sampler that has no target yet: what ``version``
    (default: the newest kept, waiting up to ``wait_s`` for a first one) of the weights
    ``name`` looks like, asked of its publisher (``address``) or found through ``registry``;
    ``PublishedStructure.target(mesh)`` then builds the target to subscribe with, and
    ``PublishedStructure.version`` says which version it describes.

    Raises VersionUnavailableError when that version (or, by default, any within ``wait_s``)
    is not published, or WeightSyncError (the publisher cannot be reached, the deadline)."""
    with Subscriber(
        name, {}, secret=secret, address=address, registry=registry, client=client, tls=tls
    ) as probe:
        if version is None:
            head = probe._wait_for_head(-1, wait_s, "wait_s")
            if head is None:
                raise VersionUnavailableError(
                    f"name: no version of {name!r} was published within wait_s={wait_s:g} s"
                )
            version = head.latest
            assert version is not None
        return probe.structure(version, deadline_s=deadline_s)
