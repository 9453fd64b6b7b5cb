"""The tpusync exception tree: one root, subclasses that also inherit the matching builtin."""

from __future__ import annotations

__all__ = [
    "ArrayDeletedError",
    "BlockIndexError",
    "DtypeMismatchError",
    "InvalidArgumentError",
    "NativePathUnavailableError",
    "NotAPoolError",
    "ReadOnlyDestinationError",
    "ShapeMismatchError",
    "TpuSyncError",
    "TransferFailedError",
    "TransferTimeoutError",
    "WrongDeviceError",
]


class TpuSyncError(Exception):
    """Root of every error tpusync raises on purpose."""


class InvalidArgumentError(TpuSyncError, ValueError):
    """An argument has the wrong type or value; the message names it and the fix."""


class DtypeMismatchError(InvalidArgumentError):
    """Source and destination hold different dtypes."""


class ShapeMismatchError(InvalidArgumentError):
    """Source and destination blocks have different shapes, or a layout is not supported."""


class BlockIndexError(TpuSyncError, IndexError):
    """A block index is out of range, or destination blocks repeat."""


class ReadOnlyDestinationError(TpuSyncError, PermissionError):
    """The destination cannot be written (a read-only numpy array, or a plain jax.Array)."""


class NotAPoolError(ReadOnlyDestinationError):
    """A device destination is not a :class:`tpusync.DevicePool`; only pools are written."""


class ArrayDeletedError(InvalidArgumentError):
    """A jax.Array was deleted or donated before the transfer started."""


class WrongDeviceError(InvalidArgumentError):
    """An array lives on a device this transfer cannot use (e.g. not addressable here)."""


class NativePathUnavailableError(TpuSyncError, RuntimeError):
    """``path="native"`` was asked for where the native path does not run; the message says why."""


class TransferFailedError(TpuSyncError, RuntimeError):
    """A transfer failed while moving bytes; the cause is chained."""


class TransferTimeoutError(TpuSyncError, TimeoutError):
    """A transfer did not finish within the given timeout."""
