"""Chooses the engine that runs a batch: the one place that chooses (info() reads it too).

``path="auto"`` takes the first engine of :data:`ENGINES` that can serve every side of every
pair (the native engine where it runs, else pure JAX, which runs everywhere); ``path=NAME``
takes that engine or raises :class:`~tpusync.errors.NativePathUnavailableError` saying why
not. Engines never import this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tpusync._src.engines import native, pure_jax
from tpusync._src.engines.base import Engine, Move
from tpusync._src.engines.devices import DevicePath, device_path
from tpusync.errors import NativePathUnavailableError

__all__ = ["ENGINES", "PATHS", "Path", "choose_engine", "device_choice"]

Path = Literal["auto", "native", "jax"]
# in order of preference for path="auto"; the last one runs everywhere
ENGINES: dict[str, Engine] = {"native": native.ENGINE, "jax": pure_jax.ENGINE}
PATHS: tuple[str, ...] = ("auto", *ENGINES)


def choose_engine(moves: Sequence[Move], path: str) -> Engine:
    """The engine that runs ``moves`` for ``path`` (one of :data:`PATHS`, checked by the
    caller)."""
    if path != "auto":
        engine = ENGINES[path]
        reasons = _reasons(engine, moves, explicit=True)
        if reasons:
            raise NativePathUnavailableError(
                f"path={path!r} cannot run here: " + "; ".join(reasons) + ". Use path='auto'."
            )
        return engine
    *preferred, fallback = ENGINES.values()
    for engine in preferred:
        if not _reasons(engine, moves, explicit=False):
            return engine
    return fallback


def _reasons(engine: Engine, moves: Sequence[Move], *, explicit: bool) -> list[str]:
    return [reason for move in moves for reason in engine.unavailable(move, explicit=explicit)]


def device_choice(device: Any) -> DevicePath:
    """The engine ``path="auto"`` gives a device, and why, in words (what info() reports)."""
    return device_path(device)
