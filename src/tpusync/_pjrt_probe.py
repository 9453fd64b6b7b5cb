"""What the PJRT C API of a plugin backend offers tpusync (read at run time, never assumed)."""

from __future__ import annotations

from typing import Any


def describe_backend(device: Any) -> str:
    """One line on a non-CPU backend's PJRT C API and the path its devices get."""
    platform = device.platform
    return (
        f"{platform}: native PJRT copies are not yet enabled for this backend "
        "(not yet proven on hardware): pure JAX"
    )
