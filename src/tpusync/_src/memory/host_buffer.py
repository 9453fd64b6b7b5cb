"""Page-aligned host memory with a zero-copy numpy view: the host side of transfers."""

from __future__ import annotations

from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.memory.deferred_refs import close_releasing_deferred_views
from tpusync._src.memory.dma import offer_for_dma
from tpusync.errors import InvalidArgumentError

__all__ = ["HostBuffer"]


class HostBuffer:
    """Page-aligned, prefaulted host memory holding one array.

    ``HostBuffer((num_blocks, block_size, heads, dim), "bfloat16")`` maps anonymous memory,
    touches every page once (so transfers do not pay page faults), and exposes it as
    :attr:`array`, a writable numpy view that shares the memory (no copy). Pass the buffer or any
    view of :attr:`array` to :func:`tpusync.transfer`.

    On the CPU backend no registration is needed: device memory is host memory. Registration
    with an accelerator's DMA engine (PJRT ``DmaMap``) belongs to the PJRT native path, which
    is not enabled on any accelerator yet (:func:`tpusync.info` gives each device's path).

    ``huge_pages`` (default on) advises transparent huge pages before the pages are touched:
    scattered block copies then miss the TLB far less.

    The memory lives until :meth:`close` (which refuses while other views of it are alive) or
    until the buffer and every view are collected.
    """

    def __init__(
        self,
        shape: int | tuple[int, ...],
        dtype: Any,
        *,
        populate: bool = True,
        huge_pages: bool = True,
    ) -> None:
        shape_tuple = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        if not all(isinstance(d, int | np.integer) and d >= 0 for d in shape_tuple):
            raise InvalidArgumentError(f"shape: expected non-negative integers, got {shape!r}")
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidArgumentError(
                f"dtype: {dtype!r} is not a numpy/ml_dtypes dtype (e.g. 'bfloat16', np.float32)"
            ) from exc
        if np_dtype.hasobject or np_dtype.itemsize == 0:
            raise InvalidArgumentError(
                f"dtype: {np_dtype} cannot live in raw host memory; use a numeric dtype"
            )
        nbytes = int(np.prod(shape_tuple, dtype=np.int64)) * np_dtype.itemsize
        self._mapping = _core.Mapping(max(nbytes, 1), populate=populate, huge_pages=huge_pages)
        offer_for_dma(self._mapping)  # registered on first use by a PJRT device
        self._array: np.ndarray | None = np.frombuffer(
            self._mapping, dtype=np_dtype, count=nbytes // np_dtype.itemsize
        ).reshape(shape_tuple)

    @property
    def array(self) -> np.ndarray:
        """The writable numpy view of the memory (zero-copy)."""
        if self._array is None:
            raise InvalidArgumentError("this HostBuffer is closed; create a new one")
        return self._array

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def address(self) -> int:
        """Address of the first byte; always a multiple of the page size."""
        return int(self._mapping.address)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy:
            return np.array(self.array, dtype=dtype, copy=True)
        return self.array if dtype is None else self.array.astype(dtype, copy=False)

    def close(self) -> None:
        """Frees the memory now. Raises ``BufferError`` (and stays usable) while views other
        than :attr:`array` are alive; unusable afterwards."""
        if self._array is None:
            return
        shape, dtype = self._array.shape, self._array.dtype
        self._array = None
        try:
            close_releasing_deferred_views(self._mapping.close)
        except BufferError:
            count = int(np.prod(shape, dtype=np.int64))
            self._array = np.frombuffer(self._mapping, dtype=dtype, count=count).reshape(shape)
            raise

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._array is None:
            return "HostBuffer(closed)"
        return f"HostBuffer(shape={self.shape}, dtype={self.dtype}, address=0x{self.address:x})"
