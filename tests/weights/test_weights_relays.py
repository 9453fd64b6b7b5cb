"""Fan-out through relays (in one process, over loopback TCP): a relay copies each version
from the publisher once, checked against the SHA-256 digests in the manifest, and subscribers
take every chunk from it; a second relay takes it from the first (a tree). A relay serving
forged chunks with block checksums that match them (as one that knows the secret can), or
damaged ones, or gone, costs a retry from the publisher and never a wrong byte. The
multi-host run (network namespaces, shaped links, a relay killed mid-serve) is in
test_weights_fanout_netns.py."""

from __future__ import annotations

import secrets
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync._src.cluster.dataplane import BlockServer
from tpusync._src.tiers.dram import HostPool
from tpusync._src.weights.manifest import announcement_key, chunk_key, chunk_layout, relay_key
from tpusync.cluster import MemoryRegistry, NodeInfo
from tpusync.errors import InvalidArgumentError
from tpusync.weights import (
    Publisher,
    Relay,
    Subscriber,
    WeightsClientOptions,
    WeightsPoolOptions,
)

SECRET = secrets.token_bytes(32)
CHUNK = 1 << 16
POOL = WeightsPoolOptions(chunk_bytes=CHUNK, keep=2, capacity_bytes=1 << 24)
# over the data plane even on this host, as from another host
CLIENT = WeightsClientOptions(same_host=False, timeout_s=5.0, deadline_s=60.0, relay_wait_s=20.0)


def _params(version: int) -> dict[str, Any]:
    rng = np.random.default_rng(version)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    return {
        "w": jax.device_put(rng.standard_normal((512, 256)).astype(np.float32), sharding),
        "b": jax.device_put(rng.standard_normal((256, 64)).astype(jax.numpy.bfloat16), sharding),
    }


def _target(params: dict[str, Any]) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("y", "x")))
        for k, v in params.items()
    }


def _same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in want)


def test_subscribers_take_every_chunk_from_relays_checked_and_a_tree_of_relays_forms() -> None:
    registry = MemoryRegistry()
    with (
        Publisher("fan", secret=SECRET, registry=registry, pool=POOL, relays=True) as pub,
        Relay("fan", secret=SECRET, registry=registry, client=CLIENT) as first,
    ):
        v1 = _params(1)
        report = pub.publish(v1, 1)
        assert first.wait_for(1, 30)
        with Relay(
            "fan", secret=SECRET, registry=registry, upstream=first.address, client=CLIENT
        ) as second:
            assert second.wait_for(1, 30)
            assert second.address != first.address
            for _ in range(2):  # spread over the two relays by each subscriber's pick
                with Subscriber(
                    "fan", _target(v1), secret=SECRET, registry=registry, client=CLIENT,
                    relays=True,
                ) as sub:  # fmt: skip
                    pulled = sub.pull(1)
                    assert pulled.chunks_relayed == report.chunks
                    assert pulled.chunks_network == 0 and pulled.chunks_local == 0
                    assert _same(sub.commit(), v1)
            # a version a relay has not listed yet is waited for, then taken from it
            v2 = _params(2)
            pub.publish(v2, 2)
            with Subscriber(
                "fan", _target(v2), secret=SECRET, registry=registry, client=CLIENT, relays=True
            ) as sub:
                pulled = sub.pull(2)
                assert pulled.chunks_relayed == report.chunks, pulled
                assert _same(sub.commit(), v2)
            assert second.failures == 0 and first.failures == 0


def _forging_relay(registry: MemoryRegistry, version: int, n_chunks: int, flip: bool) -> Any:
    """A relay that knows the secret and lists ``version``, serving random chunks under their
    keys with the block checksums of those bytes (as such a relay can make them), or,
    ``flip``, chunks changed after their checksums were made (damaged in its memory)."""
    pool = HostPool(chunk_layout("fan", CHUNK), n_chunks)
    keys = [chunk_key("fan", version, i) for i in range(n_chunks)]
    reservation = pool.reserve(keys)
    rng = np.random.default_rng(7)
    for slot in reservation.slots.tolist():
        with pool.slot_memory(slot) as memory:
            memory[:CHUNK] = rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    if flip:
        for slot in reservation.slots.tolist():
            with pool.slot_memory(slot) as memory:
                memory[5] ^= 0x40
    server = BlockServer(pool, secret=SECRET)
    registry.register(NodeInfo("weights-relay-forger", (server.address,)), 60.0)
    registry.publish("weights-relay-forger", [relay_key("fan", version)], "dram")
    return pool, server


@pytest.mark.parametrize("flip", [False, True])
def test_a_relay_serving_forged_or_damaged_chunks_costs_a_retry_never_a_wrong_byte(flip) -> None:
    registry = MemoryRegistry()
    with Publisher("fan", secret=SECRET, registry=registry, pool=POOL, relays=True) as pub:
        v1 = _params(1)
        report = pub.publish(v1, 1)
        pool, server = _forging_relay(registry, 1, report.chunks, flip)
        try:
            with Subscriber(
                "fan", _target(v1), secret=SECRET, registry=registry, client=CLIENT, relays=True
            ) as sub:
                pulled = sub.pull(1)
                # every chunk was refused from the forger and taken from the publisher
                assert pulled.chunks_relayed == 0 and pulled.chunks_network == report.chunks
                assert _same(sub.commit(), v1)
        finally:
            server.close()
            pool.close()


def test_a_relay_gone_after_it_listed_a_version_costs_a_retry_from_the_publisher() -> None:
    registry = MemoryRegistry()
    with Publisher("fan", secret=SECRET, registry=registry, pool=POOL, relays=True) as pub:
        v1 = _params(1)
        report = pub.publish(v1, 1)
        relay = Relay("fan", secret=SECRET, registry=registry, client=CLIENT)
        assert relay.wait_for(1, 30)
        address = relay.address
        relay._link.close()  # its listing stays, as a relay killed before its lease lapsed
        relay._link = None
        relay.close()
        registry.register(NodeInfo("weights-relay-gone", (address,)), 60.0)
        registry.publish("weights-relay-gone", [relay_key("fan", 1)], "dram")
        with Subscriber(
            "fan", _target(v1), secret=SECRET, registry=registry, client=CLIENT, relays=True
        ) as sub:
            pulled = sub.pull(1)
            assert pulled.chunks_relayed == 0 and pulled.chunks_network == report.chunks
            assert _same(sub.commit(), v1)


def test_a_publisher_without_digests_is_not_relayed_and_subscribers_take_it_directly() -> None:
    registry = MemoryRegistry()
    with (
        Publisher("fan", secret=SECRET, registry=registry, pool=POOL) as pub,
        Relay("fan", secret=SECRET, registry=registry, client=CLIENT) as relay,
    ):
        v1 = _params(1)
        report = pub.publish(v1, 1)
        quick = WeightsClientOptions(same_host=False, relay_wait_s=0.5)
        with Subscriber(
            "fan", _target(v1), secret=SECRET, registry=registry, client=quick, relays=True
        ) as sub:
            pulled = sub.pull(1)
            assert pulled.chunks_relayed == 0 and pulled.chunks_network == report.chunks
            assert _same(sub.commit(), v1)
        assert relay.versions == []


def test_relays_bad_arguments_are_refused() -> None:
    registry = MemoryRegistry()
    with pytest.raises(InvalidArgumentError, match="relays"):
        Publisher("fan", secret=SECRET, relays="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="registry"):
        Subscriber("fan", {}, secret=SECRET, address="127.0.0.1:1", relays=True)
    with pytest.raises(InvalidArgumentError, match="upstream"):
        Relay("fan", secret=SECRET, registry=registry, upstream="nowhere")
    with pytest.raises(InvalidArgumentError, match="registry"):
        Relay("fan", secret=SECRET, registry=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="relay_wait_s"):
        WeightsClientOptions(relay_wait_s=0)


def test_relayed_chunks_land_converted_and_a_partial_versions_own_chunks_are_relayed() -> None:
    """Relayed chunks go through the same rows as direct ones: a leaf converted on the way in
    (bf16 -> f32) and a partial version (its changed leaf relayed, the other kept)."""
    registry = MemoryRegistry()
    with (
        Publisher("fan", secret=SECRET, registry=registry, pool=POOL, relays=True) as pub,
        Relay("fan", secret=SECRET, registry=registry, client=CLIENT) as relay,
    ):
        v1 = _params(1)
        pub.publish(v1, 1)
        target = _target(v1)
        target["b"] = jax.ShapeDtypeStruct((256, 64), np.float32, sharding=target["b"].sharding)
        with Subscriber(
            "fan", target, secret=SECRET, registry=registry, client=CLIENT, relays=True
        ) as sub:
            assert sub.pull(1).chunks_relayed > 0
            got = sub.commit()
            assert np.asarray(got["w"]).tobytes() == np.asarray(v1["w"]).tobytes()
            want = np.asarray(v1["b"].astype(np.float32))
            assert np.asarray(got["b"]).tobytes() == want.tobytes()
            v2 = {"w": _params(2)["w"]}
            report = pub.publish(v2, 2, base=1)
            assert relay.wait_for(2, 30)
            pulled = sub.pull(2)
            assert pulled.chunks_relayed == report.chunks
            got = sub.commit()
            assert np.asarray(got["w"]).tobytes() == np.asarray(v2["w"]).tobytes()
            assert np.asarray(got["b"]).tobytes() == want.tobytes()


def test_a_node_listing_the_announcement_is_not_taken_for_the_publisher() -> None:
    """Manifests come from the publisher's own node alone: another node (a relay that knows
    the secret) listing a version's announcement is not asked for it."""
    registry = MemoryRegistry()
    with Publisher("fan", secret=SECRET, registry=registry, pool=POOL, relays=True) as pub:
        v1 = _params(1)
        pub.publish(v1, 1)
        pool = HostPool(chunk_layout("fan", CHUNK), 4)
        server = BlockServer(pool, secret=SECRET)  # holds nothing: asked, it would fail
        try:
            registry.register(NodeInfo("aaa-impostor", (server.address,)), 60.0)
            registry.publish("aaa-impostor", [announcement_key("fan", 1)], "dram")
            with Subscriber(
                "fan", _target(v1), secret=SECRET, registry=registry, client=CLIENT
            ) as sub:
                sub.pull(1)
                assert _same(sub.commit(), v1)
        finally:
            server.close()
            pool.close()
