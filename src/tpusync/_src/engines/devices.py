"""Which engine each device can get, and why: the facts behind ``path="auto"`` and info().

The answer per device is kept until a PJRT binding or the process's options change (the
transfer layer's chooser, :mod:`tpusync._src.transfer.select`, reads it; so does info()).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tpusync import options
from tpusync._src.engines.pjrt import engine as pjrt

try:
    from tpusync._native import core as _core  # noqa: F401
except ImportError as exc:  # pragma: no cover - only when the build is broken
    _CORE_MISSING: str | None = str(exc)
else:
    _CORE_MISSING = None

__all__ = ["DevicePath", "describe_backend", "device_path", "plugin_path"]


@dataclass(frozen=True)
class DevicePath:
    """The engine a device gets, what it can do there, and the reason, in words.

    ``engine``: ``"raw"`` (CPU backend: the shards' memory itself), ``"pjrt"`` (a plugin's
    PJRT C API) or ``"none"``. ``reads``/``writes``: device->host and in-place host->device
    copies are possible. ``native``: ``path="auto"`` picks the native engine here (where it
    reads; for writes only where ``writes`` too).
    """

    native: bool
    reason: str
    engine: str = "raw"
    reads: bool = True
    writes: bool = True

    @property
    def name(self) -> str:
        return "native" if self.native else "jax"


def device_path(device: Any) -> DevicePath:
    """The engine a device gets and why (kept per binding generation and options)."""
    return _device_path(device, pjrt.bindings_generation(), options.current())


@functools.lru_cache(maxsize=4096)
def _device_path(device: Any, generation: int, current: options.Options) -> DevicePath:
    if device.platform == "cpu" and pjrt.bound(device.platform) is None:
        if _CORE_MISSING is not None:  # pragma: no cover - only when the build is broken
            reason = f"native core did not import ({_CORE_MISSING}): pure JAX"
            return DevicePath(False, reason, "none")
        return DevicePath(True, "CPU backend: raw memory")
    return plugin_path(device)


def plugin_path(device: Any) -> DevicePath:
    """The path of a device served through a PJRT plugin (or a binding of one)."""
    backend, found = pjrt.backend_for(device)
    if backend is None:
        return DevicePath(False, f"{found}: pure JAX", "none", False, False)
    reads, writes = backend.reads, backend.writes
    what = f"{found}; {backend.capabilities()}"
    if not reads:
        return DevicePath(False, f"{what}: pure JAX", "none", False, False)
    if hasattr(device, "id") and hasattr(device, "client"):  # a JAX device: prove it first
        reads, writes, failed = pjrt.self_test(backend, device)
        if failed:
            what = f"{what}; {failed}"
        if not reads:
            return DevicePath(False, f"{what}: pure JAX", "none", False, False)
    platform = getattr(device, "platform", "")
    if backend.auto or pjrt.auto_enabled(platform):
        tail = "native reads and writes" if writes else "native reads, pure-JAX writes"
        return DevicePath(True, f"{what}: {tail}", "pjrt", reads, writes)
    return DevicePath(
        False,
        f"{what}: pure JAX for path='auto' until proven on this platform's hardware "
        "(path='native' or TPUSYNC_PJRT=1 uses it)",
        "pjrt",
        reads,
        writes,
    )


def describe_backend(device: Any) -> str:
    """One line on a backend's PJRT C API and the path its devices get. Never raises."""
    try:
        return plugin_path(device).reason
    except Exception as exc:
        return f"PJRT probe failed ({type(exc).__name__}: {exc}): pure JAX"
