"""PyTorch tensors as transfer sides, without tpusync importing torch.

A tensor can only be passed where its module is loaded, so the checks read ``sys.modules``
instead of importing torch (an optional dependency: the main environment has none).

* A CPU tensor is host memory: it is moved as raw bytes through a numpy view of its own memory
  (:func:`host_view`; strided views keep their strides). ``bfloat16`` and the ``float8`` types
  get the ml_dtypes numpy types JAX uses, so a tensor and a JAX array of the same dtype meet.
* A tensor is written only through a :class:`TorchPool`, with the ownership rule of
  :class:`~tpusync.DevicePool`: the pool's lock is held by every transfer that touches it, and
  blocks a save still reads are refused as destinations (:class:`~tpusync.errors.BlocksHeldError`).
  The pool remembers where the tensor's memory was: a tensor resized or re-pointed since
  (``resize_``, ``set_``) is refused, never written at its old address.
* CUDA tensors are not moved yet: no native path for them has been proven on GPU hardware
  (they are refused by name, with the way around).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

from tpusync._native import core as _core
from tpusync._src.memory.block_holds import BlockHolds
from tpusync.errors import InvalidArgumentError, UnsupportedTensorError

__all__ = ["TORCH_DTYPES", "TorchPool", "host_view", "is_tensor"]

# torch dtype name -> the numpy dtype its bytes are moved as
TORCH_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(jnp.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn),
    "float8_e5m2": np.dtype(jnp.float8_e5m2),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
_SAME_SIZE_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.Tensor`` (False wherever torch is not loaded)."""
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def check_tensor(tensor: Any, argument: str, *, destination: bool) -> np.dtype:
    """The numpy dtype ``tensor`` moves as; refuses what cannot be moved as its own bytes."""
    if tensor.is_conj() or tensor.is_neg():
        raise UnsupportedTensorError(
            f"{argument}: this tensor's conjugate or negation is pending (a lazy view); call "
            ".resolve_conj() / .resolve_neg() first"
        )
    name = _dtype_name(tensor)
    if name not in TORCH_DTYPES:
        raise UnsupportedTensorError(
            f"{argument}: torch dtype {name} is not moved by tpusync; supported: "
            f"{', '.join(TORCH_DTYPES)}"
        )
    if tensor.layout is not _torch().strided:
        raise UnsupportedTensorError(
            f"{argument}: a {tensor.layout} tensor has no plain memory to move; pass a dense "
            "tensor (.to_dense())"
        )
    device = tensor.device.type
    if device != "cpu":
        raise UnsupportedTensorError(
            f"{argument}: a {device} tensor; tpusync moves CPU tensors only until a native path "
            "for device tensors is proven on that hardware. Pass it to JAX with "
            "jax.dlpack.from_dlpack(tensor) and transfer the jax.Array"
        )
    if destination and tensor.requires_grad:
        raise UnsupportedTensorError(
            f"{argument}: this tensor requires grad; autograd would not see tpusync's writes. "
            "Pass tensor.detach() (it shares the memory)"
        )
    return TORCH_DTYPES[name]


def host_view(tensor: Any, argument: str, *, destination: bool = False) -> np.ndarray:
    """A numpy view of a CPU tensor's own memory (same shape, strides and bytes)."""
    dtype = check_tensor(tensor, argument, destination=destination)
    torch = _torch()
    plain = tensor.detach()
    if dtype == np.bool_:
        view = plain.numpy()
    else:
        same_size = getattr(torch, _SAME_SIZE_INT[dtype.itemsize])
        view = plain.view(same_size).numpy().view(dtype)
    if view.size and view.ctypes.data != tensor.data_ptr():
        raise InvalidArgumentError(f"{argument}: numpy did not see the tensor's own memory")
    return view


class TorchPool:
    """A torch tensor handed to tpusync as memory it may write (a transfer destination).

    The rule of :class:`~tpusync.DevicePool`: every transfer that touches the pool holds its
    lock, so transfers into and out of one pool never interleave; blocks held by a save
    (:meth:`hold_blocks`) are refused as destinations until released. Other code may keep
    reading and writing the tensor; tpusync writes it in place, at the address it had when the
    pool was made.

    Raises :class:`~tpusync.errors.UnsupportedTensorError` for what cannot be written as raw
    memory (a CUDA tensor for now, a dtype outside :data:`TORCH_DTYPES`, sparse, a pending
    conjugate, a tensor that requires grad).
    """

    def __init__(self, tensor: Any, name: str | None = None) -> None:
        if not is_tensor(tensor):
            raise InvalidArgumentError(
                f"tensor: expected a torch.Tensor, got {type(tensor).__name__}"
            )
        self._dtype = check_tensor(tensor, "tensor", destination=True)
        self._tensor = tensor
        self._where = self._address(tensor)
        self.name = name or f"torch{tuple(tensor.shape)}"
        self._lock = threading.RLock()
        self._holds = BlockHolds(self.shape, self.name)

    @staticmethod
    def _address(tensor: Any) -> tuple[Any, ...]:
        return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    @property
    def tensor(self) -> Any:
        """The tensor (tpusync writes it in place)."""
        return self._tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self._tensor.shape)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype the tensor's bytes move as."""
        return self._dtype

    def in_place(self) -> bool:
        """Whether the tensor still has the memory, shape and strides the pool was made with
        (a plan kept for the pool, e.g. by a HostPool, stays valid while it does)."""
        return self._address(self._tensor) == self._where

    def host_view(self, argument: str = "dst") -> np.ndarray:
        """A writable numpy view of the tensor's memory; refuses a tensor that was resized or
        re-pointed since the pool was made."""
        if not self.in_place():
            raise InvalidArgumentError(
                f"{argument}: the pool's tensor was resized or re-pointed (resize_, set_) since "
                "the TorchPool was made; make a new TorchPool for it"
            )
        return host_view(self._tensor, argument, destination=True)

    def hold_blocks(self, block_ids: Any, block_axis: int = 0) -> None:
        """See :meth:`tpusync.DevicePool.hold_blocks`."""
        self._holds.hold(block_ids, block_axis)

    def release_blocks(self, block_ids: Any, block_axis: int = 0) -> None:
        """See :meth:`tpusync.DevicePool.release_blocks`."""
        self._holds.release(block_ids, block_axis)

    def held_blocks(self, block_axis: int = 0) -> list[int]:
        """The blocks a save still reads (sorted)."""
        return self._holds.held(block_axis)

    def check_writable(self, block_ids: np.ndarray, block_axis: int, argument: str) -> None:
        self._holds.check_writable(block_ids, block_axis, argument)

    def __repr__(self) -> str:
        return f"TorchPool({self.name!r}, shape={self.shape}, dtype={self._dtype})"


def prefault_cpu_tensors(tensors: Any) -> int:
    """Maps every page of the CPU memory under ``tensors`` for writing (each distinct storage
    once; contents unchanged; other devices' tensors are left alone), so that the first load
    into an engine's KV block does not pay the page faults of memory the engine allocated but
    never touched. Call it before the engine uses the tensors. Returns the bytes mapped."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        address, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        storages[address] = max(nbytes, storages.get(address, 0))
    for address, nbytes in storages.items():
        _core.populate_range(address, nbytes)
    return sum(storages.values())
