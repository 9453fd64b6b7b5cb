"""The transfer engine: typed options read once, one Engine interface, one chooser,
imports that run down the layers (memory < engines < transfer)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import tpusync
from tpusync import options
from tpusync._src.engines import native, pure_jax
from tpusync._src.engines.base import Engine
from tpusync._src.engines.devices import device_path
from tpusync._src.transfer import select
from tpusync.errors import InvalidArgumentError, NativePathUnavailableError

PACKAGE = Path(tpusync.__file__).resolve().parent
LAYERS = {"memory": 0, "engines": 1, "transfer": 2}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every tpusync module a file imports, and whether the import sits inside a function."""
    tree = ast.parse(path.read_text())
    local = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(name, id(node) in local) for name in names if name.startswith("tpusync")]
    return found


def _engine_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (PACKAGE / layer).rglob("*.py"))


def test_options_from_environment_are_typed_and_documented_overrides() -> None:
    assert options.from_environment({}) == options.Options()
    got = options.from_environment(
        {
            "TPUSYNC_COPY_THREADS": "3",
            "TPUSYNC_PJRT": "1",
            "TPUSYNC_PJRT_STAGE_BELOW": "0",
            "TPUSYNC_HUGE_PAGES": "0",
        }
    )
    assert got == options.Options(copy_threads=3, pjrt=True, pjrt_stage_below=0, huge_pages=False)
    with pytest.raises(InvalidArgumentError, match="TPUSYNC_COPY_THREADS"):
        options.from_environment({"TPUSYNC_COPY_THREADS": "many"})
    with pytest.raises(InvalidArgumentError, match="copy_threads"):
        options.Options(copy_threads=0)
    for name in ("TPUSYNC_COPY_THREADS", "TPUSYNC_PJRT", "TPUSYNC_HUGE_PAGES"):
        assert name in options.__doc__


def test_options_overridden_restores_and_reaches_the_engines() -> None:
    before = options.current()
    with options.overridden(huge_pages=False, pjrt_stage_below=5, copy_threads=2):
        assert tpusync.info().host.huge_pages_for_cpu_pools is False
        assert native.copy_threads() == 2
    assert options.current() is before
    with pytest.raises(InvalidArgumentError, match="options"):
        options.set_current({"pjrt": True})  # type: ignore[arg-type]
    assert options.current() is before


def test_the_environment_is_read_once_at_import() -> None:
    code = (
        "import os, tpusync; from tpusync._src.memory import huge_pages\n"
        "assert not huge_pages.enabled()\n"
        "os.environ['TPUSYNC_HUGE_PAGES'] = '1'\n"
        "assert not huge_pages.enabled()  # read once, at import\n"
        "print('ok')"
    )
    env = {"JAX_PLATFORMS": "cpu", "TPUSYNC_HUGE_PAGES": "0", "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_no_module_below_the_surface_reads_the_environment() -> None:
    for path in _engine_files():
        assert "os.environ" not in path.read_text(), path


def test_imports_run_down_the_layers_at_module_level() -> None:
    for path in _engine_files():
        mine = LAYERS[path.relative_to(PACKAGE).parts[0]]
        for name, in_function in _imports(path):
            assert not in_function, f"{path}: function-local import of {name}"
            parts = name.split(".")
            layer = LAYERS.get(parts[1]) if len(parts) > 1 else None
            assert layer is None or layer <= mine, f"{path} imports {name} from a layer above"
            assert name != "tpusync._src.transfer.select" or mine == LAYERS["transfer"], path
            assert not any(p.startswith("_") and p != "_core" for p in parts[1:-1]), (path, name)


def test_engines_implement_one_interface_and_one_module_chooses() -> None:
    assert set(select.ENGINES) == {"native", "jax"}
    for engine in (native.ENGINE, pure_jax.ENGINE):
        assert isinstance(engine.name, str) and callable(engine.unavailable)
        assert callable(engine.run)
        _: Engine = engine  # the protocol, checked by type checkers
    assert select.PATHS == ("auto", "native", "jax")


def test_info_reads_the_choice_that_transfers_make(arrays, rng) -> None:
    device = jax.devices()[0]
    assert select.device_choice(device) == device_path(device)
    reported = {(d.id, d.path) for d in tpusync.info().devices}
    assert (device.id, select.device_choice(device).name) in reported
    source = arrays.random(rng, (4, 8), np.float32)
    pool = tpusync.DevicePool(jax.device_put(source))
    host = np.zeros_like(source)
    assert tpusync.transfer(pool, host).path == select.device_choice(device).name
    sub_byte = tpusync.DevicePool(jax.numpy.zeros((4, 8), jax.numpy.int4))
    with pytest.raises(NativePathUnavailableError, match="path='native' cannot run here"):
        tpusync.transfer(sub_byte, np.zeros((4, 8), jax.numpy.int4), path="native")
