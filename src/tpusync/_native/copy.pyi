"""Type stub of the native copy module (src/tpusync/_native/copy.pyx)."""

import numpy as np

class CopyEngine:
    threads: int
    min_parallel_bytes: int
    def __init__(self, threads: int, min_parallel_bytes: int = ...) -> None: ...
    def copy(self, segments: np.ndarray) -> int: ...
    def copy_hashed(self, segments: np.ndarray) -> np.ndarray: ...
    def hash(self, segments: np.ndarray) -> np.ndarray: ...

def block_segments(
    src_outer: np.ndarray,
    src_block_stride: int,
    dst_outer: np.ndarray,
    dst_block_stride: int,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    nbytes: int,
    merge: bool = ...,
) -> np.ndarray: ...

class BlockRows:
    n_rows: int
    n_pairs: int
    def __init__(
        self,
        pair_of_row: np.ndarray,
        src_rel: np.ndarray,
        src_step: np.ndarray,
        dst_rel: np.ndarray,
        dst_step: np.ndarray,
        nbytes: np.ndarray,
        n_pairs: int,
    ) -> None: ...
    def rows(
        self, pair_bases: np.ndarray, src_blocks: np.ndarray, dst_blocks: np.ndarray
    ) -> np.ndarray: ...

def table_bounds(table: np.ndarray) -> tuple[int, int, int, int]: ...
def openmp_install(parallel: int, thread_num: int, num_threads: int) -> None: ...
def openmp_installed() -> bool: ...
def openmp_here(on: bool) -> bool: ...
