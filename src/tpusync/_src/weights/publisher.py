"""The trainer's side of weight sync: :class:`Publisher` stages each version of a pytree of
(sharded) arrays once in a named host pool in /dev/shm, serves it to subscribers over the data
plane, and announces it through a registry.

``publish()`` returns once every byte is staged, checksummed and committed, so the trainer may
overwrite or donate its arrays at once. A version's chunks and manifest are reserved together
before any byte is copied (a version that does not fit is refused then, saying what it needs),
the manifest is written after the chunks, all are committed at once, and the version is
announced last: a version is visible only whole, and a failed publish leaves nothing behind.
The last ``keep`` versions stay; an older one is dropped when no subscriber holds it (a held one
is dropped at a later ``publish``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster.registry import NodeInfo, Registry
from tpusync._src.cluster.registry_link import RegistryLink
from tpusync._src.engines import native
from tpusync._src.tiers.blocks import slot_checksums
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.dram.shm_admin import remove_pool, size_text
from tpusync._src.weights._stream import Rows, split_at_chunks
from tpusync._src.weights.head import Head, WeightsServer
from tpusync._src.weights.manifest import (
    AMAX_DTYPES,
    DIGEST_BYTES,
    MAX_ORIGINS,
    LeafEntry,
    Manifest,
    announcement_key,
    check_name,
    check_version,
    chunk_key,
    chunk_layout,
    manifest_key,
    publisher_node_id,
    sharding_data,
    structure_digest,
    tree_paths,
    tree_skeleton,
)
from tpusync._src.weights.multi import box_owners, controller, instance_number
from tpusync._src.weights.options import (
    TlsOptions,
    WeightsPoolOptions,
    WeightsServerOptions,
    block_server_options,
    check_registry,
    options_or_default,
)
from tpusync._src.weights.plan import shard_boxes
from tpusync.errors import (
    InvalidArgumentError,
    ServerFailedError,
    TierFullError,
    TpuSyncError,
    WeightSyncError,
)

__all__ = ["PublishReport", "Publisher"]

log = logging.getLogger("tpusync.weights")


@dataclass
class PublishReport:
    """What :meth:`Publisher.publish` did: the version, its bytes and chunks, the seconds it
    took to stage, and the versions kept after it."""

    version: int
    nbytes: int
    chunks: int
    seconds: float
    kept: list[int] = field(default_factory=list)


def _check_sequences(changes: Any, skeleton: Any, base: int, path: str = "") -> None:
    """Raises InvalidArgumentError where ``changes`` has a list or tuple of another length than
    the base's (``skeleton``; None: not known): leaves are matched by path, and a list with an
    element left out would move the next ones onto other leaves."""
    if skeleton is None or changes is None:
        return
    if isinstance(changes, list | tuple):
        kind = "l" if isinstance(changes, list) else "t"
        children = skeleton.get(kind) if isinstance(skeleton, dict) else None
        if children is None or len(children) != len(changes):
            raise InvalidArgumentError(
                f"params{path}: a {type(changes).__name__} of {len(changes)}, not the "
                f"{'list' if kind == 'l' else 'tuple'} of version {base} at this place; put None "
                "for each element a partial version does not change"
            )
        for i, (change, child) in enumerate(zip(changes, children, strict=True)):
            _check_sequences(change, child, base, f"{path}[{i}]")
    elif isinstance(changes, dict) and isinstance(skeleton, dict) and "d" in skeleton:
        known = dict(skeleton["d"])
        for key, change in changes.items():
            if key in known:
                _check_sequences(change, known[key], base, f"{path}[{key!r}]")


def _channel_amax(entry: LeafEntry, hosts: list[np.ndarray]) -> np.ndarray:
    """The leaf's absolute maxima per channel (its last axis; one below 2-D), from its
    distinct shards ``hosts`` (C order, one per box): float32, NaN where a NaN is."""
    maxima = np.zeros(entry.channels, dtype=np.float32)
    for box, host in zip(entry.boxes, hosts, strict=True):
        if not host.size:
            continue
        if len(entry.shape) >= 2:
            (a, b) = box[-1]
            _core.channel_amax(host.reshape(-1, b - a), maxima[a:b])
        else:
            _core.channel_amax(host.reshape(-1, 1), maxima)
    return maxima


def _shard_source(data: Any) -> np.ndarray:
    """One shard's bytes in C order on the host: the device buffer itself where it is host
    memory (CPU), else a copy."""
    host = np.asarray(data)
    return host if host.flags.c_contiguous else np.ascontiguousarray(host)


class Publisher:
    """Publishes numbered versions of a pytree of arrays (see the module docstring).

    Args:
      name: the weights' name (letters, digits, ``.``, ``_``, ``-``); the pool is
        ``<shm_dir>/tpusync-weights-<name>.pool``.
      secret: the deployment secret subscribers authenticate with (at least 16 bytes).
      registry: where versions are announced (any :class:`tpusync.cluster.Registry`); None to
        let subscribers connect to :attr:`address` directly.
      pool: the pool of versions: how many are kept, its size, the chunk size, its directory
        (:class:`~tpusync.weights.WeightsPoolOptions`; default: 2 versions kept, sized from
        the first one, 4 MiB chunks, /dev/shm).
      server: where subscribers connect and the leases' lengths
        (:class:`~tpusync.weights.WeightsServerOptions`; default: loopback, a free port).
      tls: the block server's TLS (:class:`~tpusync.weights.TlsOptions` with a server
        context); required off loopback unless it says ``insecure``.
      amax: each version also carries every float32 and bfloat16 leaf's absolute maxima per
        channel (its last axis), from which a subscriber taking the leaf as fp8 makes its
        scales; costs one more read of those leaves per publish (default False).
      relays: each version also carries the SHA-256 of every chunk, so that subscribers may
        take chunks from :class:`~tpusync.weights.Relay` nodes, which they check against it;
        costs one more read of the version per publish, on every core (default False).
    """

    def __init__(
        self,
        name: str,
        *,
        secret: bytes,
        registry: Registry | None = None,
        pool: WeightsPoolOptions | None = None,
        server: WeightsServerOptions | None = None,
        tls: TlsOptions | None = None,
        amax: bool = False,
        relays: bool = False,
    ) -> None:
        self.name = check_name(name)
        for argument, value in (("amax", amax), ("relays", relays)):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{argument}: expected True or False, got {value!r}")
        self.amax, self.relays = amax, relays
        self.pool_options = options_or_default(WeightsPoolOptions, pool, "pool")
        self.server_options = options_or_default(WeightsServerOptions, server, "server")
        self.tls = options_or_default(TlsOptions, tls, "tls")
        check_registry(registry)
        self._keep = self.pool_options.keep
        self._chunk_bytes = self.pool_options.chunk_bytes
        self.layout = chunk_layout(name, self._chunk_bytes)
        # checked now, though the server starts with the pool (at the first publish by default)
        self._block_server_options = block_server_options(secret, self.server_options, self.tls)
        self._registry = registry
        self._lock = threading.Lock()
        # the versions' books, by version (an int); keys are the pool's names of its pieces
        self._versions: dict[int, list[bytes]] = {}  # kept version -> its manifest keys
        self._chunks: dict[int, int] = {}  # kept version -> its chunk count
        self._digests: dict[int, str] = {}  # kept version -> its structure's digest
        self._entries: dict[int, tuple[tuple[LeafEntry, ...], Any]] = {}  # kept: leaves, tree
        # every version whose chunks are in the pool -> their checksums (a partial version's
        # manifest names them); the streams each kept or held version reads besides its own
        self._streams: dict[int, np.ndarray] = {}
        self._origins: dict[int, set[int]] = {}
        self._released: dict[int, list[bytes]] = {}  # dropped: chunks kept while read
        self._dropping: dict[int, list[bytes]] = {}  # held when dropped: retried later
        self._latest: int | None = None
        self._skeleton: tuple[Any, Any] | None = None  # (treedef, its skeleton): the last tree
        self.pool: HostPool | None = None
        self.server: WeightsServer | None = None
        self._link: RegistryLink | None = None
        self._closed = False
        self._controller = controller()  # None unless a process of a multi-controller job
        if self._controller is not None and (amax or relays):
            raise InvalidArgumentError(
                "amax, relays: a trainer of several processes publishes no maxima and no "
                "chunk digests yet (a later part)"
            )
        self._instance = instance_number("publisher", self.name)  # the same in every process
        self._attempts = 0
        self._pool_name = f"weights-{self.name}" + (
            "" if self._controller is None else f"-p{self._controller.index}"
        )
        self._executor = ThreadPoolExecutor(
            max_workers=max(1, native.copy_threads() - 1), thread_name_prefix="tpusync-publish"
        )
        self._hashers: ThreadPoolExecutor | None = None  # made at the first digests (relays)
        capacity_bytes = self.pool_options.capacity_bytes
        self._sized_by_caller = capacity_bytes is not None
        if capacity_bytes is not None:
            self._open(-(-capacity_bytes // self._chunk_bytes))

    # --- the pool, its server and the registry ---------------------------------------------

    def _open(self, slots: int) -> None:
        pool = HostPool(
            self.layout,
            slots,
            name=self._pool_name,
            shm_dir=self.pool_options.shm_dir,
            on_mismatch="recreate",
            # staged and read in whole chunks, where huge pages gain nothing; samplers map the
            # file with small pages, through which a collapsed one reads slower (0010)
            collapse=False,
        )
        try:
            stale = pool.keys()
            if stale:  # a restarted publisher: versions of a previous life are not announced
                pool.delete(stale)
            server = WeightsServer(pool, options=self._block_server_options)
        except BaseException:
            pool.close()
            raise
        self.pool, self.server = pool, server
        if self._registry is not None and (self._controller is None or not self._controller.index):
            node = NodeInfo(publisher_node_id(self.name), (server.address,), group="weights")
            try:
                self._link = RegistryLink(
                    self._registry,
                    node,
                    self.server_options.registry_ttl_s,
                    self._announced_keys,
                )
            except BaseException:
                self.close()
                raise

    def _announced_keys(self) -> list[bytes]:
        with self._lock:
            return [announcement_key(self.name, v) for v in self._versions]

    @property
    def address(self) -> str | None:
        """Where subscribers connect (``host:port``); None before the first publish when the
        pool options gave no ``capacity_bytes``."""
        return None if self.server is None else self.server.address

    @property
    def versions(self) -> list[int]:
        """The versions kept, oldest first."""
        with self._lock:
            return sorted(self._versions)

    # --- publish ------------------------------------------------------------------------------

    def publish(
        self, params: Any, version: int, *, parent: int | None = None, base: int | None = None
    ) -> PublishReport:
        """Stages ``params`` (a pytree of ``jax.Array`` / numpy arrays) as ``version`` (an
        integer above every earlier one, e.g. the training step) and announces it; returns once
        the bytes are staged, so the arrays may be changed or donated at once.

        With ``base`` (a version kept), ``version`` is a partial one: ``params`` holds only
        the leaves it changes (the base's tree with the others left out or None, e.g. an
        adapter), each of the base's path, shape and dtype; every other leaf is the base's,
        read by subscribers from the base's chunks, which stay while a version kept reads
        them. A subscriber that holds the base's leaves pulls only the changed ones.

        Raises InvalidArgumentError (a version not above the last, a leaf that is no array; a
        base not kept, or a partial leaf the base does not have with its shape and dtype),
        TierFullError (the pool cannot hold this version beside those kept and held: the
        message says how many chunks it needs, how many are free and what holds the rest) or
        ServerFailedError (its block server stopped accepting subscribers: a loop of it kept
        dying). The first two are raised before any byte is staged, and a failed publish
        leaves the pool and the publisher as they were: the next publish (of this version
        too) runs as if it had not been tried.
        """
        check_version(version)
        if self._closed:
            raise InvalidArgumentError("this Publisher is closed")
        failure = None if self.server is None else self.server.failure
        if failure is not None:  # staging a version nobody can pull would hide it
            raise ServerFailedError(
                f"the weights block server at {self.address} no longer accepts subscribers (a "
                f"loop of it kept dying: {failure!r:.200}; the log has its traceback): close "
                "this Publisher and make a new one, or restart the process"
            )
        if self._latest is not None and version <= self._latest:
            raise InvalidArgumentError(
                f"version: {version} is not above the last one published ({self._latest}); "
                "versions must rise (use the training step)"
            )
        if self._controller is not None and (base is not None or self.amax):
            raise InvalidArgumentError(
                "base, amax: a trainer of several processes publishes full versions without "
                "maxima (partial versions and fp8 maxima of one come in a later part)"
            )
        start = time.perf_counter()
        paths, leaves, treedef = tree_paths(params)
        origins: dict[int, np.ndarray] = {}
        if base is None:
            if self._skeleton is None or self._skeleton[0] != treedef:  # versions repeat it
                self._skeleton = (treedef, tree_skeleton(params, paths))
            skeleton = self._skeleton[1]
            entries, sources = self._describe(paths, leaves)
            if self._controller is not None:
                return self._publish_part(version, parent, entries, sources, skeleton, start)
        else:
            entries, sources, skeleton, origins = self._partial(params, version, base)
        total = sum(s.nbytes for s in sources)
        n_chunks = -(-total // self._chunk_bytes)
        parent = self._latest if parent is None else parent
        # The manifest's size is known before any byte moves (its checksums are fixed-width
        # hex), so the version's chunks and manifest are reserved together: a publish that does
        # not fit is refused before it copies anything, and one that fails leaves nothing.
        draft = Manifest(
            self.name,
            version,
            parent,
            self._chunk_bytes,
            total,
            tuple(entries),
            np.zeros(n_chunks, dtype=np.uint64),
            skeleton,
            base,
            origins,
            digests=bytes(DIGEST_BYTES * n_chunks) if self.relays else None,
        )
        n_parts = -(-len(draft.to_bytes()) // self._chunk_bytes)
        if self.pool is None:
            self._open((self._keep + 2) * (n_chunks + n_parts + 1))
        assert self.pool is not None
        self._retry_drops()
        keys = [chunk_key(self.name, version, i) for i in range(n_chunks)]
        manifest_keys = [manifest_key(self.name, version, p) for p in range(n_parts)]
        reservation = self._reserve(version, keys + manifest_keys, n_chunks, total)
        try:
            checksums = self._stage(reservation.slots[:n_chunks], sources, total)
            digests = self._digests_of(reservation.slots[:n_chunks]) if self.relays else None
            manifest = dataclasses.replace(draft, checksums=checksums, digests=digests)
            manifest_bytes = manifest.to_bytes()
            self._write_manifest(reservation.slots[n_chunks:], manifest_bytes)
            all_checksums = np.concatenate(
                [checksums, self.pool.hash_slots(reservation.slots[n_chunks:])]
            )
        except BaseException:
            self.pool.abort(reservation)  # nothing of this version stays in the pool
            raise
        # one commit: the chunks and the manifest become visible together, under the pool's lock
        self.pool.commit(reservation, all_checksums)
        self._record(
            version, manifest_keys, manifest_bytes, entries, skeleton, checksums, set(origins)
        )
        self._announce(version)
        return PublishReport(version, total, n_chunks, time.perf_counter() - start, self.versions)

    def _record(
        self,
        version: int,
        manifest_keys: list[bytes],
        manifest_bytes: bytes,
        entries: list[LeafEntry],
        skeleton: Any,
        checksums: np.ndarray,
        origins: set[int],
    ) -> None:
        """Books a committed ``version`` (its manifest's keys, leaves, tree, chunks' checksums
        and the earlier versions it reads), drops the versions beyond ``keep`` and updates the
        head."""
        assert self.server is not None
        if manifest_bytes:  # served whole (a multi-controller trainer's first process only)
            self.server.manifests[version] = manifest_bytes
        with self._lock:
            self._versions[version] = manifest_keys
            self._chunks[version] = len(checksums)
            self._digests[version] = structure_digest([(e.path, e.shape, e.dtype) for e in entries])
            self._entries[version] = (tuple(entries), skeleton)
            self._streams[version] = checksums
            self._origins[version] = origins
            self._latest = version
        self._drop_beyond_keep()
        self._update_head()

    def _announce(self, version: int) -> None:
        """Lists ``version`` in the registry: the last step of a publish."""
        if self._link is not None:
            self._link.added([announcement_key(self.name, version)])
            try:  # announced before publish() returns, unless the registry is unreachable
                self._link.flush_changes()
            except (TpuSyncError, OSError) as error:
                log.warning(
                    "tpusync weights: version %d is staged but not yet announced (%s); the "
                    "registry link retries at its next heartbeat",
                    version,
                    error,
                )

    def _publish_part(
        self,
        version: int,
        parent: int | None,
        entries: list[LeafEntry],
        sources: list[np.ndarray],
        skeleton: Any,
        start: float,
    ) -> PublishReport:
        """``publish`` in a process of a multi-controller trainer (see
        :mod:`~tpusync._src.weights.multi`): stages this process's boxes; the first process
        gathers every part and commits the version, the others wait for its commit."""
        ctl = self._controller
        assert ctl is not None
        C, timeout = self._chunk_bytes, self.server_options.parts_timeout_s
        total = sum(s.nbytes for s in sources)
        n_chunks = -(-total // C)
        parent = self._latest if parent is None else parent
        # this attempt's keys: a failed version may be published again, and another Publisher
        # of the name made later in the job (every process makes them in the same order)
        self._attempts += 1
        prefix = f"tpusync/weights/{self.name}/{self._instance}/{self._attempts}"
        said = f"timeout {timeout:g} s: WeightsServerOptions.parts_timeout_s"
        keys = [chunk_key(self.name, version, i) for i in range(n_chunks)]
        checksums = np.zeros(0, dtype=np.uint64)
        digest = structure_digest([(e.path, e.shape, e.dtype) for e in entries])
        manifest_keys: list[bytes] = []
        data = b""  # the manifest: the first process writes it
        try:
            try:
                if self.pool is None:  # the first process's manifest: ~ a checksum per chunk
                    whole = n_chunks * ctl.count
                    extra = 0 if ctl.index else 2 + (len(entries) * 400 + whole * 40) // C
                    self._open((self._keep + 2) * (n_chunks + extra + 1))
                assert self.pool is not None and self.server is not None
                self._retry_drops()
                if n_chunks:
                    reservation = self._reserve(version, keys, n_chunks, total)
                    try:
                        checksums = self._stage(reservation.slots, sources, total)
                    except BaseException:
                        self.pool.abort(reservation)
                        raise
                    self.pool.commit(reservation, checksums)  # unreachable until named
            except BaseException as error:
                if ctl.index:  # the first process stops waiting for this part at once
                    ctl.share(f"{prefix}/part/{ctl.index}", {"error": repr(error)[:500]})
                raise
            del sources
            mine = {
                "address": self.server.address,
                "checksums": checksums.astype("<u8").tobytes().hex(),
                "digest": digest,
                "chunk_bytes": C,
                "offsets": [
                    [i, b, e.offsets[b]]
                    for i, e in enumerate(entries)
                    for b in range(len(e.boxes))
                    if e.parts is not None and e.parts[b] == ctl.index
                ],
            }
            if ctl.index:
                ctl.share(f"{prefix}/part/{ctl.index}", mine)
                try:
                    decision = ctl.wait(
                        f"{prefix}/decision", timeout, f"version {version}'s commit"
                    )
                except WeightSyncError:  # too late for the first process, unless it decided
                    decision = ctl.claim(f"{prefix}/decision", {"committed": False, "error": said})
                if decision.get("committed") is not True:
                    raise WeightSyncError(
                        f"version {version}: the trainer's first process did not commit it "
                        f"({str(decision.get('error'))[:300]}); nothing of it is visible"
                    )
            else:
                deadline = time.monotonic() + timeout
                parts = [
                    ctl.wait(
                        f"{prefix}/part/{p}",
                        max(0.001, deadline - time.monotonic()),
                        f"version {version}: process {p}'s part ({said})",
                    )
                    for p in range(1, ctl.count)
                ]
                manifest = self._merged(version, parent, total, entries, checksums, skeleton, parts)
                data = manifest.to_bytes()
                Manifest.from_bytes(data, name=self.name, version=version)  # what subscribers see
                # decided before it is visible: a process that gave up first makes it fail here
                decision = ctl.claim(f"{prefix}/decision", {"committed": True})
                if decision.get("committed") is not True:
                    raise WeightSyncError(
                        f"version {version}: a process of the trainer gave up waiting "
                        f"({decision.get('error')}); nothing of it is visible"
                    )
                manifest_keys = self._commit_manifest(version, data)
                entries = list(manifest.leaves)
        except BaseException as error:
            if self.pool is not None:
                self.pool.delete(keys)  # nothing of this version stays
            if not ctl.index:
                ctl.claim(f"{prefix}/decision", {"committed": False, "error": repr(error)[:500]})
            raise
        finally:
            if not ctl.index:
                for p in range(1, ctl.count):
                    ctl.forget(f"{prefix}/part/{p}")
        self._record(version, manifest_keys, data, entries, skeleton, checksums, set())
        if not ctl.index:
            self._announce(version)
        return PublishReport(version, total, n_chunks, time.perf_counter() - start, self.versions)

    def _merged(
        self,
        version: int,
        parent: int | None,
        total: int,
        entries: list[LeafEntry],
        checksums: np.ndarray,
        skeleton: Any,
        parts: list[dict[str, Any]],
    ) -> Manifest:
        """The version's manifest from the first process's entries and the other processes'
        parts: where each box another process holds starts in that process's stream."""
        offsets = [list(e.offsets) for e in entries]
        digest = structure_digest([(e.path, e.shape, e.dtype) for e in entries])
        listed = []
        for p, part in enumerate(parts, start=1):
            if "error" in part:
                raise WeightSyncError(
                    f"version {version}: process {p} failed to stage its part "
                    f"({str(part['error'])[:300]})"
                )
            if part.get("digest") != digest or part.get("chunk_bytes") != self._chunk_bytes:
                raise WeightSyncError(
                    f"version {version}: process {p} published another tree or chunk size "
                    "than the first; every process publishes the same tree (its own shards) "
                    "with the same WeightsPoolOptions"
                )
            owned = {
                (i, b)
                for i, e in enumerate(entries)
                for b in range(len(e.boxes))
                if e.parts is not None and e.parts[b] == p
            }
            try:
                sums = np.frombuffer(bytes.fromhex(part["checksums"]), dtype="<u8")
                given = set()
                for i, b, offset in part["offsets"]:
                    if (i, b) not in owned or (i, b) in given or type(offset) is not int:
                        raise ValueError(f"box {b} of leaf {i} is not process {p}'s, or twice")
                    given.add((i, b))
                    offsets[i][b] = offset
                if given != owned:
                    raise ValueError(f"{len(owned - given)} of its boxes are missing")
                listed.append((str(part["address"]), sums.astype(np.uint64)))
            except (KeyError, TypeError, ValueError, IndexError) as error:
                raise WeightSyncError(
                    f"version {version}: process {p}'s part is malformed ({error})"
                ) from None
        merged = [
            dataclasses.replace(e, offsets=tuple(o)) for e, o in zip(entries, offsets, strict=True)
        ]
        return Manifest(
            self.name,
            version,
            parent,
            self._chunk_bytes,
            total,
            tuple(merged),
            checksums,
            skeleton,
            parts=tuple(listed),
        )

    def _commit_manifest(self, version: int, data: bytes) -> list[bytes]:
        """Writes and commits a manifest alone (its chunks committed before); its keys."""
        assert self.pool is not None
        n_parts = -(-len(data) // self._chunk_bytes)
        keys = [manifest_key(self.name, version, p) for p in range(n_parts)]
        reservation = self._reserve(version, keys, 0, 0)
        try:
            self._write_manifest(reservation.slots, data)
            sums = self.pool.hash_slots(reservation.slots)
        except BaseException:
            self.pool.abort(reservation)
            raise
        self.pool.commit(reservation, sums)
        return keys

    def _describe(self, paths: list[str], leaves: list[Any]) -> tuple[list[LeafEntry], list[Any]]:
        """Each leaf's entry and the host sources of the boxes this process stages (all of
        them, unless a process of a multi-controller trainer: those it owns, see
        :mod:`~tpusync._src.weights.multi`), in stream order."""
        me = 0 if self._controller is None else self._controller.index
        entries: list[LeafEntry] = []
        sources: list[np.ndarray] = []
        offset = 0
        for path, leaf in zip(paths, leaves, strict=True):
            if isinstance(leaf, jax.Array):
                shape = tuple(leaf.shape)
                boxes, of_device = shard_boxes(leaf.sharding, shape)
                owners = (
                    [0] * len(boxes)
                    if self._controller is None
                    else box_owners(leaf.sharding, shape, of_device)
                )
                data: list[Any] = [None] * len(boxes)
                for shard in leaf.addressable_shards:
                    if data[of_device[shard.device]] is None:
                        data[of_device[shard.device]] = shard.data
                if any(d is None and owners[b] == me for b, d in enumerate(data)):
                    raise InvalidArgumentError(
                        f"params{path}: not every shard is addressable in this process; a "
                        "trainer of several processes publishes from each of them (start "
                        "jax.distributed before the Publisher)"
                    )
                hosts = [_shard_source(d) if owners[b] == me else None for b, d in enumerate(data)]
                dtype = np.dtype(leaf.dtype)
            elif isinstance(leaf, np.ndarray):
                shape = leaf.shape
                boxes = (tuple((0, d) for d in shape),)
                owners = [0]
                hosts = [np.ascontiguousarray(leaf) if me == 0 else None]
                dtype = leaf.dtype
            else:
                raise InvalidArgumentError(
                    f"params{path}: expected a jax.Array or numpy array, got {type(leaf).__name__}"
                )
            offsets = []
            for host in hosts:  # another process's box: its offset comes from that process
                offsets.append(offset if host is not None else 0)
                offset += 0 if host is None else host.nbytes
            sharding = (
                sharding_data(leaf.sharding, len(shape)) if isinstance(leaf, jax.Array) else None
            )
            parts = None if self._controller is None else tuple(owners)
            entries.append(
                LeafEntry(path, shape, dtype.name, boxes, tuple(offsets), sharding, parts=parts)
            )
            sources.extend(h for h in hosts if h is not None)
        if self.amax:  # after every leaf's shards: each float leaf's maxima, float32
            first = 0  # the leaf's first source
            for i, entry in enumerate(list(entries)):
                if entry.dtype in AMAX_DTYPES:
                    maxima = _channel_amax(entry, sources[first : first + len(entry.boxes)])
                    entries[i] = dataclasses.replace(entry, amax=offset)
                    sources.append(maxima)
                    offset += maxima.nbytes
                first += len(entry.boxes)
        return entries, sources

    def _reserve(self, version: int, keys: list[bytes], n_chunks: int, total: int) -> Any:
        """Slots for every chunk and manifest part of ``version`` (``keys``, chunks first), or
        :class:`~tpusync.errors.TierFullError` saying what the version needs, what is free and
        what holds the rest; nothing is taken then."""
        assert self.pool is not None
        pool = self.pool
        if any(pool.contains(keys)):  # never expected: left by an earlier life of this name
            pool.delete(keys)
            if any(pool.contains(keys)):
                raise InvalidArgumentError(
                    f"version: {version}'s chunks from an earlier attempt are still held by a "
                    "subscriber; publish it under a later version number"
                )
        try:
            reservation = pool.reserve(keys)
        except TierFullError:
            raise TierFullError(self._no_room(version, len(keys), n_chunks, total)) from None
        assert len(reservation.slots) == len(keys)
        return reservation

    def _no_room(self, version: int, need: int, n_chunks: int, total: int) -> str:
        assert self.pool is not None
        C, capacity = self._chunk_bytes, self.pool.capacity
        with self._lock:
            kept = {v: self._chunks[v] + len(k) for v, k in self._versions.items()}
        held = {v: len(k) for v, k in self._dropping.items() if self.pool.contains(k[:1])[0]}
        if need > capacity:
            where = f"more than the whole pool holds ({capacity} chunks)"
        else:
            where = (
                f"the pool has {self.pool.free} of its {capacity} chunks free ("
                f"{sum(kept.values())} hold the {len(kept)} versions kept, {sorted(kept)}"
                + (
                    f"; {sum(held.values())} the versions beyond keep that subscribers still "
                    f"hold, {sorted(held)}, dropped once released"
                    if held
                    else ""
                )
                + (
                    f"; {sum(len(k) for k in self._released.values())} those of dropped versions "
                    f"{sorted(self._released)} that kept partial versions read"
                    if self._released
                    else ""
                )
                + ")"
            )
        sized = (
            "WeightsPoolOptions.capacity_bytes"
            if self._sized_by_caller
            else "the first version published"
        )
        enough = (self._keep + 2) * need * C
        return (
            f"version {version} needs {need} chunks of {C} bytes ({n_chunks} for its "
            f"{size_text(total)}, {need - n_chunks} for its manifest), {where}. The pool was "
            f"sized from {sized} and does not grow while the publisher runs; nothing of version "
            f"{version} was staged, and the publisher takes later versions as before. For "
            f"versions of this size start a Publisher with pool=WeightsPoolOptions("
            f"capacity_bytes={enough}) (keep + 2 versions of it), or a smaller keep"
        )

    def _digests_of(self, slots: np.ndarray) -> bytes:
        """The SHA-256 of each staged chunk, in order, on every core (hashlib lets go of the
        GIL while it hashes)."""
        assert self.pool is not None
        pool = self.pool

        def digest(slot: int) -> bytes:
            with pool.slot_memory(slot) as memory:
                return hashlib.sha256(memory[: self._chunk_bytes]).digest()

        if self._hashers is None:
            self._hashers = ThreadPoolExecutor(
                max_workers=native.copy_threads(), thread_name_prefix="tpusync-digest"
            )
        return b"".join(self._hashers.map(digest, slots.tolist()))

    def _stage(self, slots: np.ndarray, sources: list[np.ndarray], total: int) -> np.ndarray:
        """Copies every shard into the reserved chunks and checksums each chunk as it is
        written, in one pass on every core; the last chunk's tail is zeros."""
        assert self.pool is not None
        C = self._chunk_bytes
        sizes = np.array([s.nbytes for s in sources], dtype=np.int64)
        rows = Rows(
            np.cumsum(sizes) - sizes,
            np.array([s.ctypes.data for s in sources], dtype=np.int64),
            sizes,
        )
        rows = split_at_chunks(rows, C)
        keep = rows.nbytes > 0
        rows = Rows(rows.offset[keep], rows.address[keep], rows.nbytes[keep])
        tail = total - (len(slots) - 1) * C
        padding = np.zeros(C - tail if len(slots) and tail < C else 0, dtype=np.uint8)
        with self.pool.slot_addresses(slots) as addresses:
            chunk = rows.offset // C
            dst = addresses.astype(np.int64)[chunk] + rows.offset - chunk * C
            src, lengths = rows.address, rows.nbytes
            if len(padding):  # deterministic: the checksum covers the whole slot
                chunk = np.append(chunk, len(slots) - 1)
                src = np.append(src, padding.ctypes.data)
                dst = np.append(dst, int(addresses[-1]) + tail)
                lengths = np.append(lengths, len(padding))
            ends = np.searchsorted(chunk, np.arange(1, len(slots) + 1))
            digests = self._copy_streams(src, dst, lengths, ends)
        del sources
        return slot_checksums(digests[:, None])

    def _copy_streams(
        self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, ends: np.ndarray
    ) -> np.ndarray:
        """``_core.copy_sum64_streams`` with the streams (chunks) shared among the cores."""
        parts = np.array_split(np.arange(len(ends)), max(1, min(native.copy_threads(), len(ends))))

        def run(part: np.ndarray) -> np.ndarray:
            if not len(part):
                return np.zeros(0, dtype=np.uint64)
            lo = int(ends[part[0] - 1]) if part[0] else 0
            hi = int(ends[part[-1]])
            return _core.copy_sum64_streams(
                src[lo:hi].astype(np.uint64),
                dst[lo:hi].astype(np.uint64),
                lengths[lo:hi].astype(np.uint64),
                (ends[part] - lo).astype(np.int64),
            )

        jobs = [self._executor.submit(run, p) for p in parts[:-1]]
        last = run(parts[-1])
        return np.concatenate([*(j.result() for j in jobs), last])

    def _write_manifest(self, slots: np.ndarray, data: bytes) -> None:
        """Writes the manifest ``data`` into the reserved ``slots``, zero-padded to whole
        chunks."""
        assert self.pool is not None
        assert len(slots) * self._chunk_bytes >= len(data), "the manifest outgrew its draft"
        for p, slot in enumerate(slots.tolist()):
            piece = data[p * self._chunk_bytes : (p + 1) * self._chunk_bytes]
            with self.pool.slot_memory(slot) as memory:
                memory[: len(piece)] = piece
                memory[len(piece) : self._chunk_bytes] = bytes(self._chunk_bytes - len(piece))

    # --- dropping old versions ---------------------------------------------------------------

    def _drop_beyond_keep(self) -> None:
        with self._lock:
            old = sorted(self._versions)[: -self._keep]
        for version in old:
            with self._lock:
                manifest_keys = self._versions.pop(version)
                del self._chunks[version], self._digests[version], self._entries[version]
            if self._link is not None:
                self._link.removed([announcement_key(self.name, version)])
            self._dropping[version] = manifest_keys  # its chunks: see _retry_drops
        self._retry_drops()

    def _update_head(self) -> None:
        """Tells subscribers the versions kept now (the server's head, replaced whole)."""
        assert self.server is not None
        with self._lock:
            self.server.head = Head(tuple((v, self._digests[v]) for v in sorted(self._versions)))

    def _retry_drops(self) -> None:
        """Drops the versions beyond ``keep`` that no subscriber holds: the manifest's first
        part goes first (a subscriber holds it for its whole pull), then the rest; a dropped
        version's chunks go once no version kept or held reads them (a partial version reads
        its base's)."""
        assert self.pool is not None
        for version, keys in list(self._dropping.items()):
            if keys and self.pool.contains(keys[:1])[0] and not self.pool.delete(keys[:1]):
                continue  # held by a subscriber: dropped at a later publish
            self.pool.delete(keys[1:])
            del self._dropping[version]
            if self.server is not None:
                self.server.manifests.pop(version, None)
            self._origins.pop(version, None)
            n_chunks = len(self._streams[version])  # its checksums stay while it is read
            self._released[version] = [chunk_key(self.name, version, i) for i in range(n_chunks)]
        live = [*self._versions, *self._dropping]
        read = set().union(*(self._origins.get(v, set()) for v in live))
        for version in sorted(set(self._released) - read):
            keys = self._released[version]
            self.pool.delete(keys)
            left = [k for k, held in zip(keys, self.pool.contains(keys), strict=True) if held]
            if left:  # pinned by a reader this moment: deleted at a later publish
                self._released[version] = left
            else:
                del self._released[version], self._streams[version]

    def _partial(
        self, params: Any, version: int, base: int
    ) -> tuple[list[LeafEntry], list[np.ndarray], Any, dict[int, np.ndarray]]:
        """The entries of ``version``, partial on ``base``, changing the leaves of ``params``;
        the changed leaves' sources, the base's tree and the streams its other leaves are read
        from."""
        paths, leaves, _ = tree_paths(params)
        check_version(base, "base")
        with self._lock:
            kept = self._entries.get(base)
            versions = sorted(self._versions)
        if kept is None:
            raise InvalidArgumentError(
                f"base: version {base} is not kept (kept: {versions}); a partial version "
                "changes leaves of a kept version"
            )
        base_entries, skeleton = kept
        if not paths:
            raise InvalidArgumentError("params: a partial version changes at least one leaf")
        _check_sequences(params, skeleton, base)
        changed, sources = self._describe(paths, leaves)
        by_path = {e.path: e for e in base_entries}
        for entry in changed:
            was = by_path.get(entry.path)
            if was is None:
                raise InvalidArgumentError(
                    f"params{entry.path}: not a leaf of version {base}; a partial version "
                    "changes leaves of its base and adds none: publish a full version"
                )
            if (was.shape, was.dtype) != (entry.shape, entry.dtype):
                raise InvalidArgumentError(
                    f"params{entry.path}: {entry.dtype}{list(entry.shape)}, but version {base} "
                    f"has {was.dtype}{list(was.shape)}; a partial version keeps its base's "
                    "shapes and dtypes: publish a full version"
                )
        new = {e.path: e for e in changed}
        entries = [
            new.get(e.path) or dataclasses.replace(e, origin=base if e.origin is None else e.origin)
            for e in base_entries
        ]
        read = {e.origin for e in entries if e.origin is not None}
        if len(read) > MAX_ORIGINS:
            raise InvalidArgumentError(
                f"base: version {version} would read the chunks of {len(read)} earlier versions "
                f"(at most {MAX_ORIGINS}); publish a full version"
            )
        return entries, sources, skeleton, {v: self._streams[v] for v in sorted(read)}

    # --- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Withdraws every version, stops serving and removes the pool."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        if self._hashers is not None:
            self._hashers.shutdown(wait=True)
        if self._link is not None:
            self._link.close()
        if self.server is not None:
            self.server.close()
        if self.pool is not None:
            self.pool.close()
            with contextlib.suppress(InvalidArgumentError):  # removed by hand meanwhile
                remove_pool(self._pool_name, shm_dir=self.pool_options.shm_dir)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Publisher({self.name!r}, versions={self.versions}, address={self.address})"
