"""DevicePool: device arrays handed to tpusync as mutable memory — the only arrays it writes.

The ownership contract (written once, here):

* ``DevicePool(array)`` takes ownership of ``array``. From then on the caller reads the current
  array through :attr:`DevicePool.array` and gives back a newer version (e.g. the output of a
  model step that donated the old one) through :meth:`DevicePool.update`. References to older
  versions may be deleted by tpusync at any time.
* Before a raw (native) write, the pool runs a donated identity step on its array and waits for
  it. Donation makes the runtime wait for every computation still reading the buffer, and the
  identity keeps the same device memory, so the write cannot race a reader. The older reference is
  deleted, which is why callers always go through :attr:`array`.
* A pool made with ``donated_steps=True`` skips that identity step when it can prove the pool holds
  the only reference to its array (no other Python reference, no numpy value cached from it) and
  only waits for the array to be computed. The engine promises what tpusync cannot see: every
  computation that reads the array donates it (as model steps that write the KV cache do), so
  none still reads it once it is computed. The write then lands in the same array, which no one
  else can reach. Otherwise the identity step runs as above.
* On the pure-JAX path a write is a donated scatter; the pool swaps in its result.
* Every transfer that touches a pool holds the pool's lock while it runs, so transfers into and out
  of one pool never interleave.
* No other ``jax.Array`` is ever written: a device destination that is not a pool is rejected.
* Blocks being saved are held: while a save still reads a block (see
  :meth:`tpusync.kv.KVCacheStore.save`), a transfer that would write it raises
  :class:`~tpusync.errors.BlocksHeldError` and changes nothing. The engine's own model steps do
  not go through tpusync: it must not write a held block until the save reports ``released``.
* On the CPU backend a new pool first copies its array into memory that XLA allocated: there,
  ``jax.device_put`` of an aligned numpy array shares that array's memory (jax 0.10 does so even
  with ``may_alias=False``), and a raw write must never reach the caller's numpy array. Arrays
  given to :meth:`DevicePool.update` must likewise come from a JAX computation, not from
  ``device_put`` of host memory.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from tpusync._src.memory import fork_guard, huge_pages
from tpusync._src.memory.block_holds import BlockHolds
from tpusync.errors import (
    ArrayDeletedError,
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
)

if TYPE_CHECKING:
    from tpusync._src.memory.torch_tensors import TorchPool

__all__ = ["DevicePool", "check_alive", "device_layout", "start_donation", "wait_for_readers"]


@cache
def _donated_identity(count: int = 1) -> Any:
    """A donated identity over ``count`` arrays: one dispatch waits for the readers of all."""
    return jax.jit(lambda *arrays: arrays, donate_argnums=tuple(range(count)))


class _Holder:
    held: Any = None


def _sole_refcount() -> int:
    """What ``sys.getrefcount(obj.attribute)`` answers when that attribute is the object's only
    reference, on this interpreter (the count of the call's own argument varies by version)."""
    holder = _Holder()
    holder.held = object()
    return sys.getrefcount(holder.held)


# A free-threaded interpreter defers reference counts: a count proves nothing there, so
# donated_steps pools always take the identity step (-1 never matches).
_SOLE_REFCOUNT = _sole_refcount() if getattr(sys, "_is_gil_enabled", lambda: True)() else -1


@cache
def _owned_copy() -> Any:
    return jax.jit(lambda array: jnp.array(array, copy=True))


class DevicePool:
    """A device array (single-device or sharded) that tpusync may write in place.

    Args:
      array: the pool's initial array. tpusync owns it from now on.
      name: a label for errors and metrics.
      donated_steps: the engine donates the array to every computation that reads it (its model
        steps take the pool's array with ``donate_argnums`` and the pool is updated with their
        output). Then a write into the pool skips the donated identity step whenever the pool
        holds the only reference to its array, and waits only for the array to be computed
        (a dispatch less per KV load; decision 0004). Leave it False when anything reads the array
        without donating it: a write could race that read.
    """

    def __init__(
        self, array: jax.Array, *, name: str = "pool", donated_steps: bool = False
    ) -> None:
        if not isinstance(donated_steps, bool):
            raise InvalidArgumentError(
                f"donated_steps: expected True or False, got {donated_steps!r}"
            )
        if not isinstance(array, jax.Array):
            raise InvalidArgumentError(
                f"array: DevicePool takes a jax.Array, got {type(array).__name__}; "
                "use DevicePool.zeros(...) or jax.device_put(...) first"
            )
        fork_guard.check_device_use("array")
        check_alive(array, "array")
        if any(d.platform == "cpu" for d in array.sharding.device_set):
            array = _owned_copy()(array)  # see the module docstring: never alias host memory
            huge_pages.collapse_later(array)  # fewer TLB misses in block copies
        self.name = name
        self._array = array
        self.donated_steps = donated_steps
        self._lock = threading.RLock()
        self._holds = BlockHolds(tuple(int(n) for n in array.shape), name)
        # What an engine found out about the array and keeps for the next transfer (the native
        # engine: why it cannot move it, per device layout; see engine_notes).
        self._engine_notes: dict[str, Any] = {}
        # the devices the pool spans: fixed, since update() keeps the sharding
        self._devices = frozenset(array.sharding.device_set)

    @classmethod
    def zeros(
        cls,
        shape: tuple[int, ...],
        dtype: Any,
        *,
        sharding: jax.sharding.Sharding | None = None,
        name: str = "pool",
        donated_steps: bool = False,
    ) -> DevicePool:
        """A pool of zeros with the given shape, dtype and sharding (default: first device)."""
        fork_guard.check_device_use("DevicePool.zeros")
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        array = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
        return cls(array, name=name, donated_steps=donated_steps)

    @property
    def array(self) -> jax.Array:
        """The pool's current array. Read it again after every transfer or update."""
        with self._lock:
            return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._array.dtype)

    @property
    def sharding(self) -> jax.sharding.Sharding:
        return self._array.sharding

    def update(self, array: jax.Array) -> None:
        """Replaces the pool's array with a newer version of the same shape, dtype and sharding
        (e.g. the output of a step that donated :attr:`array`).

        ``array`` must be a ``jax.Array`` that a JAX computation returned (see the module
        docstring): anything else raises :class:`~tpusync.errors.InvalidArgumentError`, another
        dtype :class:`~tpusync.errors.DtypeMismatchError`, another shape or sharding
        :class:`~tpusync.errors.ShapeMismatchError`; a refused array changes nothing."""
        if not isinstance(array, jax.Array):  # e.g. numpy: it would alias host memory
            raise InvalidArgumentError(
                f"array: DevicePool.update takes a jax.Array that a JAX computation returned, "
                f"got {type(array).__name__}; compute the new array with JAX (e.g. a jitted "
                "step that donates pool.array)"
            )
        fork_guard.check_device_use("array")
        check_alive(array, "array")
        with self._lock:
            old = self._array
            if array.dtype != old.dtype:
                raise DtypeMismatchError(
                    f"array: the pool holds dtype {old.dtype} (shape {old.shape}), got dtype "
                    f"{array.dtype} (shape {array.shape}); a pool's dtype is fixed: cast the "
                    f"array to {old.dtype} first"
                )
            if array.shape != old.shape:
                raise ShapeMismatchError(
                    f"array: the pool holds {old.shape} {old.dtype}, got {array.shape} "
                    f"{array.dtype}; a pool's shape and dtype are fixed"
                )
            if not array.sharding.is_equivalent_to(old.sharding, array.ndim):
                raise ShapeMismatchError(
                    f"array: sharding {array.sharding} differs from the pool's {old.sharding}; "
                    "reshard it to the pool's sharding first"
                )
            self._array = array

    def hold_blocks(self, block_ids: Any, block_axis: int = 0) -> None:
        """Marks blocks as being read by a save: transfers refuse to write them until
        :meth:`release_blocks` (holds are counted; each hold is released once)."""
        self._holds.hold(block_ids, block_axis)

    def release_blocks(self, block_ids: Any, block_axis: int = 0) -> None:
        """Drops one hold from each block (the save no longer reads it); a block without a
        hold stays without one."""
        self._holds.release(block_ids, block_axis)

    def held_blocks(self, block_axis: int = 0) -> list[int]:
        """The blocks a save still reads (sorted)."""
        return self._holds.held(block_axis)

    def check_writable(self, block_ids: np.ndarray, block_axis: int, argument: str) -> None:
        """Raises BlocksHeldError when a transfer would write a held block (``block_ids`` were
        checked against the pool)."""
        self._holds.check_writable(block_ids, block_axis, argument)

    def _writable_in_place(self) -> bool:
        """Whether a raw write may skip the identity step (see ``donated_steps``): the pool's
        attribute is the array's only reference and no numpy value was cached from it (that
        value may share the buffer). Call with the lock held: nothing can take a reference then."""
        return (
            self.donated_steps
            and sys.getrefcount(self._array) == _SOLE_REFCOUNT
            and getattr(self._array, "_npy_value", self) is None  # unknown: not proven
        )

    def __repr__(self) -> str:
        return (
            f"DevicePool(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
            f"sharding={self.sharding})"
        )


# What the engines and the transfer layer use of a pool beside its public API; this module is
# the one place outside the class that touches its fields.


def current_array(pool: DevicePool) -> jax.Array:
    """The pool's array now, without taking its lock (call with the lock held, or where a
    stale read is harmless)."""
    return pool._array


def replace_array(pool: DevicePool, array: jax.Array) -> None:
    """Swaps in the result of a donated pure-JAX write. Call with the pool's lock held."""
    pool._array = array


def lock_of(pool: DevicePool | TorchPool) -> threading.RLock:
    """The lock a transfer that reads or writes the pool holds (one per pool)."""
    return pool._lock


def devices_of(pool: DevicePool) -> frozenset[Any]:
    """The devices the pool spans (fixed: update() keeps the sharding)."""
    return pool._devices


def engine_notes(pool: DevicePool) -> dict[str, Any]:
    """What engines keep about the pool's array between transfers (their own keys)."""
    return pool._engine_notes


def device_layout(array: jax.Array) -> Any:
    """The array's PJRT device layout, comparable by value, or None where JAX does not offer
    it (then nothing may be concluded from it)."""
    try:
        return getattr(array, "_pjrt_layout", None)  # private; cheaper than Array.format (0004)
    except Exception:  # e.g. UNIMPLEMENTED on some backends
        return None


def check_alive(array: jax.Array, argument: str) -> None:
    """Raises ArrayDeletedError (naming ``argument``) when ``array`` was deleted or donated."""
    if array.is_deleted():
        raise ArrayDeletedError(
            f"{argument}: this jax.Array was deleted or donated; pass the array that the "
            "donating computation returned (for a DevicePool, read pool.array again)"
        )


def _check_not_forked(pools: Sequence[DevicePool]) -> None:
    """Every raw or JAX write into a pool starts here: refused in a child forked after JAX
    started (see tpusync._src.memory.fork_guard), before any device call."""
    if fork_guard.jax_forked_from is not None and pools:
        fork_guard.check_device_use(f"DevicePool {pools[0].name!r}")


def start_donation(pools: Sequence[DevicePool]) -> None:
    """Dispatches the donated identity step of several pools, one dispatch per set of devices
    (a jitted call spans one), and swaps in its results without waiting: each new array becomes
    ready once every reader of the old one is done (see :func:`wait_for_readers`). Pools
    writable in place (``donated_steps``) keep their array. Call with the pools' locks held, and
    hold them until the results were waited for and written."""
    _check_not_forked(pools)
    groups: dict[frozenset[Any], list[DevicePool]] = {}
    for pool in pools:
        if not pool._writable_in_place():  # those only wait for their array's definition
            groups.setdefault(pool._devices, []).append(pool)
    for group in groups.values():
        arrays = _donated_identity(len(group))(*(pool._array for pool in group))
        for pool, array in zip(group, arrays, strict=True):
            pool._array = array


def wait_for_readers(pools: Sequence[DevicePool], *, started: bool = False) -> None:
    """The donated identity step of several pools, waited for: their readers are waited for
    concurrently (for a pool writable in place, the computation of its array only). With
    ``started``, :func:`start_donation` was already called for them (work done in between
    overlaps the wait). Call with the pools' locks held."""
    _check_not_forked(pools)
    if not started:
        start_donation(pools)
    for pool in pools:
        pool._array.block_until_ready()
