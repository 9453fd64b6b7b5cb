"""tpusync's PJRT C API binding (``_core.PjrtApi``), checked against the facts and real plugins.

Three layers:
- the layout of our own declarations (slot offsets, STRUCT_SIZE constants) against the PJRT C API
  facts, and the binding's checks, on fake tables built with ctypes (always run);
- ``describe_backend`` never raising (always runs);
- real plugin libraries (libtpu, the CUDA 13 plugin), each loaded in a child process, read through
  our declarations, and asked for a client, which fails without hardware (``plugins`` marker).

Plugins live in ``$TPUSYNC_PLUGIN_DIR`` (default ``<repo>/.plugins``), installed by
``scripts/install_pjrt_plugins.sh``. A missing plugin skips its test, unless
``TPUSYNC_REQUIRE_PLUGINS=1``.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
from paths import REPO

from tpusync._native import core as _core
from tpusync._src.engines.devices import describe_backend
from tpusync.errors import InvalidArgumentError, TpuSyncError

REPO = REPO

# ---- Facts (PJRT C API, LP64): slot i of PJRT_Api lies at byte 40 + 8*i -------------------------

SLOT_INDEX = {
    "PJRT_Error_Destroy": 0,
    "PJRT_Error_Message": 1,
    "PJRT_Error_GetCode": 2,
    "PJRT_Plugin_Initialize": 3,
    "PJRT_Plugin_Attributes": 4,
    "PJRT_Event_Destroy": 5,
    "PJRT_Event_Await": 8,
    "PJRT_Event_OnReady": 9,
    "PJRT_Client_Create": 10,
    "PJRT_Client_Destroy": 11,
    "PJRT_Client_PlatformName": 12,
    "PJRT_Client_PlatformVersion": 14,
    "PJRT_Client_LookupDevice": 17,
    "PJRT_Buffer_Destroy": 58,
    "PJRT_Client_CreateViewOfDeviceBuffer": 93,
    "PJRT_Buffer_CopyRawToHost": 100,
    "PJRT_Client_DmaMap": 110,
    "PJRT_Client_DmaUnmap": 111,
}

# STRUCT_SIZE = offsetof(last field) + sizeof(last field), no tail padding.
STRUCT_SIZES = {
    "PJRT_Extension_Base": 24,
    "PJRT_Api_Version": 24,
    "PJRT_NamedValue": 56,
    "PJRT_Error_Destroy_Args": 24,
    "PJRT_Error_Message_Args": 40,
    "PJRT_Error_GetCode_Args": 28,
    "PJRT_Plugin_Initialize_Args": 16,
    "PJRT_Plugin_Attributes_Args": 32,
    "PJRT_Event_Destroy_Args": 24,
    "PJRT_Event_Await_Args": 24,
    "PJRT_Event_OnReady_Args": 40,
    "PJRT_Client_Create_Args": 88,
    "PJRT_Client_Destroy_Args": 24,
    "PJRT_Client_PlatformName_Args": 40,
    "PJRT_Client_PlatformVersion_Args": 40,
    "PJRT_Client_CreateViewOfDeviceBuffer_Args": 112,
    "PJRT_Client_DmaMap_Args": 40,
    "PJRT_Client_DmaUnmap_Args": 32,
    "PJRT_Buffer_Destroy_Args": 24,
    "PJRT_Buffer_CopyRawToHost_Args": 56,
    "PJRT_Client_LookupDevice_Args": 40,
    "PJRT_RawBuffer_CreateRawAliasOfBuffer_Args": 32,
    "PJRT_RawBuffer_Destroy_Args": 24,
    "PJRT_RawBuffer_CopyRawHostToDevice_Args": 56,
    # base (24 bytes), CreateRawAliasOfBuffer, Destroy, GetOnDeviceSizeInBytes, GetMemorySpace,
    # CopyRawHostToDevice: the extension up to the last function tpusync calls
    "PJRT_RawBuffer_Extension (used part)": 64,
}


def test_slot_offsets_match_facts():
    assert _core._slot_offsets() == {name: 40 + 8 * i for name, i in SLOT_INDEX.items()}


def test_struct_sizes_match_facts():
    assert _core._struct_sizes() == STRUCT_SIZES


def test_minimum_version():
    assert _core.pjrt_minimum_version() == (0, 57)
    assert _core.PJRT_EXTENSION_TYPE_RAW_BUFFER == 8


def test_pjrt_error_is_a_tpusync_runtime_error():
    err = _core.PjrtError("boom", 5)
    assert isinstance(err, TpuSyncError)
    assert isinstance(err, RuntimeError)
    assert (err.code, err.code_name, err.plugin_message) == (5, "NOT_FOUND", None)
    assert _core.PjrtError("x", 99).code_name == "CODE_99"


# ---- Clear errors without any plugin ----------------------------------------------------------


def test_from_address_zero_is_refused():
    with pytest.raises(InvalidArgumentError, match="NULL is not a PJRT_Api table"):
        _core.PjrtApi.from_address(0)


@pytest.mark.parametrize("bad", [-1, 2**64, "0x1000", 1.5, None])
def test_from_address_needs_an_address(bad):
    with pytest.raises(InvalidArgumentError, match="address of a PJRT_Api table"):
        _core.PjrtApi.from_address(bad)


def test_direct_construction_is_refused():
    with pytest.raises(TypeError, match="from_capsule"):
        _core.PjrtApi()


def test_from_library_missing_file(tmp_path):
    path = tmp_path / "libnot_there.so"
    with pytest.raises(_core.PjrtError, match="cannot open PJRT plugin") as info:
        _core.PjrtApi.from_library(path)
    assert str(path) in str(info.value)
    assert info.value.code_name == "NOT_FOUND"


def test_from_library_not_a_library(tmp_path):
    path = tmp_path / "libjunk.so"
    path.write_bytes(b"this is not an ELF file")
    with pytest.raises(_core.PjrtError, match="cannot open PJRT plugin"):
        _core.PjrtApi.from_library(path)


def test_from_library_without_entry_point():
    # libc is loaded in every process and exports no GetPjrtApi.
    with pytest.raises(_core.PjrtError, match="not a PJRT plugin: no GetPjrtApi"):
        _core.PjrtApi.from_library("libc.so.6")


def test_already_loaded_never_loads(tmp_path):
    with pytest.raises(_core.PjrtError, match="cannot open PJRT plugin"):
        _core.PjrtApi.from_library(tmp_path / "libnot_loaded.so", already_loaded=True)


def test_from_capsule_needs_a_capsule():
    with pytest.raises(InvalidArgumentError, match="PyCapsule"):
        _core.PjrtApi.from_capsule(12345)


# ---- Fake tables: the binding's checks and conversions, with no plugin -------------------------


class _NamedValue(ctypes.Structure):
    class _Value(ctypes.Union):
        _fields_: ClassVar = [
            ("string_value", ctypes.c_char_p),
            ("int64_value", ctypes.c_int64),
            ("int64_array_value", ctypes.POINTER(ctypes.c_int64)),
            ("float_value", ctypes.c_float),
            ("bool_value", ctypes.c_bool),
        ]

    _anonymous_ = ("value",)
    _fields_: ClassVar = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("name", ctypes.c_char_p),
        ("name_size", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("value", _Value),
        ("value_size", ctypes.c_size_t),
    ]


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("type", ctypes.c_int),
    ("next", ctypes.POINTER(_ExtensionBase)),
]

_ARGS = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # PJRT_Error* (*)(Args*)
_VOID_ARGS = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*)(Args*)


class FakeTable:
    """A PJRT_Api table in ctypes memory: header, version and n_slots slots (NULL unless set)."""

    def __init__(self, major=0, minor=105, n_slots=136, struct_size=None):
        class Table(ctypes.Structure):
            _fields_: ClassVar = [
                ("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.c_void_p),
                ("version_struct_size", ctypes.c_size_t),
                ("version_extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int),
                ("minor", ctypes.c_int),
                ("slots", ctypes.c_void_p * n_slots),
            ]

        self.table = Table()
        self.table.struct_size = 40 + 8 * n_slots if struct_size is None else struct_size
        self.table.version_struct_size = 24
        self.table.major, self.table.minor = major, minor
        self._keep = []

    @property
    def address(self):
        return ctypes.addressof(self.table)

    def set_slot(self, name, function):
        self._keep.append(function)
        self.table.slots[SLOT_INDEX[name]] = ctypes.cast(function, ctypes.c_void_p)

    def api(self):
        # The PjrtApi does not keep this object alive: callers hold on to the FakeTable.
        return _core.PjrtApi.from_address(self.address)


def _capsule(address, name=b"pjrt_c_api"):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, name, None)


def test_fake_table_through_capsule_and_address():
    fake = FakeTable(minor=112)
    for capsule in (_capsule(fake.address), _capsule(fake.address, name=None)):
        api = _core.PjrtApi.from_capsule(capsule)
        assert api.address == fake.address
        assert api.version == (0, 112)
        assert api.struct_size == 40 + 8 * 136
        assert api.num_slots == 136
        assert "capsule" in api.source
    api = fake.api()
    assert api.library_path is None or isinstance(api.library_path, str)
    assert repr(api).startswith("<PjrtApi 0.112, 136 slots")


@pytest.mark.parametrize(
    ("major", "minor", "match"),
    [(0, 56, "0.56 is not supported"), (0, 33, "0.33"), (1, 0, "1.0 is not supported")],
)
def test_versions_outside_the_range_are_refused(major, minor, match):
    fake = FakeTable(major=major, minor=minor)
    with pytest.raises(_core.PjrtError, match=match) as info:
        fake.api()
    assert "0.57" in str(info.value)
    assert info.value.code_name == "FAILED_PRECONDITION"


def test_oldest_accepted_version():
    fake = FakeTable(minor=57, n_slots=102)
    assert fake.api().version == (0, 57)


@pytest.mark.parametrize("struct_size", [0, 8, 39, 44, 1 << 20])
def test_implausible_table_sizes_are_refused(struct_size):
    fake = FakeTable(n_slots=1, struct_size=struct_size)
    with pytest.raises(_core.PjrtError, match="not that of a PJRT_Api table"):
        fake.api()


def test_short_version_struct_is_refused():
    fake = FakeTable()
    fake.table.version_struct_size = 16
    with pytest.raises(_core.PjrtError, match="PJRT_Api_Version struct_size"):
        fake.api()


def test_has_slot_needs_a_long_enough_table_and_a_pointer():
    noop = _ARGS(lambda args: None)
    fake = FakeTable(n_slots=112)
    for name in SLOT_INDEX:
        fake.set_slot(name, noop)
    assert all(fake.api().has_slot(name) for name in SLOT_INDEX)
    # Same slots, but the plugin's table ends before slot 100 (an older minor version).
    fake.table.struct_size = 40 + 8 * 100
    api = fake.api()
    assert not api.has_slot("PJRT_Buffer_CopyRawToHost")
    assert not api.has_slot("PJRT_Client_DmaMap")
    assert api.has_slot("PJRT_Client_CreateViewOfDeviceBuffer")
    # Set slots only: NULL ones do not count.
    empty = FakeTable()
    assert not empty.api().has_slot("PJRT_Client_Create")
    with pytest.raises(InvalidArgumentError, match="unknown PJRT_Api slot"):
        api.has_slot("PJRT_Client_Compile")


def test_missing_slots_are_never_called():
    fake = FakeTable(n_slots=0)
    api = fake.api()
    assert not any(api.has_slot(name) for name in SLOT_INDEX)
    assert api.initialize() is False
    for call in (api.plugin_attributes, api.try_create_client):
        with pytest.raises(_core.PjrtError, match="does not offer PJRT_") as info:
            call()
        assert info.value.code_name == "UNIMPLEMENTED"
    with pytest.raises(_core.PjrtError, match="does not offer PJRT_Client_PlatformName"):
        api.platform_name(0x1000)


def test_extension_list():
    exts = (_ExtensionBase * 3)()
    for i, ext_type in enumerate([3, 8, 24]):
        exts[i].struct_size = 24
        exts[i].type = ext_type
        if i < 2:
            exts[i].next = ctypes.pointer(exts[i + 1])
    fake = FakeTable()
    fake.table.extension_start = ctypes.addressof(exts[0])
    api = fake.api()
    assert api.extension_types() == [3, 8, 24]
    assert api.find_extension(8) == (ctypes.addressof(exts[1]), 24)
    assert api.find_extension(_core.PJRT_EXTENSION_TYPE_RAW_BUFFER) is not None
    assert api.find_extension(7) is None
    empty = FakeTable()
    assert empty.api().extension_types() == []


def test_cyclic_extension_list_is_caught():
    ext = _ExtensionBase(24, 1)
    ext.next = ctypes.pointer(ext)
    fake = FakeTable()
    fake.table.extension_start = ctypes.addressof(ext)
    with pytest.raises(_core.PjrtError, match="corrupt list"):
        fake.api().extension_types()


def test_attributes_of_every_value_type():
    numbers = (ctypes.c_int64 * 3)(1, -2, 3)
    text = b"hello"
    values = (_NamedValue * 6)()
    rows = [
        (b"s", 0, "string_value", text, len(text)),
        (b"i", 1, "int64_value", -(2**40), 1),
        (b"l", 2, "int64_array_value", ctypes.cast(numbers, ctypes.POINTER(ctypes.c_int64)), 3),
        (b"f", 3, "float_value", 0.5, 1),
        (b"b", 4, "bool_value", True, 1),
        (b"new", 99, "int64_value", 7, 1),
    ]
    for nv, (name, kind, field, value, size) in zip(values, rows, strict=True):
        nv.struct_size = 56
        nv.name, nv.name_size, nv.type, nv.value_size = name, len(name), kind, size
        setattr(nv, field, value)

    def attributes(args):
        out = ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))
        assert out[0] == STRUCT_SIZES["PJRT_Plugin_Attributes_Args"]
        out[2] = ctypes.addressof(values)
        out[3] = len(values)
        return None

    fake = FakeTable()
    fake.set_slot("PJRT_Plugin_Attributes", _ARGS(attributes))
    assert fake.api().plugin_attributes() == {
        "s": "hello",
        "i": -(2**40),
        "l": [1, -2, 3],
        "f": 0.5,
        "b": True,
        "new": None,
    }


def test_plugin_errors_are_read_destroyed_and_raised():
    error_address = 0xE0
    message = ctypes.create_string_buffer(b"no device here, sorry")
    seen = {"destroyed": [], "sizes": []}

    def create(args):
        seen["sizes"].append(ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))[0])
        return error_address

    def error_message(args):
        a = ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))
        assert a[2] == error_address
        seen["sizes"].append(a[0])
        a[3] = ctypes.addressof(message)
        a[4] = 14  # only "no device here"
        return None

    def get_code(args):
        a = ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))
        seen["sizes"].append(a[0])
        ctypes.cast(args + 24, ctypes.POINTER(ctypes.c_int))[0] = 9
        return None

    def destroy(args):
        a = ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))
        seen["sizes"].append(a[0])
        seen["destroyed"].append(a[2])

    fake = FakeTable()
    fake.set_slot("PJRT_Client_Create", _ARGS(create))
    fake.set_slot("PJRT_Error_Message", _VOID_ARGS(error_message))
    fake.set_slot("PJRT_Error_GetCode", _ARGS(get_code))
    fake.set_slot("PJRT_Error_Destroy", _VOID_ARGS(destroy))
    with pytest.raises(_core.PjrtError) as info:
        fake.api().try_create_client()
    err = info.value
    assert (err.code, err.code_name) == (9, "FAILED_PRECONDITION")
    assert err.plugin_message == "no device here"
    assert str(err) == "PJRT_Client_Create failed (FAILED_PRECONDITION): no device here"
    assert seen["destroyed"] == [error_address]
    assert seen["sizes"] == [88, 40, 28, 24]  # the STRUCT_SIZE of each args struct


def test_client_calls_on_a_fake_client():
    name = ctypes.create_string_buffer(b"fakeplatform")
    client_address = 0xC1
    destroyed = []

    def create(args):
        ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))[8] = client_address  # .client @64
        return None

    def platform_name(args):
        a = ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))
        assert a[2] == client_address
        a[3], a[4] = ctypes.addressof(name), 4
        return None

    def destroy(args):
        destroyed.append(ctypes.cast(args, ctypes.POINTER(ctypes.c_size_t))[2])
        return None

    fake = FakeTable()
    fake.set_slot("PJRT_Client_Create", _ARGS(create))
    fake.set_slot("PJRT_Client_PlatformName", _ARGS(platform_name))
    fake.set_slot("PJRT_Client_Destroy", _ARGS(destroy))
    api = fake.api()
    client = api.try_create_client()
    assert client == client_address
    assert api.platform_name(client) == "fake"
    api.destroy_client(client)
    assert destroyed == [client_address]
    with pytest.raises(InvalidArgumentError, match="client address is 0"):
        api.platform_name(0)


# ---- describe_backend never raises -----------------------------------------------------------


class _Weird:
    platform = "tpu"

    @property
    def client(self):
        raise RuntimeError("no client for you")


@pytest.mark.parametrize("device", [object(), None, 42, _Weird()])
def test_describe_backend_of_odd_objects(device):
    reason = describe_backend(device)
    assert isinstance(reason, str)
    assert reason.endswith("pure JAX")


def test_describe_backend_of_a_cpu_device():
    import jax

    reason = describe_backend(jax.devices("cpu")[0])
    assert isinstance(reason, str)
    assert reason.endswith("pure JAX")
    assert "no PJRT C API plugin table" in reason


# ---- Real plugins, each in a child process -----------------------------------------------------

PLUGIN_DIR = Path(os.environ.get("TPUSYNC_PLUGIN_DIR") or REPO / ".plugins")

PLUGINS = {
    # name: (library under PLUGIN_DIR, JAX backend name, jax device.platform, PJRT platform names)
    "libtpu": ("libtpu/libtpu/libtpu.so", "tpu", "tpu", {"tpu"}),
    "cuda": ("cuda/jax_plugins/xla_cuda13/xla_cuda_plugin.so", "cuda", "gpu", {"cuda"}),
}

_CHILD = textwrap.dedent(
    """
    import json, sys
    from tpusync._native import core as _core
    from tpusync.errors import TpuSyncError

    path, backend, platform = sys.argv[1:4]
    api = _core.PjrtApi.from_library(path)
    out = {
        "version": api.version,
        "struct_size": api.struct_size,
        "num_slots": api.num_slots,
        "library_path": api.library_path,
        "extension_types": api.extension_types(),
        "raw_buffer": api.find_extension(_core.PJRT_EXTENSION_TYPE_RAW_BUFFER),
        "can_read_raw": api.can_read_raw,
        "can_write_raw": api.can_write_raw,
        "has_slot": {name: api.has_slot(name) for name in _core._slot_offsets()},
        "attributes": api.plugin_attributes(),
        "initialized": api.initialize(),
    }
    try:
        client = api.try_create_client()
    except _core.PjrtError as exc:
        out["error"] = {
            "message": str(exc), "plugin_message": exc.plugin_message, "code": exc.code,
            "code_name": exc.code_name,
            "classes": [isinstance(exc, c) for c in (TpuSyncError, RuntimeError)],
        }
    else:  # only where the hardware is present
        out["client"] = {"platform_name": api.platform_name(client)}
        api.destroy_client(client)

    # The same table through JAX's own loader (a capsule), then describe_backend on a device
    # whose client JAX registered for that backend (a stand-in: no hardware, so no real client).
    from jax._src import xla_bridge as xb
    from jax._src.lib import xla_client
    from tpusync._src.engines.devices import describe_backend

    capsule = xla_client.load_pjrt_plugin_dynamically(backend, path)
    out["capsule_same_table"] = _core.PjrtApi.from_capsule(capsule).address == api.address
    out["already_loaded_same_table"] = (
        _core.PjrtApi.from_library(path, already_loaded=True).address == api.address)

    class Client:
        unsafe_client_pointer = 0
    Client.platform = platform
    class Device:
        client = Client()
    Device.platform = platform

    xb.backends()
    xb._backends[backend] = Device.client
    if backend != "tpu":  # JAX keeps the capsule for jax_plugins backends, not for libtpu
        xb._backend_factories[backend] = xb.BackendRegistration(
            lambda: None, 0, c_api=capsule)
    out["describe_backend"] = describe_backend(Device())
    print("RESULT " + json.dumps(out))
    """
)


def _run_plugin(name, tmp_path):
    relative, backend, platform, _ = PLUGINS[name]
    path = PLUGIN_DIR / relative
    if not path.is_file():
        message = f"{name} PJRT plugin not installed at {path} (scripts/install_pjrt_plugins.sh)"
        if os.environ.get("TPUSYNC_REQUIRE_PLUGINS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = dict(os.environ)
    env.update(
        # libtpu writes logs and a lock file: keep them in this test's directory.
        TMPDIR=str(tmp_path),
        TEST_TMPDIR=str(tmp_path),
        TPU_LOG_DIR=str(tmp_path / "tpu_logs"),
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",  # no /tmp/libtpu_lockfile
        TPU_SKIP_MDS_QUERY="1",  # no GCE metadata server look-ups
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), backend, platform],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"child for {name} failed (rc {proc.returncode})\n"
        f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return path, json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.plugins
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_real_plugin(name, tmp_path):
    path, out = _run_plugin(name, tmp_path)
    pjrt_platforms = PLUGINS[name][3]

    major, minor = out["version"]
    assert major == 0 and 57 <= minor < 1000
    assert out["struct_size"] == 40 + 8 * out["num_slots"]
    assert out["num_slots"] > max(SLOT_INDEX.values())
    assert Path(out["library_path"]).resolve() == path.resolve()
    assert all(out["has_slot"].values()), out["has_slot"]
    assert out["initialized"] is True
    assert all(isinstance(t, int) and t >= 0 for t in out["extension_types"])
    if name == "libtpu":
        # libtpu 0.0.52 lists the raw-buffer extension with struct_size 80 (extension version 2);
        # the CUDA plugin 0.10.2 does not. Only its presence is checked: it is experimental.
        assert 8 in out["extension_types"]
        address, size = out["raw_buffer"]
        assert address != 0 and size >= 24 + 8 * 6
    # Both real tables offer the core calls of native reads; only libtpu's has the functions
    # of in-place writes set (the CUDA plugin, 0.10.2 and 0.11.2 alike, has no such extension).
    assert out["can_read_raw"] is True
    assert out["can_write_raw"] is (name == "libtpu")

    # Attributes seen: {'xla_version': 2, 'stablehlo_current_version': [1, 24, 0],
    # 'stablehlo_minimum_version': [0, 9, 0]} (libtpu 0.0.52), plus 'cuda_version': 13000
    # (jax-cuda13-pjrt 0.10.2).
    attributes = out["attributes"]
    assert isinstance(attributes, dict) and attributes
    assert isinstance(attributes["xla_version"], int) and attributes["xla_version"] >= 1
    for key in ("stablehlo_current_version", "stablehlo_minimum_version"):
        value = attributes[key]
        assert len(value) == 3 and all(isinstance(v, int) and v >= 0 for v in value)
    assert attributes["stablehlo_current_version"] >= attributes["stablehlo_minimum_version"]
    if name == "cuda":
        assert attributes["cuda_version"] >= 13000

    if "error" in out:  # no hardware: the plugin says so through a real PJRT_Error
        error = out["error"]
        assert error["classes"] == [True, True]
        assert 1 <= error["code"] <= 16
        assert error["code_name"] not in ("OK", f"CODE_{error['code']}")
        assert isinstance(error["plugin_message"], str) and error["plugin_message"].strip()
        assert error["message"].startswith(f"PJRT_Client_Create failed ({error['code_name']}): ")
    else:
        assert out["client"]["platform_name"] in pjrt_platforms

    assert out["capsule_same_table"] is True
    assert out["already_loaded_same_table"] is True
    label = "libtpu.so" if name == "libtpu" else "jax_plugins.xla_cuda13"
    assert out["describe_backend"] == (
        f"PJRT C API {major}.{minor} via {label}; JAX's client pointer is 0: pure JAX"
    )
