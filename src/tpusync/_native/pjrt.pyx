# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""tpusync's PJRT C API binding: a plugin's ``const PJRT_Api *`` table, called through tpusync's
own declarations (include/tpusync/pjrt_min.h), and block copies between host memory and device
buffers (include/tpusync/pjrt_copy.h)."""

# A PjrtApi wraps a plugin's `const PJRT_Api *` table (from a JAX capsule, a plugin library, or a
# bare address) and calls the few functions tpusync needs through our own declarations. Rules
# kept everywhere below:
#   - a table outside the accepted version range is refused when it is wrapped;
#   - a slot is called only if the plugin's table is long enough to hold it and it is not NULL;
#   - every PJRT_Error returned is read (message, code), destroyed, and raised as PjrtError;
#   - plugin calls run without the GIL.

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.pycapsule cimport PyCapsule_CheckExact, PyCapsule_GetName, PyCapsule_GetPointer
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libc.string cimport memset
from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlerror, dlopen, dlsym

cimport numpy as cnp

from tpusync._native._pjrt_min cimport (
    PJRT_Api, PJRT_Client, PJRT_Client_Create_Args, PJRT_Client_Create_Args_STRUCT_SIZE,
    PJRT_Client_Destroy_Args, PJRT_Client_Destroy_Args_STRUCT_SIZE,
    PJRT_Client_PlatformName_Args, PJRT_Client_PlatformName_Args_STRUCT_SIZE,
    PJRT_Client_PlatformVersion_Args_STRUCT_SIZE,
    PJRT_Error, PJRT_Error_Destroy_Args, PJRT_Error_Destroy_Args_STRUCT_SIZE,
    PJRT_Error_GetCode_Args, PJRT_Error_GetCode_Args_STRUCT_SIZE, PJRT_Error_Message_Args,
    PJRT_Error_Message_Args_STRUCT_SIZE, PJRT_Extension_Base, PJRT_NamedValue,
    PJRT_NamedValue_kBool, PJRT_NamedValue_kFloat, PJRT_NamedValue_kInt64,
    PJRT_NamedValue_kInt64List, PJRT_NamedValue_kString, PJRT_NamedValue_STRUCT_SIZE,
    PJRT_Plugin_Attributes_Args, PJRT_Plugin_Attributes_Args_STRUCT_SIZE,
    PJRT_Plugin_Initialize_Args, PJRT_Plugin_Initialize_Args_STRUCT_SIZE,
    TPS_PJRT_EXTENSION_TYPE_RAW_BUFFER, tps_GetPjrtApi_fn,
)
from tpusync._native._pjrt_min cimport (
    PJRT_Api_Version_STRUCT_SIZE, PJRT_Buffer_CopyRawToHost_Args_STRUCT_SIZE,
    PJRT_Buffer_Destroy_Args_STRUCT_SIZE, PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE,
    PJRT_Client_DmaMap_Args_STRUCT_SIZE, PJRT_Client_DmaUnmap_Args_STRUCT_SIZE,
    PJRT_Event_Await_Args_STRUCT_SIZE, PJRT_Event_Destroy_Args_STRUCT_SIZE,
    PJRT_Event_OnReady_Args_STRUCT_SIZE, PJRT_Extension_Base_STRUCT_SIZE,
)
from tpusync._native._pjrt_min cimport (
    PJRT_Buffer, PJRT_Buffer_Destroy_Args, PJRT_Client_CreateViewOfDeviceBuffer_Args,
    PJRT_Client_DmaMap_Args, PJRT_Client_DmaUnmap_Args, PJRT_Client_LookupDevice_Args,
    PJRT_Client_LookupDevice_Args_STRUCT_SIZE, PJRT_Device, PJRT_RawBuffer,
    PJRT_RawBuffer_CopyRawHostToDevice_Args_STRUCT_SIZE,
    PJRT_RawBuffer_CreateRawAliasOfBuffer_Args,
    PJRT_RawBuffer_CreateRawAliasOfBuffer_Args_STRUCT_SIZE, PJRT_RawBuffer_Destroy_Args,
    PJRT_RawBuffer_Destroy_Args_STRUCT_SIZE, PJRT_RawBuffer_Extension,
    PJRT_RawBuffer_Extension_USED_SIZE,
)
from tpusync._native._pjrt_copy cimport tps_pjrt_copy, tps_pjrt_target
from tpusync._native.copy cimport segment_table

import operator
import os
import threading

import numpy as np

from tpusync.errors import InvalidArgumentError, TpuSyncError

cnp.import_array()


cdef extern from "dlfcn.h" nogil:
    # glibc extensions (the build defines _GNU_SOURCE).
    enum: RTLD_NOLOAD
    ctypedef struct Dl_info:
        const char *dli_fname
        void *dli_fbase
        const char *dli_sname
        void *dli_saddr
    int dladdr(const void *addr, Dl_info *info)


# The PJRT C API versions tpusync accepts: major 0, minor >= 57. CopyRawToHost appeared in 0.56
# and the changelog says 0.57 rearranged the PJRT_Api fields, so older tables are not trusted.
# Newer minors only append slots and args fields, which has_slot and struct_size handle.
_PJRT_ACCEPTED_MAJOR = 0
_PJRT_MIN_MINOR = 57

# The raw-buffer extension's type id (experimental upstream; no ABI promise).
PJRT_EXTENSION_TYPE_RAW_BUFFER = TPS_PJRT_EXTENSION_TYPE_RAW_BUFFER

# End of the PJRT_Api header; slot i lies at _PJRT_SLOT0 + 8*i.
cdef size_t _PJRT_SLOT0 = 40
# A real table is a few KiB at most; anything larger is not a PJRT_Api.
cdef size_t _PJRT_MAX_TABLE = 1 << 16
# Extension lists are short; a longer walk means a corrupt (or cyclic) list.
cdef int _PJRT_MAX_EXTENSIONS = 1024

_PJRT_ERROR_CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}
# Codes tpusync itself uses for failures found before or around a plugin call.
cdef int _CODE_UNKNOWN = 2
cdef int _CODE_NOT_FOUND = 5
cdef int _CODE_FAILED_PRECONDITION = 9
cdef int _CODE_UNIMPLEMENTED = 12
cdef int _CODE_INTERNAL = 13

# The slots a device->host read of a view uses.
_READ_SLOTS = (
    "PJRT_Client_CreateViewOfDeviceBuffer", "PJRT_Buffer_Destroy", "PJRT_Buffer_CopyRawToHost",
    "PJRT_Event_OnReady", "PJRT_Event_Destroy", "PJRT_Error_Destroy",
)

# Tables on which this process called PJRT_Plugin_Initialize through a PjrtApi.
cdef set _PJRT_INITIALIZED = set()
_PJRT_INIT_LOCK = threading.Lock()


class PjrtError(TpuSyncError, RuntimeError):
    """A PJRT plugin call failed, or a plugin table cannot be used; ``code`` is a PJRT error code.

    ``code`` and ``code_name`` follow PJRT_Error_Code (the absl status codes: 5 NOT_FOUND,
    9 FAILED_PRECONDITION, 12 UNIMPLEMENTED, 13 INTERNAL, ...). ``plugin_message`` is the
    plugin's own message when the error came from the plugin, else None.
    """

    def __init__(self, message, code=_CODE_UNKNOWN, plugin_message=None):
        super().__init__(message)
        self.code = int(code)
        self.code_name = _PJRT_ERROR_CODE_NAMES.get(self.code, f"CODE_{self.code}")
        self.plugin_message = plugin_message


def pjrt_minimum_version():
    """The oldest PJRT C API version (major, minor) tpusync accepts; only major 0 is accepted."""
    return (_PJRT_ACCEPTED_MAJOR, _PJRT_MIN_MINOR)


include "_pjrt_layout.pxi"


cdef inline bint _pjrt_slot_present(const PJRT_Api *api, size_t offset) noexcept nogil:
    # The slot exists in this plugin's table (which may be shorter than ours) and is set.
    if offset + sizeof(void *) > api.struct_size:
        return False
    return (<void **> (<char *> api + offset))[0] != NULL


cdef str _pjrt_text(const char *data, size_t size):
    if data == NULL:
        return ""
    return data[:size].decode("utf-8", "replace")


cdef object _pjrt_error(const PJRT_Api *api, PJRT_Error *err, str what):
    """Reads, destroys and converts a PJRT_Error the caller owns; returns the PjrtError."""
    cdef PJRT_Error_Message_Args margs
    cdef PJRT_Error_GetCode_Args cargs
    cdef PJRT_Error_Destroy_Args dargs
    cdef PJRT_Error *code_err = NULL
    cdef int code = _CODE_UNKNOWN
    message = "(the plugin has no PJRT_Error_Message)"
    if _pjrt_slot_present(api, _PJRT_SLOT_OFFSETS["PJRT_Error_Message"]):
        memset(&margs, 0, sizeof(margs))
        margs.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE
        margs.error = err
        with nogil:
            api.PJRT_Error_Message(&margs)
        message = _pjrt_text(margs.message, margs.message_size)
    if _pjrt_slot_present(api, _PJRT_SLOT_OFFSETS["PJRT_Error_GetCode"]):
        memset(&cargs, 0, sizeof(cargs))
        cargs.struct_size = PJRT_Error_GetCode_Args_STRUCT_SIZE
        cargs.error = err
        with nogil:
            code_err = api.PJRT_Error_GetCode(&cargs)
        if code_err == NULL:
            code = <int> cargs.code
    cdef size_t destroy_offset = _PJRT_SLOT_OFFSETS["PJRT_Error_Destroy"]
    if _pjrt_slot_present(api, destroy_offset):
        memset(&dargs, 0, sizeof(dargs))
        dargs.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE
        with nogil:
            if code_err != NULL:
                dargs.error = code_err
                api.PJRT_Error_Destroy(&dargs)
            dargs.error = err
            api.PJRT_Error_Destroy(&dargs)
    code_name = _PJRT_ERROR_CODE_NAMES.get(code, f"CODE_{code}")
    return PjrtError(f"{what} failed ({code_name}): {message}", code, message)


cdef uintptr_t _pjrt_address(address, str what) except? 0:
    try:
        return <uintptr_t> operator.index(address)
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"expected the address of {what} as an int in [0, 2**64), got {address!r}"
        ) from exc


cdef int _check(const PJRT_Api *api, PJRT_Error *err, str what) except -1:
    """Raises the PjrtError of a call that returned ``err`` (destroying it); 0 when it is NULL."""
    if err != NULL:
        raise _pjrt_error(api, err, what)
    return 0


cdef uintptr_t _made(
    const PJRT_Api *api, PJRT_Error *err, void *made, str what, str thing,
    int code=_CODE_INTERNAL,
) except? 0:
    """The address of the ``thing`` a call made, or the call's error; a PjrtError with ``code``
    when it returned neither."""
    _check(api, err, what)
    if made == NULL:
        raise PjrtError(f"{what} returned no {thing} and no error", code)
    return <uintptr_t> made


cdef class PjrtApi:
    """A plugin's PJRT C API table (``const PJRT_Api *``), used through tpusync's declarations.

    Made by :meth:`from_capsule`, :meth:`from_library` or :meth:`from_address`, which refuse
    tables outside the accepted version range (:func:`pjrt_minimum_version`, major 0). The table
    belongs to the plugin and must outlive this object: a capsule passed in is kept alive, and a
    library opened by :meth:`from_library` is never closed.
    """

    cdef const PJRT_Api *_api
    cdef object _owner
    cdef void *_dl_handle
    cdef readonly str source

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "PjrtApi is made by PjrtApi.from_capsule(), .from_library() or .from_address()"
        )

    @staticmethod
    cdef PjrtApi _wrap(const PJRT_Api *api, object owner, void *dl_handle, str source):
        if api == NULL:
            raise InvalidArgumentError(f"{source}: NULL is not a PJRT_Api table")
        cdef size_t size = api.struct_size
        if size < _PJRT_SLOT0 or size > _PJRT_MAX_TABLE or (size - _PJRT_SLOT0) % 8 != 0:
            raise PjrtError(
                f"{source}: struct_size {size} is not that of a PJRT_Api table "
                f"(a {_PJRT_SLOT0}-byte header, then 8-byte slots): wrong address?",
                _CODE_FAILED_PRECONDITION,
            )
        if api.pjrt_api_version.struct_size < PJRT_Api_Version_STRUCT_SIZE:
            raise PjrtError(
                f"{source}: its PJRT_Api_Version struct_size is "
                f"{api.pjrt_api_version.struct_size}, less than "
                f"{PJRT_Api_Version_STRUCT_SIZE}: not a PJRT_Api table?",
                _CODE_FAILED_PRECONDITION,
            )
        cdef int major = api.pjrt_api_version.major_version
        cdef int minor = api.pjrt_api_version.minor_version
        if major != _PJRT_ACCEPTED_MAJOR or minor < _PJRT_MIN_MINOR:
            raise PjrtError(
                f"{source}: PJRT C API {major}.{minor} is not supported; tpusync accepts "
                f"{_PJRT_ACCEPTED_MAJOR}.{_PJRT_MIN_MINOR} and newer minor versions of major "
                f"{_PJRT_ACCEPTED_MAJOR}",
                _CODE_FAILED_PRECONDITION,
            )
        cdef PjrtApi self = PjrtApi.__new__(PjrtApi)
        self._api = api
        self._owner = owner
        self._dl_handle = dl_handle
        self.source = source
        return self

    @staticmethod
    def from_capsule(capsule):
        """Wraps the table in a PyCapsule (any capsule name), e.g. the ``c_api`` JAX keeps for a
        plugin backend or the result of ``xla_client.load_pjrt_plugin_dynamically``."""
        if not PyCapsule_CheckExact(capsule):
            raise InvalidArgumentError(
                f"expected a PyCapsule holding a PJRT_Api*, got {type(capsule).__name__}"
            )
        cdef const char *name = PyCapsule_GetName(capsule)
        cdef void *pointer = PyCapsule_GetPointer(capsule, name)  # raises if invalid
        label = "unnamed" if name == NULL else (<bytes> name).decode("utf-8", "replace")
        return PjrtApi._wrap(<const PJRT_Api *> pointer, capsule, NULL, f"capsule {label!r}")

    @staticmethod
    def from_library(path, *, bint already_loaded=False):
        """Opens a plugin library (RTLD_NOW | RTLD_LOCAL) and calls its ``GetPjrtApi``.

        The library stays loaded for the life of the process. With ``already_loaded=True`` it
        is only found if this process has loaded it already (RTLD_NOLOAD): nothing new is
        loaded, which is how to reach the table of a library JAX opened itself. Loading a
        plugin can have side effects (libtpu writes a lock file and logs in the temp dir).
        """
        cdef bytes bpath = os.fsencode(path)
        cdef const char *cpath = bpath
        cdef int flags = RTLD_NOW | RTLD_LOCAL
        if already_loaded:
            flags |= RTLD_NOLOAD
        cdef void *handle
        cdef const char *err
        with nogil:
            dlerror()
            handle = dlopen(cpath, flags)
            err = dlerror() if handle == NULL else NULL
        if handle == NULL:
            if already_loaded and err == NULL:
                reason = "it is not loaded in this process"
            else:
                reason = "unknown dlopen error" if err == NULL else (<bytes> err).decode(
                    "utf-8", "replace")
            raise PjrtError(f"cannot open PJRT plugin {path!s}: {reason}", _CODE_NOT_FOUND)
        cdef void *sym
        with nogil:
            dlerror()
            sym = dlsym(handle, b"GetPjrtApi")
            err = dlerror() if sym == NULL else NULL
        if sym == NULL:
            reason = "symbol is NULL" if err == NULL else (<bytes> err).decode(
                "utf-8", "replace")
            raise PjrtError(
                f"{path!s} is not a PJRT plugin: no GetPjrtApi ({reason})", _CODE_NOT_FOUND
            )
        cdef tps_GetPjrtApi_fn get_api = <tps_GetPjrtApi_fn> sym
        cdef const PJRT_Api *api
        with nogil:
            api = get_api()
        if api == NULL:
            raise PjrtError(f"{path!s}: GetPjrtApi() returned NULL", _CODE_INTERNAL)
        return PjrtApi._wrap(api, None, handle, f"library {os.fsdecode(bpath)}")

    @staticmethod
    def from_address(address):
        """Wraps the table at an integer address. The address is trusted: a wrong one can crash
        the process (only NULL and obviously wrong headers are caught)."""
        cdef uintptr_t value = _pjrt_address(address, "a PJRT_Api table")
        return PjrtApi._wrap(<const PJRT_Api *> value, None, NULL, f"address {value:#x}")

    @property
    def address(self):
        """The table's address (the ``const PJRT_Api *``)."""
        return <uintptr_t> self._api

    @property
    def version(self):
        """(major, minor): the PJRT C API version the plugin was built with."""
        return (self._api.pjrt_api_version.major_version,
                self._api.pjrt_api_version.minor_version)

    @property
    def struct_size(self):
        """The plugin's size of its PJRT_Api table in bytes: it says which slots exist."""
        return self._api.struct_size

    @property
    def num_slots(self):
        """How many function slots the plugin's table has."""
        return (self._api.struct_size - _PJRT_SLOT0) // 8

    @property
    def library_path(self):
        """The file of the shared library that holds the table (dladdr), or None if unknown."""
        cdef Dl_info info
        if dladdr(<const void *> self._api, &info) == 0 or info.dli_fname == NULL:
            return None
        return os.fsdecode(<bytes> info.dli_fname)

    def extension_types(self):
        """The type ids of the extensions the plugin offers, in list order."""
        types = []
        cdef const PJRT_Extension_Base *ext = self._api.extension_start
        cdef int n = 0
        while ext != NULL:
            n += 1
            if n > _PJRT_MAX_EXTENSIONS:
                raise PjrtError(
                    f"{self.source}: more than {_PJRT_MAX_EXTENSIONS} extensions: corrupt list?",
                    _CODE_INTERNAL,
                )
            types.append(ext.type)
            ext = ext.next
        return types

    def find_extension(self, int type_id):
        """(address, struct_size) of the first extension of that type id, or None."""
        cdef const PJRT_Extension_Base *ext = self._api.extension_start
        cdef int n = 0
        while ext != NULL and n < _PJRT_MAX_EXTENSIONS:
            if ext.type == type_id:
                return (<uintptr_t> ext, ext.struct_size)
            ext = ext.next
            n += 1
        return None

    def has_slot(self, str name):
        """Whether the plugin's table holds the named slot (long enough, and not NULL).

        Only the slots tpusync declares can be asked for; see ``_slot_offsets()``.
        """
        offset = _PJRT_SLOT_OFFSETS.get(name)
        if offset is None:
            raise InvalidArgumentError(
                f"unknown PJRT_Api slot {name!r}; tpusync declares {sorted(_PJRT_SLOT_OFFSETS)}"
            )
        return _pjrt_slot_present(self._api, <size_t> offset)

    cdef int _require(self, str name) except -1:
        if not self.has_slot(name):
            major, minor = self.version
            raise PjrtError(
                f"{self.source} (PJRT C API {major}.{minor}, {self.num_slots} slots) does not "
                f"offer {name}",
                _CODE_UNIMPLEMENTED,
            )
        return 0

    def plugin_attributes(self):
        """The plugin's attributes: {name: str | int | float | bool | list[int]}.

        A value of a type newer than tpusync knows is None.
        """
        self._require("PJRT_Plugin_Attributes")
        cdef PJRT_Plugin_Attributes_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Plugin_Attributes_Args_STRUCT_SIZE
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Plugin_Attributes(&args)
        _check(self._api, err, "PJRT_Plugin_Attributes")
        result = {}
        if args.num_attributes == 0 or args.attributes == NULL:
            return result
        # The array's stride is the plugin's sizeof(PJRT_NamedValue): its struct_size, rounded up
        # to the 8-byte alignment. Refuse a shorter struct than ours.
        cdef size_t elem_size = args.attributes[0].struct_size
        if elem_size < PJRT_NamedValue_STRUCT_SIZE or elem_size > 4096:
            raise PjrtError(
                f"{self.source}: PJRT_NamedValue struct_size {elem_size} is unexpected "
                f"(tpusync's is {PJRT_NamedValue_STRUCT_SIZE})",
                _CODE_INTERNAL,
            )
        cdef size_t stride = (elem_size + 7) & ~(<size_t> 7)
        cdef const PJRT_NamedValue *nv
        cdef size_t i, j
        for i in range(args.num_attributes):
            nv = <const PJRT_NamedValue *> (<const char *> args.attributes + i * stride)
            name = _pjrt_text(nv.name, nv.name_size)
            if nv.type == PJRT_NamedValue_kString:
                value = _pjrt_text(nv.string_value, nv.value_size)
            elif nv.type == PJRT_NamedValue_kInt64:
                value = nv.int64_value
            elif nv.type == PJRT_NamedValue_kInt64List:
                value = []
                if nv.int64_array_value != NULL:
                    for j in range(nv.value_size):
                        value.append(nv.int64_array_value[j])
            elif nv.type == PJRT_NamedValue_kFloat:
                value = nv.float_value
            elif nv.type == PJRT_NamedValue_kBool:
                value = bool(nv.bool_value)
            else:
                value = None
            result[name] = value
        return result

    def initialize(self):
        """Calls PJRT_Plugin_Initialize once per table from this process; False if the plugin
        has no such slot. Do not call it on a table JAX loaded: JAX initializes its plugins."""
        if not self.has_slot("PJRT_Plugin_Initialize"):
            return False
        cdef uintptr_t key = <uintptr_t> self._api
        cdef PJRT_Plugin_Initialize_Args args
        cdef PJRT_Error *err
        with _PJRT_INIT_LOCK:
            if key in _PJRT_INITIALIZED:
                return True
            memset(&args, 0, sizeof(args))
            args.struct_size = PJRT_Plugin_Initialize_Args_STRUCT_SIZE
            with nogil:
                err = self._api.PJRT_Plugin_Initialize(&args)
            _check(self._api, err, "PJRT_Plugin_Initialize")
            _PJRT_INITIALIZED.add(key)
        return True

    cdef PJRT_Client *_client(self, client_address) except? NULL:
        cdef uintptr_t value = _pjrt_address(client_address, "a PJRT_Client")
        if value == 0:
            raise InvalidArgumentError("client address is 0: no PJRT_Client")
        return <PJRT_Client *> value

    def platform_name(self, client_address):
        """The platform name of a live PJRT_Client of this plugin (e.g. "tpu", "cuda")."""
        self._require("PJRT_Client_PlatformName")
        cdef PJRT_Client_PlatformName_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_PlatformName_Args_STRUCT_SIZE
        args.client = self._client(client_address)
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_PlatformName(&args)
        _check(self._api, err, "PJRT_Client_PlatformName")
        return _pjrt_text(args.platform_name, args.platform_name_size)

    def try_create_client(self):
        """Creates a PJRT_Client with no options and no key-value store; returns its address.

        Raises PjrtError with the plugin's message and code when the plugin refuses (e.g. no
        device present). The caller owns the client: free it with :meth:`destroy_client`.
        Call :meth:`initialize` first on a table JAX did not load.
        """
        self._require("PJRT_Client_Create")
        cdef PJRT_Client_Create_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_Create_Args_STRUCT_SIZE
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_Create(&args)
        return _made(self._api, err, args.client, "PJRT_Client_Create", "client")

    def destroy_client(self, client_address):
        """Destroys a client made by :meth:`try_create_client` (never one JAX owns)."""
        self._require("PJRT_Client_Destroy")
        cdef PJRT_Client_Destroy_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_Destroy_Args_STRUCT_SIZE
        args.client = self._client(client_address)
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_Destroy(&args)
        _check(self._api, err, "PJRT_Client_Destroy")

    # ---- device copies (the native path on plugin backends) ---------------------------------

    def lookup_device(self, client_address, int device_id):
        """The address of the client's ``PJRT_Device`` with this global id (JAX's Device.id)."""
        self._require("PJRT_Client_LookupDevice")
        cdef PJRT_Client_LookupDevice_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_LookupDevice_Args_STRUCT_SIZE
        args.client = self._client(client_address)
        args.id = device_id
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_LookupDevice(&args)
        what = f"PJRT_Client_LookupDevice({device_id})"
        return _made(self._api, err, args.device, what, "device", _CODE_NOT_FOUND)

    def create_view(self, client_address, device_address, buffer_address, int64_t nbytes):
        """A ``PJRT_Buffer`` viewing ``nbytes`` of existing device memory as a flat uint8 array
        (no copy, no ownership: the memory must outlive the view). Returns its address; free
        it with :meth:`destroy_buffer`."""
        self._require("PJRT_Client_CreateViewOfDeviceBuffer")
        if nbytes <= 0:
            raise InvalidArgumentError(f"nbytes: a view needs at least one byte, got {nbytes}")
        cdef int64_t dims[1]
        dims[0] = nbytes
        cdef PJRT_Client_CreateViewOfDeviceBuffer_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE
        args.client = self._client(client_address)
        args.device_buffer_ptr = <void *> _pjrt_address(buffer_address, "device memory")
        args.dims = dims
        args.num_dims = 1
        args.element_type = 6  # PJRT_Buffer_Type_U8: offsets are plain byte offsets
        args.device = <PJRT_Device *> _pjrt_address(device_address, "a PJRT_Device")
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_CreateViewOfDeviceBuffer(&args)
        return _made(self._api, err, args.buffer, "PJRT_Client_CreateViewOfDeviceBuffer", "buffer")

    def destroy_buffer(self, buffer_address):
        """Frees a ``PJRT_Buffer`` made by :meth:`create_view` (not the memory it views)."""
        self._require("PJRT_Buffer_Destroy")
        cdef PJRT_Buffer_Destroy_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Buffer_Destroy_Args_STRUCT_SIZE
        args.buffer = <PJRT_Buffer *> _pjrt_address(buffer_address, "a PJRT_Buffer")
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Buffer_Destroy(&args)
        _check(self._api, err, "PJRT_Buffer_Destroy")

    cdef const PJRT_RawBuffer_Extension *_required_raw_extension(self) except NULL:
        cdef const PJRT_RawBuffer_Extension *ext = self._raw_extension()
        if ext == NULL:
            raise PjrtError(f"{self.source} has no usable raw-buffer extension",
                            _CODE_UNIMPLEMENTED)
        return ext

    cdef const PJRT_RawBuffer_Extension *_raw_extension(self):
        found = self.find_extension(PJRT_EXTENSION_TYPE_RAW_BUFFER)
        if found is None:
            return NULL
        address, size = found
        cdef const PJRT_RawBuffer_Extension *ext = <const PJRT_RawBuffer_Extension *> (
            <uintptr_t> address)
        if size < PJRT_RawBuffer_Extension_USED_SIZE:
            return NULL
        if (ext.PJRT_RawBuffer_CreateRawAliasOfBuffer == NULL
                or ext.PJRT_RawBuffer_Destroy == NULL
                or ext.PJRT_RawBuffer_CopyRawHostToDevice == NULL):
            return NULL
        return ext

    @property
    def can_write_raw(self):
        """Whether the plugin offers in-place host->device writes: the raw-buffer extension,
        long enough to hold CopyRawHostToDevice, with the three functions tpusync calls set."""
        return self._raw_extension() != NULL

    @property
    def can_read_raw(self):
        """Whether the plugin offers device->host reads of views: CreateViewOfDeviceBuffer,
        CopyRawToHost, Buffer_Destroy and the event calls."""
        return all(self.has_slot(name) for name in _READ_SLOTS)

    def create_raw_alias(self, buffer_address):
        """A ``PJRT_RawBuffer`` aliasing a buffer's device memory (raw-buffer extension);
        returns its address; free it with :meth:`destroy_raw_buffer`."""
        cdef const PJRT_RawBuffer_Extension *ext = self._required_raw_extension()
        cdef PJRT_RawBuffer_CreateRawAliasOfBuffer_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_RawBuffer_CreateRawAliasOfBuffer_Args_STRUCT_SIZE
        args.buffer = <PJRT_Buffer *> _pjrt_address(buffer_address, "a PJRT_Buffer")
        cdef PJRT_Error *err
        with nogil:
            err = ext.PJRT_RawBuffer_CreateRawAliasOfBuffer(&args)
        what = "PJRT_RawBuffer_CreateRawAliasOfBuffer"
        return _made(self._api, err, args.raw_buffer, what, "raw buffer")

    def destroy_raw_buffer(self, raw_address):
        """Frees a ``PJRT_RawBuffer`` made by :meth:`create_raw_alias`."""
        cdef const PJRT_RawBuffer_Extension *ext = self._required_raw_extension()
        cdef PJRT_RawBuffer_Destroy_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_RawBuffer_Destroy_Args_STRUCT_SIZE
        args.buffer = <PJRT_RawBuffer *> _pjrt_address(raw_address, "a PJRT_RawBuffer")
        cdef PJRT_Error *err
        with nogil:
            err = ext.PJRT_RawBuffer_Destroy(&args)
        _check(self._api, err, "PJRT_RawBuffer_Destroy")

    def dma_map(self, client_address, address, size_t size):
        """Registers host memory with the client for DMA (e.g. pinned for the GPU's copy
        engines); undo with :meth:`dma_unmap` before the memory is freed."""
        self._require("PJRT_Client_DmaMap")
        cdef PJRT_Client_DmaMap_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_DmaMap_Args_STRUCT_SIZE
        args.client = self._client(client_address)
        args.data = <void *> _pjrt_address(address, "host memory")
        args.size = size
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_DmaMap(&args)
        _check(self._api, err, "PJRT_Client_DmaMap")

    def dma_unmap(self, client_address, address):
        """Undoes :meth:`dma_map` of the memory starting at ``address``."""
        self._require("PJRT_Client_DmaUnmap")
        cdef PJRT_Client_DmaUnmap_Args args
        memset(&args, 0, sizeof(args))
        args.struct_size = PJRT_Client_DmaUnmap_Args_STRUCT_SIZE
        args.client = self._client(client_address)
        args.data = <void *> _pjrt_address(address, "host memory")
        cdef PJRT_Error *err
        with nogil:
            err = self._api.PJRT_Client_DmaUnmap(&args)
        _check(self._api, err, "PJRT_Client_DmaUnmap")

    def copy_rows(self, cnp.ndarray targets not None, cnp.ndarray rows not None):
        """Runs a segment table between host memory and device buffers; returns the number of
        device copies issued. GIL released; completion from the plugin's event callbacks.

        ``targets``: uint64 (n, 4) rows (device base address, bytes, PJRT_Buffer view or 0,
        PJRT_RawBuffer alias or 0), sorted by base, not overlapping. ``rows``: uint64 (n, 3)
        (src, dst, nbytes) as for the CPU copy engine: a source inside a target is read from
        the device, a destination inside one is written, anything else is a host memcpy.
        Raises PjrtError (the plugin's message and code) after every issued copy finished."""
        for name in _READ_SLOTS:
            self._require(name)
        targets = np.ascontiguousarray(targets, dtype=np.uint64)
        rows = segment_table(rows)
        if targets.ndim != 2 or targets.shape[1] != 4:
            raise InvalidArgumentError(
                f"targets: expected shape (n, 4), got {(<object> targets).shape}")
        if targets.shape[0] > 1 and bool(np.any(np.diff(targets[:, 0].astype(np.int64)) <= 0)):
            order = np.argsort(targets[:, 0], kind="stable")
            targets = np.ascontiguousarray(targets[order])
        cdef Py_ssize_t i, n_targets = targets.shape[0]
        cdef uint64_t[:, ::1] t = targets
        for i in range(1, n_targets):
            if t[i - 1, 0] + t[i - 1, 1] > t[i, 0]:
                raise InvalidArgumentError("targets: device buffer ranges overlap")
        cdef tps_pjrt_target *c_targets = <tps_pjrt_target *> PyMem_Malloc(
            max(n_targets, 1) * sizeof(tps_pjrt_target))
        if c_targets == NULL:
            raise MemoryError()
        cdef const PJRT_RawBuffer_Extension *ext = self._raw_extension()
        cdef char message[512]
        cdef size_t issued = 0
        cdef int code
        cdef const void *row_data = cnp.PyArray_DATA(rows)
        cdef size_t n_rows = <size_t> rows.shape[0]
        try:
            for i in range(n_targets):
                c_targets[i].base = t[i, 0]
                c_targets[i].size = t[i, 1]
                c_targets[i].buffer = <PJRT_Buffer *> (<uintptr_t> t[i, 2])
                c_targets[i].raw = <PJRT_RawBuffer *> (<uintptr_t> t[i, 3])
                if c_targets[i].raw != NULL and ext == NULL:
                    raise PjrtError(f"{self.source} has no usable raw-buffer extension",
                                    _CODE_UNIMPLEMENTED)
            with nogil:
                code = tps_pjrt_copy(self._api, ext, c_targets, <size_t> n_targets, row_data,
                                     n_rows, message, sizeof(message), &issued)
        finally:
            PyMem_Free(c_targets)
        if code != 0:
            text = message.decode("utf-8", "replace")
            name = _PJRT_ERROR_CODE_NAMES.get(code, f"CODE_{code}")
            raise PjrtError(f"device copy failed ({name}): {text}", code, text)
        return issued

    def __repr__(self):
        major, minor = self.version
        return (f"<PjrtApi {major}.{minor}, {self.num_slots} slots, at "
                f"{<uintptr_t> self._api:#x}, from {self.source}>")
