"""Type stub of the native socket module (src/tpusync/_native/net.pyx)."""

from typing import Any

import numpy as np

FRAME_HEADER_BYTES: int
FRAMES_DONE: int
FRAMES_HEADER: int
FRAMES_TIMEOUT: int
FRAMES_SILENT: int

def send_all(fd: int, buffers: list[Any], timeout_s: float, budget_s: float = ...) -> int: ...
def recv_exact(fd: int, buffer: Any, timeout_s: float, hasher: PieceHasher | None = ...) -> int: ...
def _set_recv_step(nbytes: int) -> int: ...
def _set_rcvlowat_max(nbytes: int) -> None: ...

class PieceHasher:
    digests: np.ndarray
    def __init__(self, offsets: np.ndarray, lengths: np.ndarray) -> None: ...
    @property
    def position(self) -> int: ...
    @property
    def complete(self) -> bool: ...
    def feed(self, data: Any) -> None: ...

def block_frame_headers(
    request_id: int,
    keys: list[bytes],
    fingerprint: bytes,
    payload_length: int,
    checksums: np.ndarray,
    scheme: int,
) -> bytes: ...

class FrameReceiver:
    index: int
    results: np.ndarray
    bytes_received: int
    bytes_read: int
    def __init__(
        self,
        fd: int,
        expected_headers: bytes,
        addresses: np.ndarray | None,
        checksums: np.ndarray,
        payload_length: int,
        offsets: np.ndarray,
        lengths: np.ndarray,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None: ...
    @property
    def header(self) -> bytes: ...
    def resume(self, index: int) -> None: ...
    def run(self, budget_s: float, silence_s: float) -> int: ...
