"""The native engine on PJRT plugin backends (GPU, TPU): block copies through the PJRT C API.

A device buffer is reached through a *view*: ``PJRT_Client_CreateViewOfDeviceBuffer`` over the
address JAX reports (``unsafe_buffer_pointer``), as a flat uint8 array, on JAX's own client.
Reads are ``PJRT_Buffer_CopyRawToHost`` of the view (a core call); in-place writes need the
raw-buffer extension (``PJRT_RawBuffer_CopyRawHostToDevice`` on a raw alias of the view), which
not every plugin offers (the CUDA plugin does not; libtpu does). Each row of the segment table
is one copy (small reads are first gathered on the device, :mod:`.staging`, so
that neighbouring destinations make one row), all issued at once and completed by the plugin's
event callbacks (``_core.PjrtApi.copy_rows``). Views and aliases live for one call. Host
memory that tpusync allocated (``HostBuffer``, ``HostPool``: offered in
:mod:`tpusync._src.memory.dma`) is registered for DMA (``PJRT_Client_DmaMap``) on first use where
the plugin offers it, and unregistered before it is unmapped.

The safety rules are those of :mod:`tpusync._src.memory.device_pool`, plus one: a view has no
definition event, so a source shard is waited for (``block_until_ready``) before it is read.

Until this path has been proven on a platform's hardware (``benchmarks/gpu_transfer.py``),
``path="auto"`` keeps that platform on the pure-JAX path; ``path="native"`` (or
``Options.pjrt``, ``TPUSYNC_PJRT=1``, for auto) asks for it. A binding (:func:`bind`) serves a
platform's devices from a given plugin table and client: tests use it with a stand-in plugin
over CPU memory.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpusync import options
from tpusync._src.engines.pjrt import staging
from tpusync._src.engines.pjrt.probe import probe
from tpusync._src.memory import dma

__all__ = [
    "PROVEN_PLATFORMS",
    "DeviceBuffer",
    "PjrtBackend",
    "any_bound",
    "auto_enabled",
    "backend_for",
    "bind",
    "bindings_generation",
    "bound",
    "copy",
    "host_ends",
    "prepare_dma",
    "self_test",
    "unbind",
]

# Platforms on which benchmarks/gpu_transfer.py has shown this path byte-exact on hardware, so
# that path="auto" picks it there. Empty until a run on real hardware says otherwise.
PROVEN_PLATFORMS: frozenset[str] = frozenset()


def auto_enabled(platform: str) -> bool:
    """Whether ``path="auto"`` picks the PJRT engine on this platform."""
    return platform in PROVEN_PLATFORMS or options.current().pjrt


@dataclass
class PjrtBackend:
    """One plugin table and live client, and what tpusync can do through them."""

    api: Any  # _core.PjrtApi
    client: int  # PJRT_Client*
    label: str  # what was found, in words
    auto: bool = False  # path="auto" picks it (a binding's choice; else auto_enabled())
    _devices: dict[int, int] = field(default_factory=dict)  # jax device id -> PJRT_Device*
    _dma_mapped: set[int] = field(default_factory=set)  # host ranges (start) registered here
    # re-entrant: a Mapping collected by the garbage collector while a thread holds it unmaps
    # itself (on_unmap) on that same thread
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def reads(self) -> bool:
        return bool(self.api.can_read_raw and self.api.has_slot("PJRT_Client_LookupDevice"))

    @property
    def writes(self) -> bool:
        return self.reads and bool(self.api.can_write_raw)

    @property
    def dma(self) -> bool:
        return bool(
            self.api.has_slot("PJRT_Client_DmaMap") and self.api.has_slot("PJRT_Client_DmaUnmap")
        )

    def device(self, device: Any) -> int:
        """The PJRT_Device* of a JAX device (looked up by its global id once)."""
        found = self._devices.get(device.id)
        if found is None:
            found = self.api.lookup_device(self.client, device.id)
            self._devices[device.id] = found
        return found

    def capabilities(self) -> str:
        parts = ["reads" if self.reads else "no raw reads"]
        parts.append("in-place writes" if self.writes else "no raw-buffer extension for writes")
        if self.dma:
            parts.append("DMA registration")
        return ", ".join(parts)


_bindings: dict[str, PjrtBackend] = {}
_backends: dict[int, PjrtBackend] = {}  # by client pointer
_by_device: dict[Any, tuple[PjrtBackend | None, str]] = {}  # probed once per JAX device
_state_lock = threading.RLock()  # re-entrant for the same reason as PjrtBackend._lock
_generation = 0  # bumped by every bind/unbind: answers derived from the bindings are stale


def _forget_runtime_after_fork() -> None:
    # A forked child inherits JAX's PJRT clients without their threads (device calls are
    # refused there: see memory.fork_guard) and locks that a thread gone with the fork may hold.
    # Unmapping a HostPool or HostBuffer takes these locks: give it fresh ones, and nothing to
    # unregister (the DMA registrations belong to the parent's clients).
    global _state_lock
    _state_lock = threading.RLock()
    for backend in (*_bindings.values(), *_backends.values()):
        backend._lock = threading.RLock()
        backend._dma_mapped.clear()
    _backends.clear()
    _by_device.clear()


os.register_at_fork(after_in_child=_forget_runtime_after_fork)


def bind(platform: str, api: Any, client: int, label: str, *, auto: bool = True) -> PjrtBackend:
    """Serves every device of ``platform`` from ``api`` and ``client`` instead of what JAX uses
    (for tests: a stand-in plugin over CPU memory); ``auto``: path="auto" picks it, as on a
    proven platform. Undo with :func:`unbind`."""
    global _generation
    backend = PjrtBackend(api, client, label, auto=auto)
    with _state_lock:
        _bindings[platform] = backend
        _self_tested.clear()  # a new binding is proven anew
        _generation += 1
    return backend


def unbind(platform: str) -> None:
    global _generation
    with _state_lock:
        backend = _bindings.pop(platform, None)
        _generation += 1
    if backend is not None:
        _unmap_all(backend)


def bindings_generation() -> int:
    """A number that changes whenever a binding is made or undone (caches of device paths
    are keyed by it)."""
    return _generation


def bound(platform: str) -> PjrtBackend | None:
    """The binding serving ``platform``'s devices, or None."""
    return _bindings.get(platform)


def any_bound() -> bool:
    """Whether any platform is served through a binding (else CPU buffers are host memory)."""
    return bool(_bindings)


def backend_for(device: Any) -> tuple[PjrtBackend | None, str]:
    """The PJRT backend serving a JAX device, or None, and what was found, in words."""
    binding = _bindings.get(getattr(device, "platform", None))  # type: ignore[arg-type]
    if binding is not None:
        return binding, binding.label
    known = _by_device.get(device)
    if known is not None:
        return known
    found = probe(device)
    answer: tuple[PjrtBackend | None, str] = (None, found.summary)
    if found.api is not None:
        with _state_lock:
            backend = _backends.get(found.client)
            if backend is None:
                backend = PjrtBackend(found.api, found.client, found.summary)
                _backends[found.client] = backend
        answer = (backend, found.summary)
    _by_device[device] = answer
    return answer


# ---- host memory registered for DMA --------------------------------------------------------


def _forget_host_range(start: int) -> None:
    """Unregisters an offered host range from every backend before it is unmapped."""
    with _state_lock:
        backends = [b for b in (*_bindings.values(), *_backends.values()) if start in b._dma_mapped]
    for backend in backends:
        with backend._lock:
            if start in backend._dma_mapped:
                backend._dma_mapped.discard(start)
                # the memory goes away either way; never fail an unmap
                with contextlib.suppress(Exception):
                    backend.api.dma_unmap(backend.client, start)


dma.on_unmap(_forget_host_range)


def _unmap_all(backend: PjrtBackend) -> None:
    with backend._lock:
        for start in list(backend._dma_mapped):
            with contextlib.suppress(Exception):
                backend.api.dma_unmap(backend.client, start)
        backend._dma_mapped.clear()


def _ensure_dma(backend: PjrtBackend, host_lo: int, host_hi: int) -> None:
    """Registers every offered host range meeting [host_lo, host_hi) that is not yet."""
    if not backend.dma or host_lo >= host_hi:
        return
    wanted = [
        (start, size)
        for start, size in dma.offered_between(host_lo, host_hi)
        if start not in backend._dma_mapped
    ]
    for start, size in wanted:
        with backend._lock:
            if start in backend._dma_mapped:
                continue
            try:
                backend.api.dma_map(backend.client, start, size)
            except Exception:  # registration only speeds copies up: go on without it
                continue
            backend._dma_mapped.add(start)


def prepare_dma(device: Any, mapping: Any) -> bool:
    """Registers a mapping for DMA with the backend of ``device`` now (start-up work, so the
    first copy does not pay for it); False where the backend does not offer it."""
    backend, _ = backend_for(device)
    if backend is None or not backend.dma:
        return False
    start = int(mapping.address)
    _ensure_dma(backend, start, start + int(mapping.size))
    return start in backend._dma_mapped


# ---- copies ----------------------------------------------------------------------------------


@dataclass
class DeviceBuffer:
    """A device buffer a segment table addresses: its JAX device, address, bytes, and whether
    the table writes it."""

    device: Any
    address: int
    nbytes: int
    written: bool
    array: Any = None  # the jax.Array whose buffer it is (for gathers on the device)


def copy(table: np.ndarray, buffers: list[DeviceBuffer]) -> int:
    """Runs a segment table whose device ends lie in ``buffers`` (every one pinned and ready);
    returns the bytes copied. Raises PjrtError (a TpuSyncError) when a copy fails.

    Small reads are gathered on the device first (:mod:`.staging`)."""
    if not len(table):
        return 0
    backend, _reason = _single_backend(buffers)
    api = backend.api
    nbytes = int(table[:, 2].sum())
    table, staged = staging.stage_reads(table, buffers, staging.stage_below())
    buffers = buffers + [
        DeviceBuffer(device, s.unsafe_buffer_pointer(), int(s.nbytes), False, s)
        for device, s in staged
    ]
    unique: dict[int, DeviceBuffer] = {}
    for buf in buffers:
        seen = unique.get(buf.address)
        if seen is None:
            unique[buf.address] = DeviceBuffer(buf.device, buf.address, buf.nbytes, buf.written)
        else:
            seen.written |= buf.written
            seen.nbytes = max(seen.nbytes, buf.nbytes)
    try:
        with _Views(backend, list(unique.values())) as targets:
            if backend.dma and dma.offered():
                host = _host_bounds(table, targets)
                if host is not None:
                    _ensure_dma(backend, *host)
            api.copy_rows(targets, table)
    finally:
        del staged  # the staging arrays outlive every copy that reads them
    return nbytes


def _single_backend(buffers: list[DeviceBuffer]) -> tuple[PjrtBackend, str]:
    found: dict[int, tuple[PjrtBackend, str]] = {}
    for buf in buffers:
        backend, reason = backend_for(buf.device)
        if backend is None:
            raise AssertionError(f"no PJRT backend for {buf.device}: {reason}")
        found[id(backend)] = (backend, reason)
    if len(found) != 1:
        raise AssertionError("one segment table spans several PJRT clients")
    return next(iter(found.values()))


def _host_bounds(table: np.ndarray, targets: np.ndarray) -> tuple[int, int] | None:
    """The span of the table's host ends (the ends outside every device buffer)."""
    starts = targets[:, 0]
    ends = starts + targets[:, 1]
    src_on_device = staging.locate(table[:, 0], starts, ends)[0]
    dst_on_device = staging.locate(table[:, 1], starts, ends)[0]
    host = np.concatenate([table[~src_on_device, 0:1], table[~dst_on_device, 1:2]])
    if not len(host):
        return None
    return int(host.min()), int(host.max()) + 1


def host_ends(table: np.ndarray, buffers: list[DeviceBuffer]) -> np.ndarray:
    """The table with each row's host end in the source column (what a hash pass reads):
    a device->host row's destination, a host->device row's source."""
    starts = np.array(sorted({b.address for b in buffers}), dtype=np.uint64)
    sizes = {b.address: b.nbytes for b in buffers}
    ends = starts + np.array([sizes[int(s)] for s in starts], dtype=np.uint64)
    from_device = staging.locate(table[:, 0], starts, ends)[0]
    out = table.copy()
    out[from_device, 0] = table[from_device, 1]
    return out


# ---- a self-test per device, before any user byte moves -------------------------------------

_SELF_TEST_BYTES = 3 * 4096
_self_tested: dict[tuple[int, int, int, bool], tuple[bool, bool, str]] = {}


def self_test(backend: PjrtBackend, device: Any) -> tuple[bool, bool, str]:
    """Proves the engine on one device with scratch arrays of its own: reads two pieces of a
    known pattern out of order through a view (and, where the plugin can write, writes two
    pieces raw and reads them back through JAX). Returns (reads work, writes work, what
    failed or ""). Never raises; never touches a caller's array. Once per table, client,
    device and write capability."""
    key = (backend.api.address, backend.client, device.id, backend.writes)
    known = _self_tested.get(key)
    if known is None:
        known = _self_tested[key] = _self_test(backend, device)
    return known


@cache
def _owned() -> Any:
    return jax.jit(lambda x: jnp.array(x, copy=True))


def _self_test(backend: PjrtBackend, device: Any) -> tuple[bool, bool, str]:
    pattern = (np.arange(_SELF_TEST_BYTES, dtype=np.uint32) * 2654435761 >> 13).astype(np.uint8)
    try:
        # a computation's own output: on the CPU backend device_put would alias `pattern`
        array = _owned()(jax.device_put(pattern, device))
        array.block_until_ready()
        address = array.unsafe_buffer_pointer()
        host = np.zeros(_SELF_TEST_BYTES, np.uint8)
        h = host.ctypes.data
        rows = np.array(
            [[address + 4096, h, 4096], [address, h + 4096, 4096], [address + 8192, h + 8192, 7]],
            dtype=np.uint64,
        )
        scratch = DeviceBuffer(device, address, _SELF_TEST_BYTES, backend.writes)
        with _Views(backend, [scratch]) as targets:
            backend.api.copy_rows(targets, rows)
            expected = np.concatenate([pattern[4096:8192], pattern[:4096], pattern[8192:8199]])
            if not np.array_equal(host[:8199], expected) or host[8199:].any():
                return False, False, "self-test: bytes read through a view differ"
            if not backend.writes:
                return True, False, ""
            incoming = pattern[::-1].copy()
            s = incoming.ctypes.data
            write_rows = np.array(
                [[s, address + 8192, 4096], [s + 4096, address, 4096]], dtype=np.uint64
            )
            backend.api.copy_rows(targets, write_rows)
        got = np.asarray(array)
        want = pattern.copy()
        want[8192:] = incoming[:4096]
        want[:4096] = incoming[4096:8192]
        if not np.array_equal(got, want):
            return True, False, "self-test: bytes written through a raw alias differ"
        return True, True, ""
    except Exception as exc:  # any failure means: not this engine on this device
        return False, False, f"self-test failed ({type(exc).__name__}: {exc})"


class _Views:
    """Views (and raw aliases) of device buffers for one copy, as the targets table
    ``copy_rows`` takes; destroyed on exit."""

    def __init__(self, backend: PjrtBackend, buffers: list[DeviceBuffer]) -> None:
        self.backend = backend
        self.buffers = sorted(buffers, key=lambda b: b.address)
        self.views: list[int] = []
        self.aliases: list[int] = []

    def __enter__(self) -> np.ndarray:
        api, client = self.backend.api, self.backend.client
        targets = np.zeros((len(self.buffers), 4), dtype=np.uint64)
        try:
            for i, buf in enumerate(self.buffers):
                address, nbytes, written = buf.address, buf.nbytes, buf.written
                view = api.create_view(client, self.backend.device(buf.device), address, nbytes)
                self.views.append(view)
                raw = 0
                if written:
                    raw = api.create_raw_alias(view)
                    self.aliases.append(raw)
                targets[i] = (address, nbytes, view, raw)
        except BaseException:
            self.__exit__()
            raise
        return targets

    def __exit__(self, *exc: object) -> None:
        api = self.backend.api
        for raw in self.aliases:
            api.destroy_raw_buffer(raw)
        for view in self.views:
            api.destroy_buffer(view)
        self.aliases.clear()
        self.views.clear()
