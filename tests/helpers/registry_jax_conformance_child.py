"""The registry conformance suite against the real coordination service of a 1-process
``jax.distributed`` job (run by tests/testing/test_conformance.py):
``python registry_jax_conformance_child.py <coordinator port>``.

Prints one ``RESULT {json}`` line per conformance case (``{"case", "ok", "error"}``, each case
on a fresh :class:`JaxRegistry` under a prefix of its own), then one with what the raw
key-value calls of :data:`KV_SCRIPT` answered (``{"kv_script": [...]}``), which the test replays
on tests/cluster/test_registry.py's FakeCoordinationClient: the fake must answer the same.
"""

from __future__ import annotations

import json
import sys
import traceback
import uuid
from typing import Any

import jax
from jax._src.distributed import global_state  # private jax: the client of initialize()

from tpusync._src.testing.conformance import REGISTRY_CASES
from tpusync.cluster import JaxRegistry

# (call, arguments): the key-value calls JaxRegistry makes, on the keys and subtrees it uses,
# and the errors it relies on (a missing key, a refused overwrite)
KV_SCRIPT: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("key_value_try_get", ("kv/node/absent",)),
    ("key_value_dir_get", ("kv/node",)),
    ("key_value_set", ("kv/node/a", "1", True)),
    ("key_value_set", ("kv/node/a", "2", False)),
    ("key_value_set", ("kv/node/a", "3", True)),
    ("key_value_try_get", ("kv/node/a",)),
    ("key_value_set", ("kv/node/a%2Fb", "4", True)),
    ("key_value_set", ("kv/node!", "5", True)),
    ("key_value_set", ("kv/nodes/x", "6", True)),
    ("key_value_set", ("kv/blk/ab/n1", "dram", True)),
    ("key_value_set", ("kv/blk/ab/n2", "disk", True)),
    ("key_value_set", ("kv/blk/ab", "self", True)),
    ("key_value_set", ("kv/blk/abc/n1", "shm", True)),
    ("key_value_dir_get", ("kv/node",)),
    ("key_value_dir_get", ("kv/node/",)),
    ("key_value_dir_get", ("kv/blk/ab",)),
    ("key_value_dir_get", ("kv/blk",)),
    ("key_value_delete", ("kv/blk/ab",)),
    ("key_value_dir_get", ("kv/blk",)),
    ("key_value_try_get", ("kv/blk/ab",)),
    ("key_value_delete", ("kv/absent/subtree",)),
    ("key_value_delete", ("kv/node/a",)),
    ("key_value_try_get", ("kv/node/a",)),
    ("key_value_dir_get", ("kv",)),
)


def run_kv_script(client: Any) -> list[dict[str, Any]]:
    """What each call of :data:`KV_SCRIPT` returned or raised (the error's type and text)."""
    answers: list[dict[str, Any]] = []
    for call, args in KV_SCRIPT:
        try:
            value = getattr(client, call)(*args)
        except Exception as exc:
            answers.append({"raised": type(exc).__qualname__, "message": str(exc)})
        else:
            answers.append(
                {"returned": [list(p) for p in value] if call.endswith("dir_get") else value}
            )
    return answers


def emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    port = int(sys.argv[1])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=1,
        process_id=0,
        initialization_timeout=20,
        heartbeat_timeout_seconds=5,
        shutdown_timeout_seconds=5,
    )
    client = global_state.client

    def make_registry() -> JaxRegistry:  # fresh and empty: a prefix of its own
        return JaxRegistry(prefix=f"conformance/{uuid.uuid4().hex[:12]}", client=client)

    for case in REGISTRY_CASES:
        try:
            case(make_registry)
        except Exception:
            emit({"case": case.__name__, "ok": False, "error": traceback.format_exc()})
        else:
            emit({"case": case.__name__, "ok": True, "error": ""})
    emit({"kv_script": run_kv_script(client)})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
