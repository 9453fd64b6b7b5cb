"""A sampler finds versions by itself: the newest kept (``latest``), a wait for a newer one that
wakes on the publish and ends at its timeout, a typed event carrying the new structure when the
tree changes, a publisher that restarts elsewhere waited through; a malformed head from a peer
and a server that keeps none are refused, naming them."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync._src.weights.head import MAX_LISTED, head_of
from tpusync._src.weights.manifest import chunk_layout
from tpusync.cluster import BlockServer, MemoryRegistry
from tpusync.errors import (
    InvalidArgumentError,
    StructureChangedError,
    VersionUnavailableError,
    WeightSyncError,
)
from tpusync.tiers import HostPool
from tpusync.weights import (
    Publisher,
    Subscriber,
    WeightsClientOptions,
    WeightsPoolOptions,
    published_structure,
)

SECRET = secrets.token_bytes(32)
POOL = WeightsPoolOptions(chunk_bytes=1 << 16, keep=2, capacity_bytes=1 << 22)
FAST = WeightsClientOptions(poll_s=0.01, timeout_s=5.0)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def _params(seed: int, extra: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(_mesh(), P("data", "model"))
    out = {"w": jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), sharding)}
    if extra:
        out["adapter"] = jax.device_put(rng.integers(0, 9, (8, 8)).astype(np.int8), sharding)
    return out


def _target(params: dict[str, Any]) -> dict[str, Any]:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in params.items()
    }


def _same_bits(got: Any, want: Any) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.fixture
def publisher(shm_names: Any) -> Iterator[Publisher]:
    with Publisher(shm_names(), secret=SECRET, pool=POOL) as pub:
        yield pub


def _asking(sub: Subscriber) -> threading.Event:
    """An event set once ``sub`` has asked its publisher for its versions twice: a wait that
    is under way, so what the test does next happens while it waits."""
    asked = threading.Event()
    count = [0]
    ask = sub._head

    def counted() -> Any:
        count[0] += 1
        if count[0] >= 2:
            asked.set()
        return ask()

    sub._head = counted  # type: ignore[method-assign]
    return asked


@contextlib.contextmanager
def _on_version_1(publisher: Publisher) -> Iterator[Subscriber]:
    """A subscriber that committed version 1 (published here) of ``publisher``."""
    publisher.publish(_params(1), 1)
    with Subscriber(
        publisher.name, _target(_params(0)), secret=SECRET, address=publisher.address, client=FAST
    ) as sub:
        sub.update(1)
        yield sub


def _in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    """Runs ``call`` in a thread; its result or exception lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as error:  # handed to the test's thread
            out.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_latest_and_the_wait_follow_the_publishers_versions(publisher) -> None:
    with Subscriber(
        publisher.name, _target(_params(0)), secret=SECRET, address=publisher.address, client=FAST
    ) as sub:
        assert sub.latest() is None
        assert sub.wait_for_newer(timeout_s=0) is None
        for version in (3, 5, 9):  # keep=2: 3 is dropped after 9, latest stays the newest
            publisher.publish(_params(version), version)
            assert sub.latest() == version
        assert sub.wait_for_newer(timeout_s=0) == 9  # nothing committed: any version
        sub.update(5)
        assert sub.wait_for_newer(timeout_s=0) == 9  # above the committed one
        assert sub.wait_for_newer(9, timeout_s=0.05) is None
        _same_bits(sub.update(9), _params(9))
        assert sub.wait_for_newer(timeout_s=0) is None


def test_a_waiting_sampler_wakes_when_the_version_is_published(publisher) -> None:
    with _on_version_1(publisher) as sub:
        asked = _asking(sub)
        thread, out = _in_thread(lambda: sub.wait_for_newer(timeout_s=120))
        assert asked.wait(60)
        publisher.publish(_params(2), 2)
        thread.join(timeout=120)
        assert out == [2]
        _same_bits(sub.update(2), _params(2))


@pytest.mark.parametrize(
    "change",
    ["a leaf added", "a leaf reshaped", "a leaf of another dtype", "a float it cannot convert"],
)
def test_a_changed_tree_is_a_typed_event_carrying_the_new_structure(publisher, change) -> None:
    publisher.publish(_params(1), 1)
    new = {
        "a leaf added": _params(2, extra=True),
        "a leaf reshaped": {"w": _params(2)["w"][:8]},
        "a leaf of another dtype": {"w": _params(2)["w"].astype(jax.numpy.int8)},
        "a float it cannot convert": {"w": _params(2)["w"].astype(jax.numpy.float16)},
    }[change]
    with Subscriber(
        publisher.name, _target(_params(0)), secret=SECRET, address=publisher.address, client=FAST
    ) as sub:
        sub.update(1)
        publisher.publish(new, 2)
        with pytest.raises(StructureChangedError, match="another structure") as caught:
            sub.wait_for_newer(timeout_s=60)
        assert sub.version == 1  # nothing moved
    assert caught.value.version == 2
    target = caught.value.structure.target(_mesh())  # the new tree, on the sampler's mesh
    with Subscriber(publisher.name, target, secret=SECRET, address=publisher.address) as sub:
        _same_bits(sub.update(2), new)


def test_a_float_leaf_in_another_float_dtype_is_no_change_of_structure(publisher) -> None:
    """The target's float32 takes a bfloat16 version, converted as it lands."""
    with _on_version_1(publisher) as sub:
        halved = {"w": _params(2)["w"].astype(jax.numpy.bfloat16)}
        publisher.publish(halved, 2)
        assert sub.wait_for_newer(timeout_s=60) == 2
        got = sub.update(2)["w"]
        assert got.dtype == np.float32
        assert np.asarray(got).tobytes() == np.asarray(halved["w"].astype(np.float32)).tobytes()


def test_a_sampler_told_only_the_registry_waits_for_the_first_version(shm_names) -> None:
    registry = MemoryRegistry()
    name = shm_names()
    with pytest.raises(VersionUnavailableError, match="no version"):
        published_structure(name, secret=SECRET, registry=registry, client=FAST)
    with Publisher(name, secret=SECRET, registry=registry, pool=POOL) as pub:
        thread, out = _in_thread(
            lambda: published_structure(
                name, secret=SECRET, registry=registry, client=FAST, wait_s=120
            )
        )
        pub.publish(_params(4), 4)
        thread.join(timeout=120)
        (found,) = out
        assert found.version == 4
        with Subscriber(name, found.target(_mesh()), secret=SECRET, registry=registry) as sub:
            assert sub.latest() == 4
            _same_bits(sub.update(4), _params(4))


def test_a_publisher_restarted_elsewhere_is_waited_through(shm_names) -> None:
    registry = MemoryRegistry()
    name = shm_names()
    with Publisher(name, secret=SECRET, registry=registry, pool=POOL) as first:
        first.publish(_params(1), 1)
        sub = Subscriber(name, _target(_params(0)), secret=SECRET, registry=registry, client=FAST)
        sub.update(1)
    # gone: the registry lists no publisher, the sampler keeps serving version 1
    assert sub.latest() is None and sub.wait_for_newer(timeout_s=0) is None
    thread, out = _in_thread(lambda: sub.wait_for_newer(timeout_s=120))
    with Publisher(name, secret=SECRET, registry=registry, pool=POOL) as second:
        second.publish(_params(2), 2)
        thread.join(timeout=120)
        assert out == [2]
        _same_bits(sub.update(2), _params(2))
        sub.close()


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_publisher_unreachable_at_the_timeout_is_an_error_not_a_quiet_none() -> None:
    with Subscriber("gone", {}, secret=SECRET, address=_closed_port(), client=FAST) as sub:
        with pytest.raises(WeightSyncError, match="cannot be reached"):
            sub.latest()
        with pytest.raises(WeightSyncError, match="cannot be reached"):
            sub.wait_for_newer(timeout_s=0.05)


def test_close_ends_a_wait(publisher) -> None:
    sub = Subscriber(
        publisher.name, _target(_params(0)), secret=SECRET, address=publisher.address, client=FAST
    )
    asked = _asking(sub)
    thread, out = _in_thread(lambda: sub.wait_for_newer(timeout_s=120))
    assert asked.wait(60)
    sub.close()
    thread.join(timeout=120)
    assert len(out) == 1 and isinstance(out[0], WeightSyncError) and "closed" in str(out[0])


def test_a_server_that_keeps_no_head_is_named() -> None:
    pool = HostPool(chunk_layout("plain", 4096), 4)
    with (
        pool,
        BlockServer(pool, secret=SECRET) as server,
        Subscriber("plain", {}, secret=SECRET, address=server.address) as sub,
        pytest.raises(WeightSyncError, match=r"not a weights publisher.*does not serve head"),
    ):
        sub.latest()


@pytest.mark.parametrize(
    "answer",
    [
        None,
        [],
        {"versions": {}},
        {},
        {"versions": [[1]]},
        {"versions": [[-1, "0" * 32]]},
        {"versions": [[True, "0" * 32]]},
        {"versions": [[1, "0" * 31]]},
        {"versions": [[1, "G" * 32]]},
        {"versions": [[2, "0" * 32], [1, "0" * 32]]},
        {"versions": [[1, "0" * 32], [1, "0" * 32]]},
        {"versions": [[v, "0" * 32] for v in range(MAX_LISTED + 1)]},
    ],
)
def test_a_malformed_head_from_a_peer_is_refused(answer) -> None:
    assert head_of({"versions": [[1, "0" * 32], [4, "a" * 32]]}, "peer").latest == 4
    with pytest.raises(WeightSyncError, match="malformed head from peer"):
        head_of(answer, "peer")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.wait_for_newer(timeout_s=-1), "timeout_s"),
        (lambda s: s.wait_for_newer(timeout_s=True), "timeout_s"),
        (lambda s: s.wait_for_newer("3", timeout_s=0), "after"),
    ],
)
def test_bad_arguments_are_named(publisher, call, match) -> None:
    with (
        Subscriber(publisher.name, {}, secret=SECRET, address=publisher.address) as sub,
        pytest.raises(InvalidArgumentError, match=match),
    ):
        call(sub)
    with pytest.raises(InvalidArgumentError, match="poll_s"):
        WeightsClientOptions(poll_s=0)
