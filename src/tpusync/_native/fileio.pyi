"""Type stub of the native file I/O module (src/tpusync/_native/fileio.pyx)."""

import numpy as np

MAX_IOVS_PER_RUN: int

def file_runs(
    fds: np.ndarray,
    offsets: np.ndarray,
    first_iov: np.ndarray,
    iov_counts: np.ndarray,
    addresses: np.ndarray,
    lengths: np.ndarray,
    write: bool,
    threads: int,
    stop_on_error: bool,
) -> np.ndarray: ...
