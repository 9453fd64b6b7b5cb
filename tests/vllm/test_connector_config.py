"""The connector's configuration: every wrong key or value of ``kv_connector_extra_config`` is
a clear error naming it, at engine start; hashing that differs between processes is refused;
the plugin entry point registers the name without importing jax."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engines import build_model, engine, transfer_config

from tpusync._src.connectors.vllm.settings import check_stable_hashing, read_settings
from tpusync._src.connectors.vllm.worker import WorkerSide
from tpusync.errors import InvalidArgumentError

ENGINE = dict(
    model="m", block_size=32, tp_rank=0, tp_size=1, num_blocks=100, engine_id="e1",
)  # fmt: skip


def test_defaults_come_from_the_engine(tmp_path: Path) -> None:
    settings = read_settings({"socket_dir": str(tmp_path)}, **ENGINE)
    store = settings.store
    assert (store.model_id, store.block_size, store.token_axis) == ("m", 32, 2)
    assert store.dram.capacity_blocks == 100  # as many blocks as the engine's KV cache
    assert settings.socket_path.parent == tmp_path
    assert settings.lookup_timeout_s == 2.0
    assert settings.load_by_layer == "auto"
    assert settings.copy_on_openmp_team


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"capacity": 4}, "capacity: unknown key of the store's config"),
        ({"dram": {"capacity_block": 4}}, "dram.capacity_block: unknown key"),
        ({"dram": {"capacity_blocks": 0}}, "capacity_blocks"),
        ({"disk": {"capacity_blocks": 4}}, "disk"),
        ({"block_size": 16}, r"block_size: 16 contradicts the engine's block_size \(32\)"),
        ({"shard_count": 2}, "shard_count: 2 contradicts the engine's tensor_parallel_size"),
        ({"token_axis": 1}, "token_axis: 1 contradicts the engine's CPU KV layout"),
        ({"lookup_timeout_s": 0}, r"lookup_timeout_s: expected seconds in \(0, 60\]"),
        ({"lookup_timeout_s": "1"}, "lookup_timeout_s"),
        ({"load_by_layer": 1}, 'load_by_layer: expected true, false or "auto"'),
        ({"load_by_layer": "yes"}, 'load_by_layer: expected true, false or "auto"'),
        ({"copy_on_openmp_team": "no"}, "copy_on_openmp_team: expected true or false"),
        ({"secret_file": "/nonexistent/secret"}, "secret_file: cannot read"),
        ({"salt": "xyz"}, "salt: expected a hex string"),
        ({"socket_dir": ""}, "socket_dir: expected a directory path"),
        ({"socket_dir": "/" + "d" * 100}, "socket_dir: .* too long for a Unix socket path"),
        ({"store_node": {"nodes": 3}}, "store_node"),
        (
            {"store_node": {"address": "127.0.0.1:9", "same_host": "yes"}},
            "node.same_host: expected True or False",
        ),
        (
            {"serve": {"registry": "10.1.2.3:7411"}},
            r"serve\.tls_ca: missing, and the registry 10\.1\.2\.3:7411 is not a loopback "
            r"address: .* give tls_ca, the PEM CA bundle",
        ),
        ({"serve": {"registry": "registry.example:7411"}}, r"serve\.tls_ca: missing"),
    ],
)
def test_a_wrong_key_or_value_is_refused_by_name(extra: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        read_settings(extra, **ENGINE)


def test_a_registry_on_loopback_needs_no_ca_bundle() -> None:
    for registry in ("127.0.0.1:7411", "localhost:7411", "[::1]:7411"):
        serve = read_settings({"serve": {"registry": registry}}, **ENGINE).serve
        assert serve is not None and (serve.registry, serve.registry_tls) == (registry, None)


def test_extra_config_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_connector_extra_config: expected a mapping"):
        read_settings(["dram"], **ENGINE)  # type: ignore[arg-type]


def test_xxhash_is_refused_unless_allowed_and_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(InvalidArgumentError, match="not collision resistant"):
        check_stable_hashing("xxhash", allow_xxhash=False)
    with pytest.raises(InvalidArgumentError, match="export PYTHONHASHSEED"):
        check_stable_hashing("xxhash", allow_xxhash=True)
    check_stable_hashing("sha256", allow_xxhash=False)  # seeded with a constant
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    check_stable_hashing("xxhash_cbor", allow_xxhash=True)
    assert read_settings({"allow_xxhash": True}, **ENGINE).allow_xxhash
    with pytest.raises(InvalidArgumentError, match="allow_xxhash: expected true or false"):
        read_settings({"allow_xxhash": "yes"}, **ENGINE)


def test_an_engine_with_a_wrong_key_fails_at_start(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model", seed=0)
    kv = transfer_config({"dram": {"capacity_blocks": 8, "nmae": "typo"}})
    with pytest.raises(Exception, match=r"dram\.nmae: unknown key"), engine(model, kv):
        pass


def test_the_plugin_registers_the_name_without_importing_jax() -> None:
    code = (
        "import sys, tpusync_vllm_plugin as p; p.register(); p.register(); "
        "assert 'jax' not in sys.modules and 'tpusync' not in sys.modules, sorted(sys.modules); "
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; "
        "from vllm.config import KVTransferConfig as K; "
        "c = F.get_connector_class(K(kv_connector='TpuSyncConnector', kv_role='kv_both')); "
        "print(c.__module__, c.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split()[-2:] == ["tpusync._src.connectors.vllm.connector", "TpuSyncConnector"]


def test_the_plugin_is_an_installed_vllm_entry_point() -> None:
    from importlib.metadata import entry_points

    (point,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tpusync"]
    assert point.value == "tpusync_vllm_plugin:register"


def test_the_switch_interval_is_short_while_a_store_is_open_and_put_back_after(
    tmp_path: Path,
) -> None:
    original = sys.getswitchinterval()
    assert read_settings({}, **ENGINE).switch_interval_s == 0.0002
    assert read_settings({"switch_interval_s": None}, **ENGINE).switch_interval_s is None
    for bad in (0, -1, 1, "0.001", True):
        with pytest.raises(InvalidArgumentError, match="switch_interval_s: expected seconds"):
            read_settings({"switch_interval_s": bad}, **ENGINE)
    workers = []
    for engine_id, interval in (("a", None), ("b", 0.001), ("c", 0.0002)):
        extra = {"socket_dir": str(tmp_path), "switch_interval_s": interval}
        settings = read_settings(extra, **{**ENGINE, "engine_id": engine_id})
        worker = WorkerSide(settings, num_blocks=100)
        kv = torch.randn(2, 100, 2, 32, 8).to(torch.bfloat16)
        worker.register({f"layer{i}": kv[i] for i in range(2)})
        workers.append(worker)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # the shortest asked for
        workers[2].close()
        assert sys.getswitchinterval() == pytest.approx(0.0002)  # b still holds it
    finally:
        for worker in workers:
            worker.close()
    assert sys.getswitchinterval() == original


def _group(spec, layers=("model.layers.0.self_attn.attn",)):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec(list(layers), spec)


def _config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))


def _attention(kind: str, **extra):
    import torch
    from vllm.v1 import kv_cache_interface as specs

    return getattr(specs, kind)(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **extra
    )


def test_the_served_attention_layouts_are_accepted() -> None:
    from tpusync._src.connectors.vllm.layouts import check_attention_layout

    full = _attention("FullAttentionSpec")
    sliding = _attention("SlidingWindowSpec", sliding_window=256)
    mla = _attention("MLAAttentionSpec")
    assert check_attention_layout(_config(_group(full)), "fail") == "FullAttentionSpec"
    assert check_attention_layout(_config(_group(sliding)), "fail") == "SlidingWindowSpec"
    assert check_attention_layout(_config(_group(mla)), "recompute") == "MLAAttentionSpec"
    assert check_attention_layout(_config(_group(full)), "recompute") == "FullAttentionSpec"
    assert check_attention_layout(_config(), "fail") is None  # no KV layers to check


@pytest.mark.parametrize(
    ("groups", "policy", "prefix_caching", "message"),
    [
        (  # a hybrid model with vLLM's hybrid allocator on
            [("SlidingWindowSpec", {"sliding_window": 512}), ("FullAttentionSpec", {})],
            "fail", True, r"2 KV cache groups \(SlidingWindowSpec\(sliding_window=512\), "
            r"FullAttentionSpec\): a hybrid model",
        ),
        (
            [("ChunkedLocalAttentionSpec", {"attention_chunk_size": 64})],
            "fail", True, "KV cache layout ChunkedLocalAttentionSpec is not served",
        ),
        (
            [("SinkFullAttentionSpec", {"sink_len": 4})],
            "fail", True, "KV cache layout SinkFullAttentionSpec is not served",
        ),
        (
            [("SlidingWindowSpec", {"sliding_window": 256})],
            "recompute", True, r"kv_load_failure_policy: 'recompute' with sliding-window "
            r"attention \(window 256\).*use kv_load_failure_policy='fail'",
        ),
        (
            [("MLAAttentionSpec", {})],
            "fail", False, "MLA attention with prefix caching off",
        ),
    ],
)  # fmt: skip
def test_a_layout_the_connector_cannot_serve_is_refused_by_name(
    groups, policy, prefix_caching, message
) -> None:
    from tpusync._src.connectors.vllm.layouts import check_attention_layout

    config = _config(
        *(_group(_attention(kind, **extra), [f"l{i}"]) for i, (kind, extra) in enumerate(groups))
    )
    with pytest.raises(InvalidArgumentError, match=message):
        check_attention_layout(config, policy, prefix_caching=prefix_caching)


def test_mamba_is_refused_by_name() -> None:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from tpusync._src.connectors.vllm.layouts import check_attention_layout

    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    with pytest.raises(InvalidArgumentError, match="KV cache layout MambaSpec is not served"):
        check_attention_layout(_config(_group(mamba)), "fail")
