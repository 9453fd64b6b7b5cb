"""RL weight sync: a trainer publishes each version of its sharded weights once; a sampler pulls
it into its own mesh, checked byte for byte, and switches to it in one step.

Roles that would run in their own processes and hosts, here in one process over loopback TCP
with 8 CPU devices: a registry (where versions are announced), a trainer whose weights are
sharded 8x1, and a sampler that wants them 2x4. After each of three training steps the sampler's
arrays must equal the trainer's bit for bit, in the sampler's own shardings. Runs on the CPU
backend in seconds, leaving nothing behind:

    python examples/weight_sync.py
"""

import secrets
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything touches a device

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tpusync.cluster import MemoryRegistry, RegistryServer, RemoteRegistry  # noqa: E402
from tpusync.weights import (  # noqa: E402
    Publisher,
    Subscriber,
    WeightsClientOptions,
    WeightsPoolOptions,
)

SHAPES = {"embed": (256, 64), "layer0.w": (64, 128), "layer0.b": (128,), "head": (64, 256)}


def train_step(step, sharding):
    """Stands in for the trainer's step: new random weights (bf16 and f32), 8x1."""
    rng = np.random.default_rng(step)
    out = {}
    for name, shape in SHAPES.items():
        dtype = jax.numpy.bfloat16 if len(shape) == 2 else np.float32
        out[name] = jax.device_put(rng.standard_normal(shape).astype(dtype), sharding(shape))
    return out


def sync(publisher, subscriber, params, step):
    """The trainer publishes; the sampler pulls into its own layout and switches to it."""
    publisher.publish(params, step)  # returns once staged: params may be donated now
    subscriber.pull(step)  # into a shadow copy: only the bytes its own shards need
    return subscriber.commit()  # every step runs on one complete version


def main():
    devices = np.array(jax.devices()[:8])
    trainer_mesh = Mesh(devices.reshape(8, 1), ("x", "y"))
    sampler_mesh = Mesh(devices.reshape(2, 4), ("x", "y"))

    def trainer_sharding(shape):
        return NamedSharding(trainer_mesh, P("x") if len(shape) == 1 else P("x", None))

    def sampler_sharding(shape):
        return NamedSharding(sampler_mesh, P("x") if len(shape) == 1 else P("x", "y"))

    secret = secrets.token_bytes(32)
    with RegistryServer(MemoryRegistry(), secret=secret) as server:
        registry = RemoteRegistry(server.address, secret=secret)
        target = {
            name: jax.ShapeDtypeStruct(
                shape,
                jax.numpy.bfloat16 if len(shape) == 2 else np.float32,
                sharding=sampler_sharding(shape),
            )
            for name, shape in SHAPES.items()
        }
        # the rest of each side's settings come in options objects (defaults documented there)
        pool = WeightsPoolOptions(keep=2, chunk_bytes=4 << 20)  # versions kept, verified unit
        publisher = Publisher("policy", secret=secret, registry=registry, pool=pool)
        client = WeightsClientOptions(deadline_s=60.0)  # the longest a pull may take
        subscriber = Subscriber("policy", target, secret=secret, registry=registry, client=client)
        try:
            for step in range(1, 4):
                params = train_step(step, trainer_sharding)
                pulled = sync(publisher, subscriber, params, step)
                for name in SHAPES:
                    assert pulled[name].sharding == target[name].sharding, name
                    same = np.asarray(pulled[name]).tobytes() == np.asarray(params[name]).tobytes()
                    assert same, f"step {step}: {name} differs from the trainer's"
                print(f"step {step}: version {subscriber.version} committed, "
                      f"versions kept {publisher.versions}")  # fmt: skip
        finally:
            subscriber.close()
            publisher.close()
            registry.close()
    print("weights equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
