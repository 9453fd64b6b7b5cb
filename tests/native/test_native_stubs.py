"""The native core's layout: one extension per job in tpusync._native, each with a type stub that
names what it defines, and tpusync._native.core answering every one of those names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

from tpusync._native import core as _core

PACKAGE = Path(_core.__file__).parent
JOBS = ["copy", "checksum", "net", "pjrt"]


def _stub_names(stub: Path) -> set[str]:
    """The names a stub defines at its top level (functions, classes, constants, re-exports)."""
    names: set[str] = set()
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tpusync.")
        ):
            names.update(alias.asname for alias in node.names if alias.asname == alias.name)
    return names


def _defined_here(module: ModuleType) -> set[str]:
    """The entry points a native module defines itself: not dunders, not imported names, not
    private constants."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, ModuleType):
            continue
        owner = getattr(value, "__module__", module.__name__)
        if callable(value) and owner != module.__name__:
            continue  # imported (e.g. an error class), or a Cython helper of another module
        if name.endswith("_cython__") or (name.startswith("_") and not callable(value)):
            continue  # Cython's pickling helpers; private constants (not entry points)
        names.add(name)
    return names


@pytest.mark.parametrize("job", JOBS)
def test_each_job_extension_has_a_stub_naming_its_entry_points(job: str) -> None:
    module = importlib.import_module(f"tpusync._native.{job}")
    stub = PACKAGE / f"{job}.pyi"
    assert stub.is_file(), f"{stub} is missing"
    assert _stub_names(stub) == _defined_here(module)


@pytest.mark.parametrize("job", JOBS)
def test_core_reexports_every_name_of_each_job(job: str) -> None:
    """``tpusync._native.core`` answers each name with the very object its job's extension
    defines."""
    module = importlib.import_module(f"tpusync._native.{job}")
    for name in _defined_here(module):
        assert name in _core.__all__, name
        assert getattr(_core, name) is getattr(module, name), name


def test_core_stub_names_every_name_of_the_core() -> None:
    stub = _stub_names(PACKAGE / "core.pyi")
    assert stub == set(_core.__all__)
    assert all(hasattr(_core, name) for name in _core.__all__)
