"""TpuSyncConnector against the connector interface of the newest vLLM release on PyPI (its
``kv_connector/v1/base.py``, fetched by scripts/_vllm_venv.sh: that release's engine is a GPU
build and cannot run here). Read with ``ast``, never imported: every abstract method is
implemented, every method the connector overrides takes the parameters that release passes,
and the constructor takes ``kv_cache_config``."""

from __future__ import annotations

import ast
import inspect
import os
import sys
from pathlib import Path

import pytest
from tools import tools_required

from tpusync.connectors.vllm import TpuSyncConnector

BASE = Path(os.environ.get("TPUSYNC_VLLM_NEWEST_API", Path(sys.prefix) / "vllm-newest-api"))


def _newest() -> tuple[str, ast.ClassDef, dict[str, ast.ClassDef]]:
    path = BASE / "base.py"
    if not path.is_file():
        message = (
            f"{path} is missing: scripts/_vllm_venv.sh fetches it "
            "(python scripts/fetch_vllm_connector_api.py DIR)"
        )
        if tools_required():
            pytest.fail(message)
        pytest.skip(message)
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    return (BASE / "VERSION").read_text().strip(), classes["KVConnectorBase_V1"], classes


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _decorators(method: ast.FunctionDef) -> set[str]:
    return {
        d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in method.decorator_list
    }


def _parameters(method: ast.FunctionDef) -> list[str]:
    """The names vLLM may pass (positional and keyword; self/cls and **kwargs aside)."""
    args = method.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)][1:]


def _ours(name: str) -> inspect.Signature | None:
    """The signature of ``name`` where TpuSyncConnector itself defines it."""
    for klass in TpuSyncConnector.__mro__:
        if klass.__module__.startswith("vllm."):
            return None  # vLLM's own (installed) definition: nothing of ours to check
        if name in vars(klass):
            member = inspect.getattr_static(klass, name)
            function = member.fget if isinstance(member, property) else member
            return inspect.signature(getattr(function, "__func__", function))
    return None


def test_every_abstract_method_of_the_newest_interface_is_implemented() -> None:
    version, base, _ = _newest()
    abstract = [n for n, m in _methods(base).items() if "abstractmethod" in _decorators(m)]
    assert abstract, f"vLLM {version}: no abstract method found; the test reads the wrong file"
    missing = [name for name in abstract if _ours(name) is None]
    assert not missing, f"vLLM {version}'s abstract methods TpuSyncConnector lacks: {missing}"


def test_every_method_it_overrides_takes_what_the_newest_vllm_passes() -> None:
    version, base, _ = _newest()
    wrong = {}
    for name, method in _methods(base).items():
        ours = _ours(name)
        if ours is None or name == "__init__":
            continue
        theirs = _parameters(method)
        mine = [p for p in ours.parameters if p not in ("self", "cls")]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in ours.parameters.values())
        if mine[: len(theirs)] != theirs and not takes_any:
            wrong[name] = (theirs, mine)
        kinds = _decorators(method) & {"classmethod", "staticmethod", "property"}
        member = inspect.getattr_static(TpuSyncConnector, name)
        if "classmethod" in kinds and not isinstance(member, classmethod):
            wrong[name] = ("a classmethod in vLLM", type(member).__name__)
        if "property" in kinds and not isinstance(member, property):
            wrong[name] = ("a property in vLLM", type(member).__name__)
    assert not wrong, f"vLLM {version}: {wrong}"


def test_the_constructor_takes_kv_cache_config_and_hybrid_is_not_claimed() -> None:
    version, base, classes = _newest()
    theirs = _parameters(_methods(base)["__init__"])
    assert theirs == ["vllm_config", "role", "kv_cache_config"], version
    ours = list(inspect.signature(TpuSyncConnector.__init__).parameters)[1:]
    assert ours[:3] == theirs
    # several KV-cache groups are refused at start (connectors/vllm/layouts.py): the
    # connector must not tell vLLM it handles them (SupportsHMA keeps the hybrid allocator on)
    assert "SupportsHMA" in classes, version
    assert not any(k.__name__ == "SupportsHMA" for k in TpuSyncConnector.__mro__)
    # a cache never hands KV off: a request preempted mid-save is only a later miss
    assert "requires_kv_delivery" in _methods(base)
    assert TpuSyncConnector.__dict__["requires_kv_delivery"].fget(None) is False
    # its views of vLLM's KV tensors cannot follow a sleep's remap
    assert "supports_sleep_mode" in _methods(base)
    assert TpuSyncConnector.supports_sleep_mode(None) is False
