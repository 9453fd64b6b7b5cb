"""Which engine each device gets, and why: the facts behind ``path="auto"`` and info()."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class DevicePath:
    """The engine a device gets (``native`` or ``jax``) and the reason, in words."""

    native: bool
    reason: str

    @property
    def name(self) -> str:
        return "native" if self.native else "jax"


@cache
def device_path(device: Any) -> DevicePath:
    platform = device.platform
    if platform == "cpu":
        try:
            from tpusync import _core  # noqa: F401
        except ImportError as exc:  # pragma: no cover - only when the build is broken
            return DevicePath(False, f"native core did not import ({exc}): pure JAX")
        return DevicePath(True, "CPU backend: raw memory")
    from tpusync._pjrt_probe import describe_backend

    return DevicePath(False, describe_backend(device))
