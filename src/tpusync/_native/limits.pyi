"""Type stub of the native limits module (src/tpusync/_native/limits.pyx)."""

import numpy as np

COPY_METHODS: dict[str, int]

def have_streaming() -> bool: ...
def copy_seconds(
    dst: np.ndarray, src: np.ndarray, threads: int, method: str, repeats: int
) -> list[float]: ...
def tcp_seconds(
    streams: int,
    nbytes: int,
    warm_bytes: int,
    chunk: int,
    sndbuf: int,
    repeats: int,
    lowat: int = 0,
    sender_cpu: int = -1,
    receiver_cpu: int = -1,
) -> list[float]: ...
