"""The tpusync exception tree: one root, subclasses that also inherit the matching builtin."""

from __future__ import annotations

__all__ = [
    "ArrayDeletedError",
    "AuthenticationError",
    "BlockIndexError",
    "BlocksHeldError",
    "BlocksMissingError",
    "CircuitOpenError",
    "DeadlineExceededError",
    "DtypeMismatchError",
    "FrameError",
    "InvalidArgumentError",
    "JaxForkError",
    "NamespaceMismatchError",
    "NativePathUnavailableError",
    "NotAPoolError",
    "PeerUnavailableError",
    "PlotUnavailableError",
    "PoolBusyError",
    "PoolClosedError",
    "PoolFormatError",
    "ReadOnlyDestinationError",
    "RegistryUnavailableError",
    "RemoteOperationUnsupportedError",
    "ServerFailedError",
    "SessionNotFoundError",
    "ShapeMismatchError",
    "StaleHandleError",
    "StructureChangedError",
    "TierFullError",
    "TierIOError",
    "TpuSyncError",
    "TransferFailedError",
    "TransferTimeoutError",
    "UnsafeFileError",
    "UnsupportedTensorError",
    "VersionUnavailableError",
    "WeightSyncError",
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


class PoolBusyError(TpuSyncError, RuntimeError):
    """A named pool is owned by another live process (one writer at a time)."""


class PoolFormatError(TpuSyncError, ValueError):
    """A pool or slab file is not a tpusync pool of a version this build reads."""


class TierFullError(TpuSyncError, MemoryError):
    """A tier has no room: too few free slots, or /dev/shm or the disk is too small."""


class BlocksHeldError(TpuSyncError, RuntimeError):
    """A transfer would write device blocks that a save is still reading."""


class StaleHandleError(InvalidArgumentError):
    """A lookup handle was already loaded or released, or belongs to another store."""


class NamespaceMismatchError(InvalidArgumentError):
    """A namespace names another model, block layout or shard than the store serves."""


class SessionNotFoundError(TpuSyncError, KeyError):
    """No offloaded session has this id (never offloaded, restored, or dropped)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class BlocksMissingError(TpuSyncError, KeyError):
    """Some requested blocks were not served: absent, or failed their checksum (a miss).

    ``loaded`` is a boolean mask over the requested keys: the blocks marked True were loaded
    and verified; the others must be recomputed. ``corrupt`` counts checksum failures.
    """

    def __init__(self, message: str, loaded: list[bool], corrupt: int = 0) -> None:
        super().__init__(message)
        self.loaded = loaded
        self.corrupt = corrupt

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnsafeFileError(TpuSyncError, PermissionError):
    """A tier's file or directory is not safe to use: not a regular file (a FIFO, a device, a
    directory where a file belongs), owned by another user, or writable by others. The message
    names the path and how to fix it."""


class TierIOError(TpuSyncError, OSError):
    """A tier's file could not be written or read (e.g. the filesystem is full); the message
    names the path and the cause (chained)."""


class JaxForkError(TpuSyncError, RuntimeError):
    """A device call in a process forked after JAX had started (JAX does not survive
    ``fork()``); the message says how to start the child instead. Host-side calls work there."""


# -- across hosts (tpusync.cluster re-exports these where they were defined before) -------------


class AuthenticationError(TpuSyncError, PermissionError):
    """The other end of a registry connection does not know the shared secret."""


class FrameError(TpuSyncError, ValueError):
    """Bytes that are not a valid block frame header of a version this build reads; the message
    names the field, ``reason`` is a short tag for counting (``"length"``, ``"magic"``,
    ``"version"``, ``"crc"``, ``"type"``, ``"reserved"``, ``"payload"``, ``"key"``,
    ``"checksum"``)."""

    def __init__(self, message: str, reason: str = "format") -> None:
        super().__init__(message)
        self.reason = reason


class PeerUnavailableError(TpuSyncError, ConnectionError):
    """A block server cannot be reached, failed the handshake or did not answer; the cause is
    chained."""


class CircuitOpenError(PeerUnavailableError):
    """The peer failed recently and its circuit is open: the request was not sent. A probe goes
    through after a back-off (``tpusync.cluster.PeerCircuits``) and closes it again."""


class DeadlineExceededError(TpuSyncError, TimeoutError):
    """A pull or push across hosts did not finish before its absolute deadline: the lease's
    (which only a granted renewal moves on) or the operation's own limit, which nothing moves
    (``BlockClient(max_pull_s=...)``, ``max_push_s``); the message names the option that set
    it. A peer that stalls or trickles cannot hold an operation past it; the peer's circuit
    opens (a missed deadline)."""


class RegistryUnavailableError(TpuSyncError, ConnectionError):
    """The registry cannot be reached or did not answer (connection refused or lost, timeout,
    a server-side failure); the cause is chained."""


class ServerFailedError(TpuSyncError, RuntimeError):
    """A tpusync server of this process stopped accepting connections because one of its loops
    kept dying (a bug, logged with its traceback); the message names the loop and says to
    restart the process (or make a new server)."""


class RemoteOperationUnsupportedError(TpuSyncError, NotImplementedError):
    """The remote tier does not offer this operation (yet): it is read-only."""


class PoolClosedError(InvalidArgumentError):
    """A pool was used after its ``close()`` (a ValueError, as for a closed file): its
    contents, counts and I/O are gone with it. The message names the pool; open it again."""


class PlotUnavailableError(TpuSyncError, ImportError):
    """A plot was asked for (``--plot``) but matplotlib is not installed; the message names the
    extra that installs it."""


class UnsupportedTensorError(InvalidArgumentError):
    """A PyTorch tensor tpusync cannot move as raw memory (a device it has no proven path for,
    an unsupported dtype, a sparse tensor, a pending conjugate); the message names the way
    around."""


class WeightSyncError(TpuSyncError, RuntimeError):
    """A weights pull failed (a chunk that failed its checksum twice, a publisher that went
    away, a deadline); the message says what failed. The committed version is untouched."""


class VersionUnavailableError(WeightSyncError, LookupError):
    """The asked weights version is not published (yet) or no longer retained; the message
    names the versions the publisher keeps."""


class StructureChangedError(WeightSyncError):
    """A newer weights version has another structure than the subscriber's target (a leaf
    added, removed, reshaped or of another dtype): ``version`` is that version and
    ``structure`` what it looks like (a :class:`tpusync.weights.PublishedStructure`, whose
    ``target(mesh)`` builds the target of a new subscriber)."""

    def __init__(self, message: str, *, version: int, structure: object) -> None:
        super().__init__(message)
        self.version = version
        self.structure = structure
