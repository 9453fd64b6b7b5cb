"""What the PJRT C API of a plugin backend offers tpusync (read at run time, never assumed).

:func:`probe` finds the ``PJRT_Api`` table JAX uses for a device's backend, reads its version
through tpusync's own declarations (``_core.PjrtApi``), and checks that JAX's
``client.unsafe_client_pointer`` really is a ``PJRT_Client*`` of that plugin (by asking the
plugin for the client's platform name) before anything would trust it.
(:func:`tpusync._src.engines.devices.describe_backend` says, in one line, what was found and which
path the device gets.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

try:  # JAX's private backend table: a probe without it reports why
    from jax._src import xla_bridge
except Exception as exc:  # pragma: no cover - another jax
    xla_bridge = None
    _XLA_BRIDGE_ERROR = str(exc)
try:
    from tpusync._native.core import PjrtApi, PjrtError
except ImportError as exc:  # pragma: no cover - only when the build is broken
    PjrtApi = PjrtError = None
    _CORE_ERROR = str(exc)

__all__ = ["Probe", "probe"]

# Plugins that JAX loads itself without keeping the table: the library file names to look for
# among the libraries this process has mapped (never loading one).
_LOADED_LIBRARY_NAMES = {"tpu": ("libtpu.so",)}


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` found: the table and a checked client pointer, or None and why."""

    api: Any  # _core.PjrtApi, or None when nothing usable was found
    client: int
    summary: str  # what was found, or what failed, in words


def probe(device: Any) -> Probe:
    """The PJRT C API table and client behind a JAX device. Never raises."""
    try:
        return _probe(device)
    except Exception as exc:  # the probe must never break info() or path choice
        return Probe(None, 0, f"PJRT probe failed ({type(exc).__name__}: {exc})")


def _probe(device: Any) -> Probe:
    platform = getattr(device, "platform", None)
    client = getattr(device, "client", None)
    if not isinstance(platform, str) or client is None:
        kind = type(device).__name__
        return Probe(None, 0, f"not a JAX device ({kind}): no PJRT C API to probe")
    if xla_bridge is None:
        return Probe(None, 0, f"{platform}: cannot read JAX's backends ({_XLA_BRIDGE_ERROR})")
    if PjrtApi is None:
        return Probe(None, 0, f"{platform}: native core did not import ({_CORE_ERROR})")

    # The backend JAX made this device's client with, found by identity (no guessing).
    backends = dict(getattr(xla_bridge, "_backends", {}))
    names = [name for name, backend in backends.items() if backend is client]
    if not names:
        return Probe(None, 0, f"{platform}: its client is not one of JAX's backends")
    name = names[0]

    registration = getattr(xla_bridge, "_backend_factories", {}).get(name)
    capsule = getattr(registration, "c_api", None)
    try:
        if capsule is not None:
            api = PjrtApi.from_capsule(capsule)
        else:
            path = _loaded_library(name)
            if path is None:
                return Probe(
                    None, 0, f"{platform}: no PJRT C API plugin table for backend {name!r}"
                )
            api = PjrtApi.from_library(path, already_loaded=True)
    except PjrtError as exc:
        return Probe(None, 0, f"{platform}: PJRT C API table refused: {exc}")
    major, minor = api.version
    found = f"PJRT C API {major}.{minor} via {_plugin_label(api)}"
    pointer, check = _check_client(api, client, name, platform)
    if pointer == 0:
        return Probe(None, 0, f"{found}; {check}")
    return Probe(api, pointer, f"{found}; {check}")


def _check_client(api: Any, client: Any, name: str, platform: str) -> tuple[int, str]:
    """JAX's client pointer if it is a live PJRT_Client of this table (else 0), in words."""
    pointer = getattr(client, "unsafe_client_pointer", None)
    if callable(pointer):
        pointer = pointer()
    if not isinstance(pointer, int):
        return 0, "JAX gives no client pointer (jax < 0.10.1)"
    if pointer == 0:
        return 0, "JAX's client pointer is 0"
    try:
        pjrt_name = api.platform_name(pointer)
    except Exception as exc:
        return 0, f"client pointer check failed ({exc})"
    accepted = {platform, name, getattr(client, "platform", platform)}
    if platform == "gpu":
        accepted |= {"cuda", "rocm"}
    if pjrt_name.lower() not in accepted:
        return 0, f"client pointer check failed (PJRT says {pjrt_name!r}, JAX says {platform!r})"
    return pointer, f"client pointer checked ({pjrt_name})"


def _plugin_label(api: Any) -> str:
    """``jax_plugins.xla_cuda13`` for a jax_plugins package, else the library's file name."""
    path = api.library_path
    if not path:
        return api.source
    parts = os.path.normpath(path).split(os.sep)
    if "jax_plugins" in parts:
        i = parts.index("jax_plugins")
        if i + 2 < len(parts):
            return f"jax_plugins.{parts[i + 1]}"
    return os.path.basename(path)


def _loaded_library(backend_name: str) -> str | None:
    """The path of the backend's plugin library if this process has exactly one mapped."""
    wanted = _LOADED_LIBRARY_NAMES.get(backend_name)
    if not wanted:
        return None
    found = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").partition("/")[2]
                if path and os.path.basename(path) in wanted:
                    found.add("/" + path)
    except OSError:
        return None
    return found.pop() if len(found) == 1 else None
