"""The layer contract, read from the source with ``ast``: the public modules only
re-export names of the private ``tpusync._src``, each public name from one of them, and nothing in
``_src`` imports them; no module imports another package's ``_private`` module or name;
no function-local import except an optional heavy dependency marked as one (or a command the
``tpusync`` command runs); no import cycle among tpusync modules, function-local imports included;
no deprecation shim. The layer order itself is checked by import-linter (``lint-imports``,
configured in ``pyproject.toml``, without exemptions); the last test runs it where it is installed.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import REPO

SRC = REPO / "src"
PACKAGE = SRC / "tpusync"

# A function-local import is allowed only with the marker of its kind in a comment on its line
# (or on the line above), and only of these optional or heavy dependencies.
LAZY_ALLOWED = {
    "matplotlib": "optional heavy dependency",  # tpusync[demo]: only `tpusync demo --plot`
    "redis": "optional heavy dependency",  # tpusync[cluster]: only RedisRegistry
    "torch": "optional heavy dependency",  # PyTorch tensors and engine connectors
    "orbax": "optional heavy dependency",  # tpusync[bench]: the weights benchmark's baseline
    "nixl": "optional heavy dependency",  # vLLM's NixlConnector: the disaggregation peer
    # vLLM's NIXL connector package: importing it loads nixl (the benchmark's engines only)
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl": "optional heavy dependency",
    # jax's private modules, looked up where used, so a jax that moves them breaks one call
    "jax._src": "private jax internals",
}
# The `tpusync` command imports each command's module (and its names) when that command runs,
# so that --version and --help import no JAX (issue 54).
LAZY_COMMANDS = {
    "tpusync._src.cli": (
        "tpusync._src.bench.command",
        "tpusync._src.demo",
        "tpusync._src.health",
        "tpusync._src.info",
        "tpusync._src.serve",
        "tpusync._src.tiers.dram.shm_admin",
    )
}


# Modules with a module ``__getattr__``: only these, to import heavy names on first use (so
# that `import tpusync` and the `tpusync` command's --help import no JAX, issue 54, and the vLLM
# connector's lookup client, which its tests run as another user, imports no vLLM), never to
# forward an old spelling to a new home.
MODULE_GETATTR = {"tpusync", "tpusync.connectors.vllm"}
# What a deprecation path warns with: the package is a pre-release, it keeps none (issue 55).
DEPRECATION_WARNINGS = {"DeprecationWarning", "PendingDeprecationWarning", "FutureWarning"}


@dataclass(frozen=True)
class Import:
    """One imported module (or module.name) of a tpusync source file."""

    importer: str  # the importing module, dotted
    target: str  # the module, or module.name, imported
    line: int
    local: bool  # inside a function
    runs: bool  # executed at import time (not under ``if TYPE_CHECKING:``)
    comments: str  # the comments on its lines and the line above


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _modules() -> dict[str, Path]:
    """Every tpusync module: the Python sources and the native extensions (``.pyx``)."""
    return {**{_module_name(p): p for p in sorted(PACKAGE.rglob("*.pyx"))}, **_sources()}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, local: bool, runs: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Yield (import node, local, runs) for every import below ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, local, runs
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, True, runs)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), local, False)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), local, runs)
        else:
            yield from _walk(child, local, runs)


def _imports(name: str, path: Path) -> list[Import]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node, local, runs in _walk(ast.parse(text), False, True):
        around = lines[max(node.lineno - 2, 0) : node.end_lineno]
        comments = " ".join(line.partition("#")[2] for line in around)
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:  # the module, and each name (the name may be a submodule)
            module = _absolute(node, name, _is_package(path))
            targets = [module] + [f"{module}.{a.name}" for a in node.names if a.name != "*"]
        found += [Import(name, t, node.lineno, local, runs, comments) for t in targets]
    return found


def _all_imports() -> list[Import]:
    return [i for name, path in _sources().items() for i in _imports(name, path)]


def _owner(dotted: list[str], i: int, modules: dict[str, Path]) -> str:
    """The package that owns the private component ``dotted[i]``: the package it sits in."""
    parent = ".".join(dotted[:i])
    path = modules.get(parent)
    if path is not None and not _is_package(path):  # a name in a module: the module's package
        parent = ".".join(dotted[: i - 1])
    return parent


def private_violations() -> list[str]:
    """Imports of a ``_private`` module or name from outside the package that owns it."""
    modules = _modules()
    bad = []
    for imp in _all_imports():
        dotted = imp.target.split(".")
        if dotted[0] != "tpusync":
            continue
        for i, part in enumerate(dotted[1:], start=1):
            if part.startswith("_") and not part.startswith("__"):
                owner = _owner(dotted, i, modules)
                if imp.importer != owner and not imp.importer.startswith(owner + "."):
                    bad.append(f"{imp.importer}:{imp.line} imports {imp.target}")
    return sorted(set(bad))


def lazy_violations() -> list[str]:
    """Function-local imports that are neither a marked optional dependency nor exempt."""
    bad = []
    for imp in _all_imports():
        if not imp.local or not imp.runs:
            continue
        marker = next(
            (m for root, m in LAZY_ALLOWED.items() if f"{imp.target}.".startswith(f"{root}.")),
            None,
        )
        if marker is not None and marker in imp.comments:
            continue
        commands = LAZY_COMMANDS.get(imp.importer, ())
        if any(imp.target == m or imp.target.startswith(f"{m}.") for m in commands):
            continue
        bad.append(f"{imp.importer}:{imp.line} imports {imp.target} inside a function")
    return sorted(set(bad))


def scaffolding(name: str, path: Path) -> list[str]:
    """The signs of a deprecation path in module ``name`` (at ``path``): a docstring that starts
    "Deprecated", a module ``__getattr__`` outside :data:`MODULE_GETATTR` (and there, a lazy
    name that ``__all__`` does not list), a deprecation warning class named."""
    tree = ast.parse(path.read_text())
    found = []
    if (ast.get_docstring(tree) or "").startswith("Deprecated"):
        found.append(f"{name}: a deprecated module")
    assigned = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in tree.body:
        is_getattr = isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        if is_getattr and name not in MODULE_GETATTR:
            found.append(f"{name}:{node.lineno} defines a module __getattr__")
        elif is_getattr:  # it may serve only the public names it imports on first use
            public = set(ast.literal_eval(assigned["__all__"]))
            lazy = set(ast.literal_eval(assigned["_LAZY"]))
            found += [f"{name}: __getattr__ serves {n}, not in __all__" for n in lazy - public]
    for node in ast.walk(tree):
        named = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if named in DEPRECATION_WARNINGS:
            found.append(f"{name}:{node.lineno} names {named}")
    return found


def scaffolding_violations() -> list[str]:
    return sorted(v for name, path in _sources().items() for v in scaffolding(name, path))


def _graph() -> dict[str, set[str]]:
    """Import edges between tpusync modules, function-local imports included, as import-linter
    counts them: ``from a import b`` imports the module ``a.b`` where there is one, else ``a``.
    Imports under ``if TYPE_CHECKING:`` are left out (they never run)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    by_line: dict[tuple[str, int], list[str]] = {}
    for imp in _all_imports():
        if imp.runs and imp.target.startswith("tpusync"):
            by_line.setdefault((imp.importer, imp.line), []).append(imp.target)
    for (importer, _), (module, *names) in by_line.items():
        found = {n if n in modules else module for n in names} if names else {module}
        graph[importer].update(t for t in found if t in modules and t != importer)
    return graph


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """The reader finds a function-local import, its marker, a relative import and a
    TYPE_CHECKING-only import (so the empty answers below are not vacuous)."""
    path = tmp_path / "probe.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import pool_file\n"
        "if TYPE_CHECKING:\n"
        "    from tpusync._src.kv import store\n"
        "def f():\n"
        "    import redis  # optional heavy dependency\n"
        "    from tpusync._src.cluster import serving\n"
    )
    got = {i.target: i for i in _imports("tpusync._src.tiers.probe", path)}
    assert got["tpusync._src.tiers.pool_file"].local is False
    assert got["tpusync._src.kv.store"].runs is False
    assert got["redis"].local and "optional heavy dependency" in got["redis"].comments
    assert got["tpusync._src.cluster.serving"].local
    modules = _modules()
    assert _owner(["tpusync", "_src", "tiers", "_room"], 3, modules) == "tpusync._src.tiers"
    assert _owner(["tpusync", "_src", "tiers", "base", "_x"], 4, modules) == "tpusync._src.tiers"
    assert _owner(["tpusync", "_src"], 1, modules) == "tpusync"
    assert "tpusync._native.core" in modules and "tpusync._native.copy" in modules


def public_modules() -> dict[str, Path]:
    """The public modules: every module outside ``tpusync._src`` with no private part."""
    return {
        name: path
        for name, path in _sources().items()
        if not any(p.startswith("_") for p in name.split(".")[1:])
    }


def _public_names(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


# Public modules that define what they export (the bottom layer, which _src imports) or hold no
# names: the others only re-export.
DEFINING = {"tpusync.errors", "tpusync.options"}


def test_each_public_name_is_exported_from_one_public_module() -> None:
    modules = public_modules()
    assert {"tpusync", "tpusync.kv", "tpusync.tiers", "tpusync.cluster", "tpusync.weights"} <= set(
        modules
    )
    assert {"tpusync.connectors.vllm", "tpusync.testing.model", "tpusync.errors"} <= set(modules)
    exported: dict[str, list[str]] = {}
    for name, path in modules.items():
        for public in _public_names(path):
            exported.setdefault(public, []).append(name)
    assert {n: where for n, where in exported.items() if len(where) > 1} == {}


def test_public_modules_only_re_export() -> None:
    """A public module defines no function or class of its own (a module ``__getattr__`` that
    imports a heavy name on first use aside), so every implementation is under ``_src``."""
    defined = []
    for name, path in public_modules().items():
        if name in DEFINING:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name not in (
                "__getattr__",
                "__dir__",
            ):
                defined.append(f"{name}:{node.lineno} defines {node.name}")
    assert defined == []


def test_nothing_in_src_imports_a_public_module() -> None:
    """The core never depends on what it exports (function-local imports included)."""
    public = set(public_modules()) - DEFINING - {"tpusync"}
    bad = [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in _all_imports()
        if i.importer.startswith("tpusync._src")
        and any(i.target == m or i.target.startswith(f"{m}.") for m in public)
    ]
    assert bad == []


def test_the_scaffolding_check_sees_a_shim(tmp_path: Path) -> None:
    path = tmp_path / "old.py"
    path.write_text(
        '"""Deprecated: moved to tpusync.new."""\n'
        "import warnings\n"
        "def __getattr__(name):\n"
        "    warnings.warn(name, DeprecationWarning)\n"
    )
    assert scaffolding("tpusync.old", path) == [
        "tpusync.old: a deprecated module",
        "tpusync.old:3 defines a module __getattr__",
        "tpusync.old:4 names DeprecationWarning",
    ]
    assert set(_sources()) >= MODULE_GETATTR


def test_no_deprecation_shim_warning_or_forwarding_getattr() -> None:
    """A pre-release keeps no old spellings: no module warns of deprecation, and a module
    ``__getattr__`` only imports a heavy name on first use (issue 55)."""
    assert scaffolding_violations() == []


def test_no_module_imports_another_packages_private_names() -> None:
    assert private_violations() == []


def test_function_local_imports_are_marked_optional_heavy_dependencies() -> None:
    assert lazy_violations() == []


def test_no_import_cycle_not_even_through_a_function_local_import() -> None:
    assert cycles() == []


def test_lint_imports_keeps_the_layer_contract() -> None:
    """``lint-imports`` (import-linter, the contract in pyproject.toml) passes on the source."""
    beside = Path(sys.executable).parent / "lint-imports"
    exe = str(beside) if beside.exists() else shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed: pip install '.[test]' (scripts/test.sh does)")
    env = {"PYTHONPATH": str(SRC), "PATH": str(beside.parent), "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [exe, "--no-cache"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layer_contracts_carry_no_exemption() -> None:
    """No contract ignores an import: an exemption would let a layer reach up unseen."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    exempt = [c["id"] for c in contracts["contracts"] if c.get("ignore_imports")]
    assert len(contracts["contracts"]) >= 6 and exempt == []


if __name__ == "__main__":  # a report of everything the checks find
    print("\n".join(private_violations() + lazy_violations() + scaffolding_violations()))
    print("\n".join(" -> ".join(c) for c in cycles()))
