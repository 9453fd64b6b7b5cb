"""Device-memory safety: the two rules of the DevicePool contract, raced for real.

Each race runs many rounds with the rule in place and must never corrupt; a companion test
drops the rule (monkeypatching the one function that implements it) and must see corruption,
which proves the race really overlaps and the check can fail.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpusync
from tpusync import _native_path
from tpusync.device_pool import DevicePool

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

    monkeypatch.setattr(_native_path, "wait_for_readers", only_wait_for_the_arrays)
    assert _write_race_corruptions(ROUNDS) > 0


# Reads its input, so that JAX keeps the donation and XLA writes the output in place.
_donating_overwrite = jax.jit(lambda x: x * 0.0 + 7.0, donate_argnums=0)


def _read_race_corruptions(rounds: int, monkeypatch: pytest.MonkeyPatch, pin: bool) -> int:
    data = np.random.default_rng(7).standard_normal((ROWS, COLS), dtype=np.float32)
    host = tpusync.HostBuffer((ROWS, COLS), np.float32)
    original_pin = _native_path._pin_buffer
    pinned = threading.Event()

    def pin_and_signal(buffer: jax.Array) -> object:
        capsule = original_pin(buffer) if pin else None
        buffer.block_until_ready()
        pinned.set()
        return capsule

    monkeypatch.setattr(_native_path, "_pin_buffer", pin_and_signal)
    corrupted = 0
    for _ in range(rounds):
        source = jax.device_put(data, may_alias=False)
        host.array[...] = 0.0
        pinned.clear()
        future = tpusync.transfer(source, host, path="native")
        assert pinned.wait(timeout=30)
        replaced = _donating_overwrite(source)  # the caller donates while the read runs
        future.result(timeout=30)
        replaced.block_until_ready()
        assert np.all(np.asarray(replaced) == 7.0)
        if not np.array_equal(host.array, data):
            corrupted += 1
    host.close()
    return corrupted


def test_raw_read_keeps_donated_buffer_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _read_race_corruptions(ROUNDS, monkeypatch, pin=True) == 0


def test_read_race_detects_a_missing_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _read_race_corruptions(ROUNDS, monkeypatch, pin=False) > 0
