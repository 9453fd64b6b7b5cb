"""Type stub of the native convert module (src/tpusync/_native/convert.pyx)."""

import numpy as np

KINDS: dict[str, int]
SOURCES: tuple[str, ...]

def convert(src: np.ndarray, dst: np.ndarray, factors: np.ndarray) -> None: ...
def channel_amax(src: np.ndarray, amax: np.ndarray) -> None: ...
