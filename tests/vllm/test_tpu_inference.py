"""vLLM on TPU (tpu-inference): ``TpuSyncTpuConnector``'s worker side over a stand-in runner
(``tpu_runner_stand_in``: tpu-inference itself cannot be installed here) holding real JAX
arrays in tpu-inference's layout over 8 CPU devices, meshes with data 1 and 2. The connector is
made by vLLM's own factory under the names tpu-inference's platform accepts, and driven as
vLLM's model-runner mixin drives it each step: bind the metadata, ``start_load_kv``, the model
step (which donates the KV arrays and replaces ``runner.kv_caches``), ``wait_for_save``,
``get_finished``, the load errors. Every page is checked bit for bit against plain JAX."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_bits, random_array
from engines import build_model
from jax.sharding import PartitionSpec
from tpu_runner_stand_in import TPU_INFERENCE_SPEC, TpuInferenceRunnerStandIn, kv_shape

from tpusync._src.connectors.vllm.metadata import LoadSpec, SaveSpec, TpuSyncMetadata
from tpusync._src.connectors.vllm.worker import local_worker
from tpusync.connectors.tpu_inference import TpuSyncTpuConnector
from tpusync.errors import InvalidArgumentError

LAYERS, PAGES, KV_HEADS, HEAD_DIM = 3, 32, 8, 128
MODULE = "tpusync.connectors.tpu_inference"
NAMES = ("TPUConnector", "TPUConnectorHMA", "TPUOffloadConnector", "RaidenOffloadConnector")
# the layout that works on a mesh with data > 1: every data row holds every page
HEADS_ONLY = PartitionSpec(None, None, "model")


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real VllmConfig (vLLM's own engine arguments; the model is only read for its config)."""
    from vllm.engine.arg_utils import EngineArgs

    model = build_model(tmp_path_factory.mktemp("model") / "m", seed=0)
    args = EngineArgs(
        model=str(model), block_size=16, max_model_len=1024, kv_transfer_config=_transfer({})
    )
    return args.create_engine_config()


def _transfer(extra: dict[str, Any], name: str = "TPUConnector", engine_id: str = "") -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        engine_id=engine_id or uuid.uuid4().hex,
    )


def _connector(
    vllm_config: Any, extra: dict[str, Any], *, name: str = "TPUConnector", worker: bool = True
) -> Any:
    """A connector made by vLLM's factory, as tpu-inference's worker (or, ``worker=False``, its
    scheduler) makes it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    vllm_config.kv_transfer_config = _transfer(extra, name)
    kv_cache_config = KVCacheConfig(num_blocks=PAGES, kv_cache_tensors=[], kv_cache_groups=[])
    role = KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER
    return KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)


def _mesh(data: int) -> jax.sharding.Mesh:
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((data, 8 // data), ("data", "model"), axis_types=(auto, auto))


def _runner(vllm_config: Any, data: int, dtype: Any, spec: PartitionSpec) -> Any:
    return TpuInferenceRunnerStandIn(
        _mesh(data), layers=LAYERS, pages=PAGES, page_size=vllm_config.cache_config.block_size,
        kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, spec=spec,
    )  # fmt: skip


def _step(connector: Any, runner: Any, meta: TpuSyncMetadata, write: Any = None) -> set[int]:
    """One step as vLLM's KV connector mixin runs it around tpu-inference's model; returns the
    block ids whose loads failed."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    if write is not None:
        runner.step(*write)
    connector.wait_for_save()
    connector.get_finished(set())
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    return errors


def _pages(rng: np.random.Generator, runner: Any, count: int) -> list[np.ndarray]:
    shape = (count, *runner.kv_caches[0].shape[1:])
    return [random_array(rng, shape, runner.kv_caches[0].dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("path", ["native", "jax"])
@pytest.mark.parametrize(
    ("data", "spec", "dtype"),
    [
        (1, TPU_INFERENCE_SPEC, jnp.bfloat16),  # tpu-inference's own sharding, data 1
        (1, TPU_INFERENCE_SPEC, jnp.int8),  # packing 4
        (2, HEADS_ONLY, jnp.float32),  # data 2: pages whole in every data row
    ],
)
def test_pages_saved_by_one_engine_load_into_another_as_plain_jax_says(
    vllm_config: Any, tmp_path: Path, rng: np.random.Generator,
    data: int, spec: PartitionSpec, dtype: Any, path: str,
) -> None:  # fmt: skip
    extra = {
        "socket_dir": str(tmp_path),
        "path": path,
        "disk": {"directory": str(tmp_path / "disk"), "capacity_blocks": 64, "create": True},
    }
    hashes = [rng.bytes(32) for _ in range(4)]
    src_pages, dst_pages = [3, 7, 9, 12], [20, 5, 30, 1]

    producer = _connector(vllm_config, extra)
    assert isinstance(producer, TpuSyncTpuConnector)
    runner = _runner(vllm_config, data, dtype, spec)
    try:
        producer.register_kv_caches({})  # tpu-inference calls it; the runner is what counts
        producer.register_runner(runner)
        written = _pages(rng, runner, len(src_pages))
        save = SaveSpec("r1", hashes, src_pages)
        assert _step(producer, runner, TpuSyncMetadata(saves=[save]), (src_pages, written)) == set()
        assert runner.steps == 1
    finally:
        producer.shutdown()  # its saves reach the disk tier before it closes

    consumer = _connector(vllm_config, extra)
    runner = _runner(vllm_config, data, dtype, spec)
    sharding = runner.kv_caches[0].sharding
    try:
        consumer.register_runner(runner)
        everything = list(range(PAGES))
        _step(consumer, runner, TpuSyncMetadata(), (everything, _pages(rng, runner, PAGES)))
        before = runner.snapshot()
        worker = local_worker(consumer._settings.engine_id)
        assert worker is not None
        assert worker.answer("r2", 1, hashes) == (4, False)  # from disk, yet before the forward
        step_pages, step_values = [0], _pages(rng, runner, 1)
        load = LoadSpec("r2", 1, dst_pages, is_async=False)
        meta = TpuSyncMetadata(loads=[load])
        assert _step(consumer, runner, meta, (step_pages, step_values)) == set()
        # every device's own shard, each replica of it too (a gather would read one replica)
        shards = [
            [(s.index, s.replica_id, np.array(s.data, copy=True)) for s in a.addressable_shards]
            for a in runner.kv_caches
        ]
    finally:
        consumer.shutdown()
    for layer in range(LAYERS):  # the reference: plain JAX on the same inputs
        expected = jnp.asarray(before[layer]).at[jnp.asarray(dst_pages)].set(written[layer])
        expected = np.asarray(expected.at[jnp.asarray(step_pages)].set(step_values[layer]))
        assert len(shards[layer]) == 8  # one a device
        replicas: dict[str, set[int]] = {}
        for index, replica, values in shards[layer]:
            where = f"layer {layer} shard {index} replica {replica}"
            assert_same_bits(values, expected[index], where)
            replicas.setdefault(str(index), set()).add(replica)
        assert all(r == set(range(data)) for r in replicas.values())  # a replica per data row
        assert runner.kv_caches[layer].sharding.is_equivalent_to(sharding, 5)
    assert worker.recent_loads and worker.recent_loads[-1].loaded_blocks == 4


def test_pages_sharded_over_the_data_axis_are_refused_and_nothing_changes(
    vllm_config: Any, tmp_path: Path
) -> None:
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)})
    runner = _runner(vllm_config, 2, jnp.bfloat16, TPU_INFERENCE_SPEC)
    arrays = list(runner.kv_caches)
    try:
        split = r"kv_caches\[0\]: its pages \(axis 0\) are split over the mesh"
        with pytest.raises(InvalidArgumentError, match=split + r".*\(None, None, 'model'\)"):
            connector.register_runner(runner)
        assert all(
            a is b and not a.is_deleted() for a, b in zip(runner.kv_caches, arrays, strict=True)
        )
        runner.step([0], _pages(np.random.default_rng(0), runner, 1))  # the runner runs on
    finally:
        connector.shutdown()
    assert not list(tmp_path.iterdir())  # no lookup socket was opened


def test_a_load_whose_pins_are_lost_is_a_load_error_and_its_step_saves_nothing(
    vllm_config: Any, tmp_path: Path, rng: np.random.Generator
) -> None:
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)})
    runner = _runner(vllm_config, 1, jnp.bfloat16, TPU_INFERENCE_SPEC)
    try:
        connector.register_runner(runner)
        _step(
            connector, runner, TpuSyncMetadata(), (list(range(PAGES)), _pages(rng, runner, PAGES))
        )
        before = runner.snapshot()
        meta = TpuSyncMetadata(
            loads=[LoadSpec("never-looked-up", 7, [4, 6], is_async=False)],
            saves=[SaveSpec("r3", [rng.bytes(32)], [9])],
        )
        assert _step(connector, runner, meta) == {4, 6}
        for layer, array in enumerate(before):
            assert_same_bits(runner.snapshot()[layer], array, f"layer {layer}")
        worker = local_worker(connector._settings.engine_id)
        assert worker is not None and worker.store is not None
        dram = worker.store.stats()["tiers"]["dram"]
        assert (dram["used"], dram["capacity"]) == (0, PAGES)  # as many pages as the engine
    finally:
        connector.shutdown()


def test_two_layers_sharing_one_array_are_refused_naming_both(
    vllm_config: Any, tmp_path: Path
) -> None:
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)})
    runner = _runner(vllm_config, 1, jnp.bfloat16, TPU_INFERENCE_SPEC)
    runner.kv_caches[2] = runner.kv_caches[0]  # one array at layers 0 and 2
    arrays = list(runner.kv_caches)
    try:
        both = r"runner\.kv_caches\[0\] and runner\.kv_caches\[2\]: the same jax\.Array"
        with pytest.raises(InvalidArgumentError, match=both + ".*an array of its own"):
            connector.register_runner(runner)
        assert all(a is b for a, b in zip(runner.kv_caches, arrays, strict=True))
    finally:
        connector.shutdown()
    assert not list(tmp_path.iterdir())  # no lookup socket was opened


def test_a_runner_without_kv_caches_is_refused_saying_what_to_pass(
    vllm_config: Any, tmp_path: Path
) -> None:
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)})
    try:
        with pytest.raises(
            InvalidArgumentError,
            match=r"runner: a object has no kv_caches attribute; pass tpu-inference's TPU model "
            "runner, once its KV cache is allocated",
        ):
            connector.register_runner(object())
        with pytest.raises(InvalidArgumentError, match="got NoneType; register tpu-inference's"):
            connector.register_runner(type("Unallocated", (), {"kv_caches": None})())
    finally:
        connector.shutdown()


def test_steps_without_a_registered_runner_warn_once_naming_register_runner(
    vllm_config: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)})
    meta = TpuSyncMetadata(saves=[SaveSpec("r1", [b"h" * 32], [3])])
    try:
        with caplog.at_level(logging.WARNING, logger="tpusync.connectors.tpu_inference"):
            for _ in range(3):  # each step loads and saves nothing: no runner
                assert _step(connector, None, meta) == set()
    finally:
        connector.shutdown()
    said = [r.getMessage() for r in caplog.records if "register_runner" in r.getMessage()]
    assert len(said) == 1, said
    assert "tpu-inference's TPU worker calls it" in said[0]
    assert "every lookup is a miss" in said[0]


@pytest.mark.parametrize("worker", [True, False], ids=["worker", "scheduler"])
@pytest.mark.parametrize("value", [True, False])
def test_load_by_layer_other_than_auto_is_refused_at_engine_start(
    vllm_config: Any, tmp_path: Path, value: bool, worker: bool
) -> None:
    extra = {"socket_dir": str(tmp_path), "load_by_layer": value}
    with pytest.raises(
        InvalidArgumentError,
        match=rf"kv_connector_extra_config\.load_by_layer: {value} has no effect on "
        r'TpuSyncTpuConnector, .* leave load_by_layer out \(or "auto"\)',
    ):
        _connector(vllm_config, extra, worker=worker)
    _connector(vllm_config, {**extra, "load_by_layer": "auto"}, worker=worker).shutdown()


@pytest.mark.parametrize("name", NAMES)
def test_every_name_tpu_inference_accepts_makes_this_connector(
    vllm_config: Any, tmp_path: Path, name: str
) -> None:
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)}, name=name)
    try:
        assert type(connector) is TpuSyncTpuConnector
    finally:
        connector.shutdown()


def test_the_layout_and_parallelism_are_checked(vllm_config: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="token_axis: 2 contradicts the engine's "
                       r"tpu-inference KV layout's token_axis \(1\)"):  # fmt: skip
        _connector(vllm_config, {"socket_dir": str(tmp_path), "token_axis": 2})
    parallel = vllm_config.parallel_config
    saved = parallel.pipeline_parallel_size
    parallel.pipeline_parallel_size = 2
    try:
        with pytest.raises(InvalidArgumentError, match="pipeline_parallel_size"):
            _connector(vllm_config, {"socket_dir": str(tmp_path)})
    finally:
        parallel.pipeline_parallel_size = saved
    connector = _connector(vllm_config, {"socket_dir": str(tmp_path)})
    try:
        with pytest.raises(InvalidArgumentError, match="the runner holds no KV arrays"):
            connector.register_runner(type("Empty", (), {"kv_caches": []})())
        odd = _runner(vllm_config, 1, jnp.bfloat16, TPU_INFERENCE_SPEC)
        odd.kv_caches = [jnp.zeros((PAGES + 1, 2))]
        with pytest.raises(
            InvalidArgumentError, match=f"33 pages on axis 0, but vLLM allocated {PAGES}"
        ):
            connector.register_runner(odd)
    finally:
        connector.shutdown()
    assert kv_shape(8, 16, 8, 128, jnp.int8, 8)[2:4] == (8, 4)  # the stand-in pads as tpu-inference
