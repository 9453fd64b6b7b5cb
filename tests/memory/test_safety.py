"""Device-memory safety: the rules of the DevicePool contract, raced for real.

Each race runs many rounds with the rule in place and must never corrupt; a companion test
drops the rule (monkeypatching the one function that implements it) and must see corruption,
which proves the race really overlaps and the check can fail.
"""

from __future__ import annotations

import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpusync
from tpusync._native import core as _core
from tpusync._src.engines import native
from tpusync._src.memory import device_pool
from tpusync._src.memory.device_pool import DevicePool
from tpusync.errors import TransferFailedError

ROUNDS = 12
ROWS, COLS = 256, 64 * 1024  # 64 MiB of float32


@jax.jit
def _slow_reader(x: jax.Array) -> jax.Array:
    """Reads the whole pool many times; its result changes if the pool changes underneath."""

    def body(i: int, acc: jax.Array) -> jax.Array:
        return acc + jnp.sum(x * (i + 1).astype(x.dtype), axis=1)

    return jax.lax.fori_loop(0, 8, body, jnp.zeros(x.shape[0], x.dtype))


def _write_race_corruptions(rounds: int) -> int:
    before = np.full((ROWS, COLS), 1.0, np.float32)
    after = tpusync.HostBuffer((ROWS, COLS), np.float32)
    after.array[...] = 3.0
    expected = np.asarray(_slow_reader(jnp.asarray(before)))
    corrupted = 0
    for _ in range(rounds):
        pool = DevicePool(jax.device_put(before, may_alias=False))
        reading = _slow_reader(pool.array)  # dispatched, still running
        tpusync.transfer(after, pool, path="native").result(timeout=30)
        if not np.array_equal(np.asarray(reading), expected):
            corrupted += 1
        assert np.all(np.asarray(pool.array) == 3.0)  # the write itself landed
    after.close()
    return corrupted


def test_raw_write_waits_for_readers_of_the_pool() -> None:
    assert _write_race_corruptions(ROUNDS) == 0


def test_write_race_detects_a_missing_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    def only_wait_for_the_arrays(pools: list[DevicePool]) -> None:
        for pool in pools:  # waits for the writer of each array, not for its readers
            pool._array.block_until_ready()

    monkeypatch.setattr(native, "wait_for_readers", only_wait_for_the_arrays)
    assert _write_race_corruptions(ROUNDS) > 0


# Reads its input, so that JAX keeps the donation and XLA writes the output in place.
_donating_overwrite = jax.jit(lambda x: x * 0.0 + 7.0, donate_argnums=0)


def _read_race_corruptions(rounds: int, monkeypatch: pytest.MonkeyPatch, pin: bool) -> int:
    data = np.random.default_rng(7).standard_normal((ROWS, COLS), dtype=np.float32)
    host = tpusync.HostBuffer((ROWS, COLS), np.float32)
    original_pin = native._pin_buffer
    pinned = threading.Event()

    def pin_and_signal(buffer: jax.Array) -> object:
        capsule = original_pin(buffer) if pin else None
        buffer.block_until_ready()
        pinned.set()
        return capsule

    monkeypatch.setattr(native, "_pin_buffer", pin_and_signal)
    corrupted = 0
    for _ in range(rounds):
        source = jax.device_put(data, may_alias=False)
        host.array[...] = 0.0
        pinned.clear()
        future = tpusync.transfer(source, host, path="native")
        assert pinned.wait(timeout=30)
        replaced = _donating_overwrite(source)  # the caller donates while the read runs
        try:
            future.result(timeout=30)
            torn = not np.array_equal(host.array, data)
        except TransferFailedError:
            if pin:
                raise
            torn = True  # unpinned, the buffer went before the copy took its address
        replaced.block_until_ready()
        assert np.all(np.asarray(replaced) == 7.0)
        corrupted += torn
    host.close()
    return corrupted


def test_raw_read_keeps_donated_buffer_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _read_race_corruptions(ROUNDS, monkeypatch, pin=True) == 0


def test_read_race_detects_a_missing_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _read_race_corruptions(ROUNDS, monkeypatch, pin=False) > 0


# --- donated_steps: the engine's steps donate the pool; writes skip the identity step ---------


# A model step as the contract expects it: it donates the pool and returns its next version,
# written (in place, the donated buffer) only after a long read of the whole pool.
_slow_donating_step = jax.jit(lambda x: x + 0.0 * _slow_reader(x)[:, None], donate_argnums=0)


def _step_race(rounds: int) -> tuple[int, int]:
    """Writes into a donated_steps pool right after a slow step was dispatched on it; returns
    (rounds whose write was lost, rounds whose step still ran when the write began). The write
    must wait for the step that computes the array, or the step's output overwrites it."""
    written = tpusync.HostBuffer((ROWS, COLS), np.float32)
    written.array[...] = 3.0
    lost = running = 0
    for _ in range(rounds):
        pool = DevicePool(jax.device_put(np.ones((ROWS, COLS), np.float32)), donated_steps=True)
        pool.update(_slow_donating_step(pool.array))  # dispatched, still running
        running += not pool._array.is_ready()
        tpusync.transfer(written, pool, path="native").result(timeout=30)
        if not np.all(np.asarray(pool.array) == 3.0):
            lost += 1
    written.close()
    return lost, running


def _count_identity_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    identity = device_pool._donated_identity

    def counted(count: int = 1) -> object:
        calls.append(count)
        return identity(count)

    monkeypatch.setattr(device_pool, "_donated_identity", counted)
    return calls


def test_donated_steps_write_waits_for_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    identity_steps = _count_identity_steps(monkeypatch)
    lost, running = _step_race(ROUNDS)
    assert lost == 0
    assert running > 0  # the race is real: writes began while the step ran
    assert identity_steps == []  # every write took the in-place path


def _written_pool(rng: np.random.Generator) -> tuple[DevicePool, np.ndarray, tpusync.HostBuffer]:
    before = rng.standard_normal((64, 256), dtype=np.float32)
    pool = DevicePool(jax.device_put(before), donated_steps=True)
    pool.update(_slow_donating_step(pool.array))  # a step's output, held by the pool alone
    source = tpusync.HostBuffer((64, 256), np.float32)
    source.array[...] = rng.standard_normal((64, 256), dtype=np.float32)
    return pool, np.asarray(pool.array).copy(), source


def test_donated_steps_writes_the_same_array_in_place(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity_steps = _count_identity_steps(monkeypatch)
    pool, _, source = _written_pool(rng)
    array = weakref.ref(pool._array)  # weak: a strong reference would rule the path out
    tpusync.transfer(source, pool, path="native").result(timeout=30)
    assert array() is pool._array and identity_steps == []
    np.testing.assert_array_equal(np.asarray(pool.array), source.array)
    source.close()


def test_donated_steps_never_changes_an_array_someone_holds(rng: np.random.Generator) -> None:
    """Another reference to the array, or a numpy value read from it, rules the in-place write
    out: the identity step runs, as for any pool, and what was read stays as it was."""
    pool, before, source = _written_pool(rng)
    held = pool.array
    tpusync.transfer(source, pool, path="native").result(timeout=30)
    assert held.is_deleted() and pool.array is not held
    np.testing.assert_array_equal(np.asarray(pool.array), source.array)

    del held
    read = np.asarray(pool.array)  # cached in the array: it may share the buffer
    seen = read.copy()
    source.array[...] += 1.0
    tpusync.transfer(source, pool, path="native").result(timeout=30)
    np.testing.assert_array_equal(read, seen)
    np.testing.assert_array_equal(np.asarray(pool.array), source.array)
    assert not np.array_equal(seen, source.array) and not np.array_equal(before, seen)
    source.close()


def test_a_pinned_buffer_s_address_is_read_from_its_pin() -> None:
    """The copy takes a buffer's address from the DLPack capsule that pins it (jaxlib's
    ``unsafe_buffer_pointer`` on a ``device_put`` array can fail while another thread reads the
    same array: it failed a put in CI): the capsule's address is the buffer's, offsets
    included, and anything but an unconsumed capsule gives None."""
    host = np.arange(64, dtype=np.float32)[5:]
    assert _core.dlpack_address(host.__dlpack__()) == host.ctypes.data
    for array in (
        jax.device_put(np.arange(256, dtype=np.float32), jax.devices()[0]),
        jnp.ones((8, 4), jnp.bfloat16) * 3,
    ):
        pin = native._pin_buffer(array)
        assert _core.dlpack_address(pin) == array.unsafe_buffer_pointer()
        holds: list[object] = []
        assert native._hold(holds, array, jax.devices()[0], False) == array.unsafe_buffer_pointer()
        assert len(holds) == 1 and _core.dlpack_address(holds[0]) is not None
    for other in (None, b"dltensor", host):
        assert _core.dlpack_address(other) is None


def test_hold_takes_the_address_from_the_pin_not_from_the_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pin of another buffer gives that buffer's address: ``_hold`` reads the capsule, not
    ``unsafe_buffer_pointer`` (the call that raced in CI)."""
    array = jax.device_put(np.arange(64, dtype=np.float32), jax.devices()[0])
    decoy = jax.device_put(np.arange(64, dtype=np.float32), jax.devices()[0])
    original_pin = native._pin_buffer
    monkeypatch.setattr(native, "_pin_buffer", lambda data: original_pin(decoy))
    holds: list[object] = []
    address = native._hold(holds, array, jax.devices()[0], False)
    assert address == decoy.unsafe_buffer_pointer() != array.unsafe_buffer_pointer()
