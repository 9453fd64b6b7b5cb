"""Shared test setup: 8 fake CPU devices, a reproducible RNG, random-bit arrays, a mesh, both paths.

The device count must be set before JAX starts its backend, so it happens at import time here,
before any test module touches a device.

Randomness: every test gets its own ``numpy.random.Generator`` derived from one session seed
(``TPUSYNC_TEST_SEED``, else a fresh random one) and the test's node id; the seed is printed in the
report header and by the ``rng`` fixture, so ``TPUSYNC_TEST_SEED=<seed> pytest <node id>``
reproduces a failure.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import secrets
import shutil
import signal
import tempfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from run_names import RUN_TAG, run_entries, run_name  # noqa: E402

SEED = int(os.environ.get("TPUSYNC_TEST_SEED") or secrets.randbits(32))

# tests/vllm needs torch and vLLM: scripts/test.sh runs it in the vLLM environment it makes.
collect_ignore = [] if importlib.util.find_spec("torch") is not None else ["vllm"]
# tests/sglang needs SGLang: scripts/test.sh runs it in the SGLang environment it makes.
# (tests/sglang itself is a namespace package named sglang: SGLang's spec has an origin)
_sglang = importlib.util.find_spec("sglang")
if _sglang is None or _sglang.origin is None:
    collect_ignore.append("sglang")

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# NaN bit patterns (with payloads where the format has them) planted at the start of every random
# float array: jitted gathers and scatters on values canonicalize some of them (0x7fbf -> 0x7fc0).
NAN_BITS: dict[np.dtype, tuple[int, ...]] = {
    np.dtype(np.float32): (0x7FBF_FFFF, 0x7F80_0001, 0xFFC0_0001, 0x7FA0_5A5A),
    np.dtype(np.float16): (0x7E01, 0x7C01, 0xFD55),
    np.dtype(ml_dtypes.bfloat16): (0x7FBF, 0xFFC1, 0x7F81, 0x7FC1),
    np.dtype(ml_dtypes.float8_e5m2): (0x7D, 0x7E, 0xFD, 0xFF),
    np.dtype(ml_dtypes.float8_e4m3fn): (0x7F, 0xFF),
}


def _sub_byte_bits(dtype: np.dtype) -> int | None:
    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            bits = int(info(dtype).bits)
        except (TypeError, ValueError):
            continue
        return bits if bits < 8 else None
    return None


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A C-contiguous array of random *bits* (not values) of any dtype, with no zero element.

    Byte-sized and wider dtypes are random non-zero bytes viewed as the dtype, with NaN payloads
    planted first (see NAN_BITS); bool is random 0/1; sub-byte integers are random non-zero values.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    size = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape, dtype=np.uint8).astype(np.bool_)
    if _sub_byte_bits(dtype) is not None:
        try:
            info = ml_dtypes.iinfo(dtype)
        except (TypeError, ValueError) as exc:
            raise NotImplementedError(f"random bits for {dtype}") from exc
        values = rng.integers(1, int(info.max) + 1, size=size)
        if int(info.min) < 0:
            values *= rng.choice(np.array([-1, 1]), size=size)
        return values.astype(dtype).reshape(shape)
    raw = rng.integers(1, 256, size=size * dtype.itemsize, dtype=np.uint8)  # never a zero byte
    array = raw.view(dtype).reshape(shape)
    nans = NAN_BITS.get(dtype, ())
    if nans and size:
        flat = array.reshape(-1).view(_UNSIGNED[dtype.itemsize])
        count = min(len(nans), size)
        flat[:count] = np.array(nans[:count], dtype=flat.dtype)
    return array


def bits(array: Any) -> np.ndarray:
    """The array's bits as unsigned integers of the same width: compare these, never values."""
    host = np.asarray(array)
    if host.dtype == np.bool_:
        return host.view(np.uint8)
    return host.view(_UNSIGNED[host.dtype.itemsize])


def assert_same_bits(actual: Any, expected: Any, what: str = "") -> None:
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if not np.array_equal(a, e):
        wrong = np.argwhere(a != e)
        raise AssertionError(
            f"{what}: {len(wrong)} of {a.size} elements differ; first at {tuple(wrong[0])}: "
            f"{a[tuple(wrong[0])]:#x} != {e[tuple(wrong[0])]:#x}"
        )


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"tpusync: TPUSYNC_TEST_SEED={SEED}, jax {jax.__version__}, {len(jax.devices())} devices, "
        f"run {RUN_TAG}, basetemp {config.option.basetemp}"
    )


_OWN_BASETEMP = pytest.StashKey[str]()  # the base temporary directory this conftest made


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path factory reads the option
def pytest_configure(config: pytest.Config) -> None:
    """A base temporary directory of this session's own unless --basetemp names one: pytest's
    default, /tmp/pytest-of-<user>, is shared by every session of the user, and each removes
    the older ones' directories while they may still be running."""
    if config.option.basetemp is None:
        config.option.basetemp = tempfile.mkdtemp(prefix=f"{RUN_TAG}-pytest-")
        config.stash[_OWN_BASETEMP] = config.option.basetemp


def _stop_as_interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """A session stopped by SIGTERM (``timeout``, ``kill``, a CI job cancelled) unwinds as for
    Ctrl-C, so its fixtures' clean-up and the end-of-session hooks below still run."""
    signal.signal(signal.SIGTERM, _stop_as_interrupted)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """What this run left in /dev/shm (names carrying its tag, made by a test or a child
    process killed before its own clean-up) is removed, and named in the report."""
    left = run_entries("/dev/shm")
    for path in left:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"tpusync: removed what this run left in /dev/shm: {left}")


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_BASETEMP, None)
    if own is not None:  # nothing a test made stays in /tmp (tmp_path_retention_policy)
        shutil.rmtree(own, ignore_errors=True)


def _case_key(node: pytest.Item) -> str:
    """The test's identity without its ``path`` parameter: both engines get the same data."""
    params = getattr(getattr(node, "callspec", None), "params", {})
    parts = [node.path.name, getattr(node, "originalname", node.name)]
    parts += [f"{name}={value!r}" for name, value in sorted(params.items()) if name != "path"]
    return "|".join(parts)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A Generator seeded from the session seed and the test's identity (printed on failure).

    The ``path`` parameter is left out of the identity, so a case run on both engines sees the
    same random data and both results must equal the same reference bit for bit."""
    print(f"TPUSYNC_TEST_SEED={SEED} (test {request.node.nodeid})")
    return np.random.default_rng([SEED, zlib.crc32(_case_key(request.node).encode())])


@pytest.fixture(scope="session")
def mesh() -> jax.sharding.Mesh:
    """A (4, 2) mesh over the 8 fake CPU devices, axes "a" and "b", with Auto axis types
    (jax 0.10.2 defaults to Explicit)."""
    assert len(jax.devices()) == 8, "jax_num_cpu_devices=8 must be set before the backend starts"
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((4, 2), ("a", "b"), axis_types=(auto, auto))


@pytest.fixture(scope="session", params=["native", "jax"])
def path(request: pytest.FixtureRequest) -> str:
    """The engine a test runs on; tests that take it run once per engine (session-scoped so
    that hypothesis tests may use it)."""
    return request.param


class Arrays:
    """The array helpers as one object, for module-level helpers in tests: ``random``,
    ``bits`` and ``assert_same`` (see the functions of the same meaning above)."""

    random = staticmethod(random_array)
    bits = staticmethod(bits)
    assert_same = staticmethod(assert_same_bits)


@pytest.fixture(scope="session")
def arrays() -> Arrays:
    return Arrays()


# --- KV stores that are always closed, pool names that are always removed --------------------


@pytest.fixture
def shm_names() -> Iterator[Callable[[], str]]:
    """Fresh names for named DRAM pools; their /dev/shm files are removed at the end."""
    from tpusync._src.tiers.dram import pool_path

    made: list[str] = []

    def make() -> str:
        name = run_name("kv")
        made.append(name)
        return name

    yield make
    for name in made:
        path = pool_path(name)
        path.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(f"tpusync-{name}.sessions"), ignore_errors=True)
        for temp in path.parent.glob(f".{path.name}.tmp-*"):
            temp.unlink(missing_ok=True)


@pytest.fixture
def stores(shm_names: Callable[[], str]) -> Iterator[Callable[..., Any]]:
    """KVCacheStore(config, pools), closed at the end of the test (before named pools are
    removed)."""
    from tpusync.kv import KVCacheStore

    opened: list[Any] = []

    def open_(config: Any, pools: list[Any]) -> Any:
        store = KVCacheStore(config, pools)
        opened.append(store)
        return store

    yield open_
    errors = []
    for store in reversed(opened):
        try:
            store.close()
        except Exception as error:  # close the others anyway, then report
            errors.append(error)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session", autouse=True)
def no_vllm_file_store_left() -> Iterator[None]:
    """Removes the file stores vLLM's engines (tests/vllm) made during this session: its
    single-process engine rendezvouses through ``vllm_dist_<uuid>`` in the temporary directory
    and never removes it (the ones there before are someone else's)."""

    def file_stores() -> set[str]:
        return set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))

    before = file_stores()
    yield
    for path in file_stores() - before:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
