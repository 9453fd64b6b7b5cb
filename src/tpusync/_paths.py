"""Which engine each device gets, and why: the facts behind ``path="auto"`` and info()."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any


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


@cache
def device_path(device: Any) -> DevicePath:
    platform = device.platform
    from tpusync import _pjrt_path

    if platform == "cpu" and _pjrt_path.bound(platform) is None:
        try:
            from tpusync import _core  # noqa: F401
        except ImportError as exc:  # pragma: no cover - only when the build is broken
            return DevicePath(False, f"native core did not import ({exc}): pure JAX", "none")
        return DevicePath(True, "CPU backend: raw memory")
    return plugin_path(device)


def plugin_path(device: Any) -> DevicePath:
    """The path of a device served through a PJRT plugin (or a binding of one)."""
    from tpusync import _pjrt_path

    backend, found = _pjrt_path.backend_for(device)
    if backend is None:
        return DevicePath(False, f"{found}: pure JAX", "none", False, False)
    reads, writes = backend.reads, backend.writes
    what = f"{found}; {backend.capabilities()}"
    if not reads:
        return DevicePath(False, f"{what}: pure JAX", "none", False, False)
    if hasattr(device, "id") and hasattr(device, "client"):  # a JAX device: prove it first
        reads, writes, failed = _pjrt_path.self_test(backend, device)
        if failed:
            what = f"{what}; {failed}"
        if not reads:
            return DevicePath(False, f"{what}: pure JAX", "none", False, False)
    platform = getattr(device, "platform", "")
    if backend.auto or _pjrt_path.auto_enabled(platform):
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
