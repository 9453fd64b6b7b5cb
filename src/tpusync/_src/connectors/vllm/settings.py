"""What a vLLM connector is configured with: ``kv_connector_extra_config`` read against the
engine's own config, once per process, at engine start.

The extra config is the plain-data form of :class:`~tpusync.kv.KVStoreConfig`
(:mod:`tpusync._src.kv.config_dict`) plus the connector's own keys (:data:`CONNECTOR_KEYS`). What
the engine already decides — the model, the block size, the tensor-parallel rank and size —
is taken from the engine; given in the extra config too, it must agree (a contradiction is
refused, never guessed). Every error names the key and the fix.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tpusync._src.cluster.tier_specs  # noqa: F401  (registers the "store_node" and "peer" sections)
from tpusync._src.cluster.registry.server import is_loopback
from tpusync._src.kv.config import KVStoreConfig
from tpusync._src.kv.config_dict import client_tls, server_tls
from tpusync._src.kv.tier_specs import DiskTier
from tpusync._src.tiers.files import check_directory
from tpusync.errors import InvalidArgumentError, UnsafeFileError

__all__ = ["CONNECTOR_KEYS", "ConnectorSettings", "check_stable_hashing", "read_settings"]

# the connector's own keys; everything else is the store's
CONNECTOR_KEYS = {
    "lookup_timeout_s": "how long the scheduler waits for the worker's answer (then a miss)",
    "socket_dir": "the private directory of the scheduler-worker lookup socket",
    "allow_xxhash": "accept vLLM's xxhash block hashes (see check_stable_hashing)",
    "load_by_layer": (
        'load a DRAM hit layer by layer, overlapping attention: true, false, or "auto" (the '
        "default: only where the KV is not in CPU memory)"
    ),
    "copy_on_openmp_team": (
        "run a load the forward waits for on the engine's own OpenMP threads (true, the "
        "default) or on tpusync's copy threads (false)"
    ),
    "serve": (
        "serve this engine's DRAM tier to peers and list its blocks in a registry: "
        '{"registry": "host:port", "host": "127.0.0.1", "port": 0, "node_id": <engine id>, '
        '"tls_cert": <PEM>, "tls_key": <PEM> (needed off loopback), "tls_ca": <PEM> (needed '
        "for a registry off loopback)}"
    ),
    "switch_interval_s": (
        "the interpreter's GIL switch interval while the worker's store is open (Python's 5 ms "
        "default lets the engine's busy thread hold up each step of a background pull); null "
        "leaves it as it is"
    ),
    "remote_wait_s": (
        "how long a request whose kv_transfer_params announce a producer's blocks waits for "
        "them to reach the store (then it computes what is missing)"
    ),
}
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_REMOTE_WAIT_S = 10.0
DEFAULT_SWITCH_INTERVAL_S = 0.0002
ROLES = ("kv_both", "kv_producer", "kv_consumer")
CPU_TOKEN_AXIS = 2  # vLLM's CPU layout per layer: [num_blocks, kv_heads, block_size, 2*head_dim]
WHERE = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """The store's config and the connector's own settings for one engine.

    Attributes:
      store: the store the worker side opens (its DRAM capacity defaults to the engine's
        number of KV blocks).
      engine_id: the engine's ``kv_transfer_config.engine_id`` (names the lookup socket).
      lookup_timeout_s: the scheduler's deadline for a lookup answer.
      socket_path: this rank's lookup socket (in a directory only this user can enter).
      socket_paths: every tensor-parallel rank's lookup socket, by rank (the scheduler asks
        them all: a block counts only where every rank holds its part).
      allow_xxhash: whether vLLM's xxhash block hashes are accepted.
      load_by_layer: whether a DRAM hit is loaded layer by layer while the forward runs
        (attention on layer i waits only for layer i), or whole before the forward; ``"auto"``:
        layer by layer only where vLLM's KV tensors are not in CPU memory (on a CPU the load
        and attention share the cores: whole loads measured faster, see
        docs/connectors/vllm.md).
      copy_on_openmp_team: whether a load the forward waits for runs on the forward thread's
        OpenMP team (PyTorch's, whose workers spin right after each operator) rather than on
        tpusync's copy threads, which would share the cores with them
        (:mod:`tpusync._src.memory.openmp_team`).
      role: vLLM's ``kv_role``: ``kv_both`` saves and loads, ``kv_producer`` (a prefill
        engine) only saves and announces what it saved in ``kv_transfer_params``,
        ``kv_consumer`` (a decode engine) only loads.
      remote_wait_s: how long a request announced by a producer waits for its blocks.
      switch_interval_s: the interpreter's GIL switch interval while the worker's store is
        open (see :mod:`tpusync._src.connectors.vllm.switch_interval`), or None to leave it.
      serve: where the worker serves its DRAM tier and which registry lists it (a producer
        whose consumers pull from it directly, with a ``"registry"`` tier), or None.
    """

    store: KVStoreConfig
    engine_id: str
    lookup_timeout_s: float
    socket_path: Path
    allow_xxhash: bool
    socket_paths: tuple[Path, ...] = ()
    load_by_layer: bool | str = "auto"
    copy_on_openmp_team: bool = True
    role: str = "kv_both"
    remote_wait_s: float = DEFAULT_REMOTE_WAIT_S
    switch_interval_s: float | None = DEFAULT_SWITCH_INTERVAL_S
    serve: ServeSettings | None = None


@dataclass(frozen=True)
class ServeSettings:
    """``kv_connector_extra_config.serve``: the worker's DRAM served over the data plane at
    ``host``:``port`` (0: any free port) and listed in the registry at ``registry`` as
    ``node_id``; ``tls``: the data plane's server context (``tls_cert``, ``tls_key``; needed
    off loopback), ``registry_tls``: the client context for the registry (``tls_ca``; needed
    for a registry off loopback)."""

    registry: str
    host: str = "127.0.0.1"
    port: int = 0
    node_id: str = ""
    tls: ssl.SSLContext | None = None
    registry_tls: ssl.SSLContext | None = None


def _serve(value: Any, engine_id: str, rank: int, tp_size: int) -> ServeSettings | None:
    if value is None:
        return None
    where = f"{WHERE}.serve"
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{where}: expected an object, got {type(value).__name__}")
    known = ("registry", "host", "port", "node_id", "tls_cert", "tls_key", "tls_ca")
    unknown = set(value) - set(known)
    if unknown:
        raise InvalidArgumentError(
            f"{where}.{sorted(unknown)[0]}: unknown key; serve takes {', '.join(known)}"
        )
    registry = value.get("registry")
    if not isinstance(registry, str) or ":" not in registry:
        raise InvalidArgumentError(f"{where}.registry: expected 'host:port', got {registry!r}")
    host = value.get("host", "127.0.0.1")
    port = value.get("port", 0)
    node_id = value.get("node_id", f"vllm-{engine_id}")
    if not isinstance(host, str) or not host:
        raise InvalidArgumentError(f"{where}.host: expected a host name, got {host!r}")
    if type(port) is not int or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"{where}.port: expected 0 to 65535, got {port!r}")
    if not isinstance(node_id, str) or not node_id:
        raise InvalidArgumentError(f"{where}.node_id: expected a name, got {node_id!r}")
    if tp_size > 1:
        if port != 0:
            raise InvalidArgumentError(
                f"{where}.port: {port} would be taken by every one of the {tp_size} "
                "tensor-parallel ranks; leave port out (0: each rank its own free port)"
            )
        node_id += f"-tp{rank}"  # each rank serves its own part of the blocks
    tls = None
    if "tls_cert" in value or "tls_key" in value:
        tls = server_tls(value.get("tls_cert"), value.get("tls_key"), where)
    elif not is_loopback(host):
        raise InvalidArgumentError(
            f"{where}.host: {host} is not a loopback address, and blocks leave this host only "
            "encrypted: give tls_cert and tls_key (PEM files; tls_ca for a TLS registry)"
        )
    registry_tls = None
    if "tls_ca" in value:
        registry_tls = client_tls(value["tls_ca"], f"{where}.tls_ca")
    elif not is_loopback(registry.rpartition(":")[0]):
        # here, at engine start: the registry's client would refuse it once the store opens
        raise InvalidArgumentError(
            f"{where}.tls_ca: missing, and the registry {registry} is not a loopback address: a "
            "registry off loopback is reached only over TLS; give tls_ca, the PEM CA bundle that "
            "verifies the registry's certificate (for a self-signed one, its --tls-cert file)"
        )
    return ServeSettings(registry, host, port, node_id, tls, registry_tls)


def _engine_value(data: dict[str, Any], key: str, engine: Any, engine_key: str) -> Any:
    """``data[key]`` if given and equal to the engine's ``engine`` (else refused), or the
    engine's value."""
    if key in data and data[key] != engine:
        raise InvalidArgumentError(
            f"{WHERE}.{key}: {data[key]!r} contradicts the engine's {engine_key} ({engine!r}); "
            f"leave {key} out (the connector takes it from the engine) or change {engine_key}"
        )
    return engine


def _timeout(value: Any, key: str = "lookup_timeout_s", high: float = 60) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= high:
        raise InvalidArgumentError(
            f"{WHERE}.{key}: expected seconds in (0, {high:g}], got {value!r}"
        )
    return float(value)


def default_socket_dir() -> Path:
    """Where the lookup socket goes without ``socket_dir``: a directory no other user can make
    first. ``$XDG_RUNTIME_DIR``, else ``~/.cache/tpusync-vllm``, each only where the directory
    (and ``~/.cache``) is this uid's and no one else may write it and the path is short enough
    for a socket; else ``/tmp/tpusync-vllm-<uid>``, which another user could make first: the
    engine then refuses to start and says to give ``socket_dir``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _private(Path(runtime)):
        return Path(runtime) / f"tpusync-vllm-{os.getuid()}"
    home = Path(os.path.expanduser("~"))
    below = home / ".cache" / "tpusync-vllm"
    # the socket's name is 29 bytes more; sun_path holds 107
    if home.is_absolute() and len(os.fsencode(below)) <= 107 - 29 and _private(home):
        cache = home / ".cache"
        if not os.path.lexists(cache) or _private(cache):
            return below
    return Path(tempfile.gettempdir()) / f"tpusync-vllm-{os.getuid()}"


def _private(path: Path) -> bool:
    """Whether ``path`` is a directory (not a symlink) of this uid that its group and others
    cannot write (:func:`~tpusync._src.tiers.files.check_directory`): nobody else can make or swap
    what is below it."""
    try:
        check_directory(path)
    except OSError:  # UnsafeFileError is one, as is a missing directory
        return False
    return True


def _socket_path(directory: Any, engine_id: str, rank: int = 0, tp_size: int = 1) -> Path:
    if directory is None:
        directory = default_socket_dir()
    elif not isinstance(directory, str) or not directory:
        raise InvalidArgumentError(
            f"{WHERE}.socket_dir: expected a directory path, got {directory!r}"
        )
    name = "lookup-" + hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    name += f"-tp{rank}.sock" if tp_size > 1 else ".sock"
    path = Path(directory) / name
    if len(os.fsencode(path)) > 107:  # sun_path holds 108 bytes with its NUL
        raise InvalidArgumentError(
            f"{WHERE}.socket_dir: {directory} is too long for a Unix socket path "
            f"({len(os.fsencode(path))} bytes with the socket's name, at most 107); choose a "
            "shorter directory"
        )
    return path


def read_settings(
    extra: Mapping[str, Any] | None,
    *,
    model: str,
    block_size: int,
    tp_rank: int,
    tp_size: int,
    num_blocks: int | None,
    engine_id: str,
    role: str = "kv_both",
    token_axis: int = CPU_TOKEN_AXIS,
    layout: str = "CPU KV layout",
) -> ConnectorSettings:
    """The settings ``extra`` (``kv_connector_extra_config``) describes for this engine, whose
    KV arrays (``layout``) index blocks on axis 0 and tokens on ``token_axis``.

    Raises :class:`~tpusync.errors.InvalidArgumentError` naming the key for an unknown key, a
    wrong value, or a value that contradicts the engine's config.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(
            f"{WHERE}: expected a mapping (a dict or JSON object), got {type(extra).__name__}"
        )
    if role not in ROLES:
        raise InvalidArgumentError(f"kv_role: expected one of {', '.join(ROLES)}, got {role!r}")
    data = dict(extra)
    own = {key: data.pop(key) for key in list(data) if key in CONNECTOR_KEYS}
    data["model_id"] = data.get("model_id", model)
    data["block_size"] = _engine_value(data, "block_size", block_size, "block_size")
    data["shard_rank"] = _engine_value(data, "shard_rank", tp_rank, "tensor-parallel rank")
    data["shard_count"] = _engine_value(data, "shard_count", tp_size, "tensor_parallel_size")
    for key, value in (("block_axis", 0), ("token_axis", token_axis)):
        data[key] = _engine_value(data, key, value, f"{layout}'s {key}")
    if "dram" not in data:
        if num_blocks is None:
            data["dram"] = {"capacity_blocks": 1}  # the scheduler side opens no store
        else:
            data["dram"] = {"capacity_blocks": int(num_blocks)}
    try:
        store = KVStoreConfig.from_dict(data)
    except (InvalidArgumentError, UnsafeFileError) as error:  # e.g. an unsafe secret_file
        raise type(error)(f"{WHERE}: {error}") from None
    if tp_size > 1:
        _check_per_rank(store, tp_size)
    sockets = tuple(
        _socket_path(own.get("socket_dir"), engine_id, rank, tp_size) for rank in range(tp_size)
    )
    return ConnectorSettings(
        store=store,
        engine_id=engine_id,
        lookup_timeout_s=_timeout(own.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S)),
        socket_path=sockets[tp_rank],
        socket_paths=sockets,
        allow_xxhash=_flag(own.get("allow_xxhash", False), "allow_xxhash"),
        load_by_layer=_by_layer(own.get("load_by_layer", "auto")),
        copy_on_openmp_team=_flag(own.get("copy_on_openmp_team", True), "copy_on_openmp_team"),
        role=role,
        remote_wait_s=_timeout(
            own.get("remote_wait_s", DEFAULT_REMOTE_WAIT_S), "remote_wait_s", 3600
        ),
        serve=_serve(own.get("serve"), engine_id, tp_rank, tp_size),
        switch_interval_s=_switch_interval(own.get("switch_interval_s", DEFAULT_SWITCH_INTERVAL_S)),
    )


def _switch_interval(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1e-6 <= value <= 0.1:
        raise InvalidArgumentError(
            f"{WHERE}.switch_interval_s: expected seconds in [1e-06, 0.1] or null (leave the "
            f"interpreter's as it is), got {value!r}"
        )
    return float(value)


def _check_per_rank(store: KVStoreConfig, tp_size: int) -> None:
    """With tensor parallelism every rank opens its own store: tiers that one process owns by
    name or directory would be opened by every rank, so they are refused (a shared filesystem,
    a store node and peers take every rank, their keys name it)."""
    if store.dram.name is not None:
        raise InvalidArgumentError(
            f"{WHERE}.dram.name: a named DRAM pool is one process's, and each of the "
            f"{tp_size} tensor-parallel ranks opens its own; leave name out with "
            "tensor_parallel_size > 1"
        )
    for tier in store.tiers:
        if isinstance(tier, DiskTier):
            raise InvalidArgumentError(
                f"{WHERE}.disk: a disk tier's directory is one process's, and each of the "
                f"{tp_size} tensor-parallel ranks opens its own store; with "
                "tensor_parallel_size > 1 use shared_fs (or a store node) below DRAM"
            )


def _by_layer(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise InvalidArgumentError(
        f'{WHERE}.load_by_layer: expected true, false or "auto", got {value!r}'
    )


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{WHERE}.{key}: expected true or false, got {value!r}")
    return value


def check_stable_hashing(hash_algo: str, *, allow_xxhash: bool) -> None:
    """Refuses block hashes a store shared across processes cannot trust. vLLM's xxhash is
    not collision resistant: one who chooses prompts can make another prompt's hash and plant
    KV under it in a store that outlives the engine; and it is seeded at random per process
    unless ``PYTHONHASHSEED`` is set, so no other process would find the blocks. The sha256
    algorithms (vLLM's default) have neither problem."""
    if not hash_algo.startswith("xxhash"):
        return
    if not allow_xxhash:
        raise InvalidArgumentError(
            f"prefix_caching_hash_algo: {hash_algo!r} is not collision resistant, so a client "
            "choosing prompts could plant KV under another prompt's hash in the shared store; "
            "use the default 'sha256' (or 'sha256_cbor'), or set "
            f'"allow_xxhash": true in {WHERE} if every client is trusted'
        )
    if not os.environ.get("PYTHONHASHSEED"):
        raise InvalidArgumentError(
            f"prefix_caching_hash_algo: {hash_algo!r} seeds vLLM's block hashes at random in "
            "every process unless PYTHONHASHSEED is set, so no other process would find this "
            "engine's blocks; export PYTHONHASHSEED (the same value for every engine that "
            "shares the store) or use the default 'sha256'"
        )
