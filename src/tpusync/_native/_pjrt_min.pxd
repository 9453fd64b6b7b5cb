# Declarations of include/tpusync/pjrt_min.h: tpusync's own minimal PJRT C API declarations.
# Only the members tpusync reads or calls are listed; the C header fixes the layout (slot
# placeholders, static asserts). Every function pointer may be called without the GIL.
from libc.stdint cimport int64_t, intptr_t


cdef extern from "tpusync/pjrt_min.h" nogil:
    ctypedef struct PJRT_Error:
        pass
    ctypedef struct PJRT_Client:
        pass
    ctypedef struct PJRT_Event:
        pass
    ctypedef struct PJRT_Buffer:
        pass
    ctypedef struct PJRT_Device:
        pass
    ctypedef struct PJRT_Memory:
        pass
    ctypedef struct PJRT_Buffer_MemoryLayout:
        pass

    ctypedef enum PJRT_Error_Code:
        PJRT_Error_Code_OK
        PJRT_Error_Code_UNKNOWN
        PJRT_Error_Code_UNIMPLEMENTED
        PJRT_Error_Code_INTERNAL

    ctypedef enum PJRT_NamedValue_Type:
        PJRT_NamedValue_kString
        PJRT_NamedValue_kInt64
        PJRT_NamedValue_kInt64List
        PJRT_NamedValue_kFloat
        PJRT_NamedValue_kBool

    ctypedef int PJRT_Buffer_Type
    ctypedef int PJRT_Extension_Type
    enum: TPS_PJRT_EXTENSION_TYPE_RAW_BUFFER

    ctypedef struct PJRT_Extension_Base:
        size_t struct_size
        PJRT_Extension_Type type
        PJRT_Extension_Base *next

    ctypedef struct PJRT_Api_Version:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        int major_version
        int minor_version

    ctypedef struct PJRT_NamedValue:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        const char *name
        size_t name_size
        PJRT_NamedValue_Type type
        # members of an anonymous union
        const char *string_value
        int64_t int64_value
        const int64_t *int64_array_value
        float float_value
        bint bool_value
        size_t value_size

    enum:
        PJRT_Extension_Base_STRUCT_SIZE
        PJRT_Api_Version_STRUCT_SIZE
        PJRT_NamedValue_STRUCT_SIZE

    ctypedef struct PJRT_Error_Destroy_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Error *error

    ctypedef struct PJRT_Error_Message_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        const PJRT_Error *error
        const char *message
        size_t message_size

    ctypedef struct PJRT_Error_GetCode_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        const PJRT_Error *error
        PJRT_Error_Code code

    ctypedef struct PJRT_Plugin_Initialize_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start

    ctypedef struct PJRT_Plugin_Attributes_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        const PJRT_NamedValue *attributes
        size_t num_attributes

    ctypedef struct PJRT_Event_Destroy_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Event *event

    ctypedef struct PJRT_Event_Await_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Event *event

    ctypedef void (*PJRT_Event_OnReadyCallback)(PJRT_Error *error, void *user_arg) noexcept nogil

    ctypedef struct PJRT_Event_OnReady_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Event *event
        PJRT_Event_OnReadyCallback callback
        void *user_arg

    ctypedef struct PJRT_Client_Create_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        const PJRT_NamedValue *create_options
        size_t num_options
        void *kv_get_callback
        void *kv_get_user_arg
        void *kv_put_callback
        void *kv_put_user_arg
        PJRT_Client *client
        void *kv_try_get_callback
        void *kv_try_get_user_arg

    ctypedef struct PJRT_Client_Destroy_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client

    ctypedef struct PJRT_Client_PlatformName_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client
        const char *platform_name
        size_t platform_name_size

    ctypedef struct PJRT_Client_PlatformVersion_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client
        const char *platform_version
        size_t platform_version_size

    ctypedef struct PJRT_Client_CreateViewOfDeviceBuffer_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client
        void *device_buffer_ptr
        const int64_t *dims
        size_t num_dims
        PJRT_Buffer_Type element_type
        PJRT_Buffer_MemoryLayout *layout
        PJRT_Device *device
        void (*on_delete_callback)(void *device_buffer_ptr, void *user_arg) noexcept nogil
        void *on_delete_callback_arg
        intptr_t stream
        PJRT_Buffer *buffer
        PJRT_Memory *memory

    ctypedef struct PJRT_Client_DmaMap_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client
        void *data
        size_t size

    ctypedef struct PJRT_Client_DmaUnmap_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client
        void *data

    ctypedef struct PJRT_Buffer_Destroy_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Buffer *buffer

    ctypedef struct PJRT_Buffer_CopyRawToHost_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Buffer *buffer
        void *dst
        int64_t offset
        int64_t transfer_size
        PJRT_Event *event

    ctypedef struct PJRT_Client_LookupDevice_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Client *client
        int id
        PJRT_Device *device

    # The raw-buffer extension (experimental upstream): only what tpusync calls.
    ctypedef struct PJRT_RawBuffer:
        pass

    ctypedef struct PJRT_RawBuffer_CreateRawAliasOfBuffer_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Buffer *buffer
        PJRT_RawBuffer *raw_buffer

    ctypedef struct PJRT_RawBuffer_Destroy_Args:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_RawBuffer *buffer

    ctypedef struct PJRT_RawBuffer_Extension:
        PJRT_Extension_Base base
        PJRT_Error *(*PJRT_RawBuffer_CreateRawAliasOfBuffer)(
            PJRT_RawBuffer_CreateRawAliasOfBuffer_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_RawBuffer_Destroy)(PJRT_RawBuffer_Destroy_Args *args) noexcept nogil
        void *PJRT_RawBuffer_CopyRawHostToDevice

    enum:
        PJRT_Error_Destroy_Args_STRUCT_SIZE
        PJRT_Error_Message_Args_STRUCT_SIZE
        PJRT_Error_GetCode_Args_STRUCT_SIZE
        PJRT_Plugin_Initialize_Args_STRUCT_SIZE
        PJRT_Plugin_Attributes_Args_STRUCT_SIZE
        PJRT_Event_Destroy_Args_STRUCT_SIZE
        PJRT_Event_Await_Args_STRUCT_SIZE
        PJRT_Event_OnReady_Args_STRUCT_SIZE
        PJRT_Client_Create_Args_STRUCT_SIZE
        PJRT_Client_Destroy_Args_STRUCT_SIZE
        PJRT_Client_PlatformName_Args_STRUCT_SIZE
        PJRT_Client_PlatformVersion_Args_STRUCT_SIZE
        PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE
        PJRT_Client_DmaMap_Args_STRUCT_SIZE
        PJRT_Client_DmaUnmap_Args_STRUCT_SIZE
        PJRT_Buffer_Destroy_Args_STRUCT_SIZE
        PJRT_Buffer_CopyRawToHost_Args_STRUCT_SIZE
        PJRT_Client_LookupDevice_Args_STRUCT_SIZE
        PJRT_RawBuffer_CreateRawAliasOfBuffer_Args_STRUCT_SIZE
        PJRT_RawBuffer_Destroy_Args_STRUCT_SIZE
        PJRT_RawBuffer_CopyRawHostToDevice_Args_STRUCT_SIZE
        PJRT_RawBuffer_Extension_USED_SIZE

    # The table. Only the used slots are named here; the C header places them (slot i at byte
    # 40 + 8*i). A slot exists only if it ends within struct_size: check before calling.
    ctypedef struct PJRT_Api:
        size_t struct_size
        PJRT_Extension_Base *extension_start
        PJRT_Api_Version pjrt_api_version
        void (*PJRT_Error_Destroy)(PJRT_Error_Destroy_Args *args) noexcept nogil
        void (*PJRT_Error_Message)(PJRT_Error_Message_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Error_GetCode)(PJRT_Error_GetCode_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Plugin_Initialize)(PJRT_Plugin_Initialize_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Plugin_Attributes)(PJRT_Plugin_Attributes_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Event_Destroy)(PJRT_Event_Destroy_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Event_Await)(PJRT_Event_Await_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Event_OnReady)(PJRT_Event_OnReady_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_Create)(PJRT_Client_Create_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_Destroy)(PJRT_Client_Destroy_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_PlatformName)(
            PJRT_Client_PlatformName_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_PlatformVersion)(
            PJRT_Client_PlatformVersion_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Buffer_Destroy)(PJRT_Buffer_Destroy_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_CreateViewOfDeviceBuffer)(
            PJRT_Client_CreateViewOfDeviceBuffer_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Buffer_CopyRawToHost)(
            PJRT_Buffer_CopyRawToHost_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_DmaMap)(PJRT_Client_DmaMap_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_DmaUnmap)(PJRT_Client_DmaUnmap_Args *args) noexcept nogil
        PJRT_Error *(*PJRT_Client_LookupDevice)(
            PJRT_Client_LookupDevice_Args *args) noexcept nogil


# The entry point every plugin library exports as the C symbol "GetPjrtApi" (looked up with
# dlsym, never linked): no arguments; the caller does not own the table.
ctypedef const PJRT_Api *(*tps_GetPjrtApi_fn)() noexcept nogil
