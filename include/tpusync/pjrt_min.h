/* tpusync's own minimal declarations of the PJRT C API (PJRT_Api table, major version 0).
 *
 * Written by tpusync from a list of facts about the public PJRT C API (field order, types and
 * enum values), for the few calls tpusync makes. It is not the upstream header and declares only
 * what tpusync uses; everything else is an opaque handle or an unnamed placeholder.
 *
 * The PJRT C API is a versioned C ABI:
 *  - Every struct starts with `size_t struct_size`. A plugin built against an older minor version
 *    has a shorter PJRT_Api table: a slot whose end lies beyond api->struct_size does not exist
 *    and must never be called (see tpusync's PjrtApi.has_slot).
 *  - Callers set args.struct_size to the offset of the END of the last field they know
 *    (offsetof + sizeof, no tail padding): the *_STRUCT_SIZE constants below. Newer fields are
 *    only ever appended, and plugins accept callers that know more or fewer fields.
 *  - A function returns a PJRT_Error* (NULL on success) that the caller owns and must free with
 *    PJRT_Error_Destroy, except PJRT_Error_Destroy and PJRT_Error_Message, which return nothing.
 *  - The entry point of a plugin library is the C symbol "GetPjrtApi": it takes no arguments and
 *    returns a `const PJRT_Api *` that the caller does not own.
 *
 * Layout assumptions (checked below): LP64 Linux (x86-64, aarch64), C enums of int size.
 * Minimum version tpusync accepts: 0.57 (earlier tables had a different slot order).
 */
#ifndef TPUSYNC_PJRT_MIN_H
#define TPUSYNC_PJRT_MIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Byte size of struct T as a caller that knows fields up to and including `last` declares it. */
#define TPS_PJRT_SIZE_UPTO(T, last) (offsetof(T, last) + sizeof(((T *)0)->last))

/* ---- Opaque handles (owned by the plugin; only ever used through pointers) -------------- */

typedef struct PJRT_Error PJRT_Error;
typedef struct PJRT_Client PJRT_Client;
typedef struct PJRT_Event PJRT_Event;
typedef struct PJRT_Buffer PJRT_Buffer;
typedef struct PJRT_Device PJRT_Device;
typedef struct PJRT_Memory PJRT_Memory;
/* A real struct in the API (tiled or strided layout); tpusync only passes NULL (the default). */
typedef struct PJRT_Buffer_MemoryLayout PJRT_Buffer_MemoryLayout;

/* ---- Enums --------------------------------------------------------------------------------- */

/* Error codes; the same numbers as absl::StatusCode. */
typedef enum {
  PJRT_Error_Code_OK = 0,
  PJRT_Error_Code_CANCELLED = 1,
  PJRT_Error_Code_UNKNOWN = 2,
  PJRT_Error_Code_INVALID_ARGUMENT = 3,
  PJRT_Error_Code_DEADLINE_EXCEEDED = 4,
  PJRT_Error_Code_NOT_FOUND = 5,
  PJRT_Error_Code_ALREADY_EXISTS = 6,
  PJRT_Error_Code_PERMISSION_DENIED = 7,
  PJRT_Error_Code_RESOURCE_EXHAUSTED = 8,
  PJRT_Error_Code_FAILED_PRECONDITION = 9,
  PJRT_Error_Code_ABORTED = 10,
  PJRT_Error_Code_OUT_OF_RANGE = 11,
  PJRT_Error_Code_UNIMPLEMENTED = 12,
  PJRT_Error_Code_INTERNAL = 13,
  PJRT_Error_Code_UNAVAILABLE = 14,
  PJRT_Error_Code_DATA_LOSS = 15,
  PJRT_Error_Code_UNAUTHENTICATED = 16,
} PJRT_Error_Code;

/* Which member of PJRT_NamedValue's union holds the value. */
typedef enum {
  PJRT_NamedValue_kString = 0,
  PJRT_NamedValue_kInt64 = 1,
  PJRT_NamedValue_kInt64List = 2,
  PJRT_NamedValue_kFloat = 3,
  PJRT_NamedValue_kBool = 4,
} PJRT_NamedValue_Type;

/* Element types of device buffers (used by PJRT_Client_CreateViewOfDeviceBuffer). */
typedef enum {
  PJRT_Buffer_Type_INVALID = 0,
  PJRT_Buffer_Type_PRED = 1,
  PJRT_Buffer_Type_S8 = 2,
  PJRT_Buffer_Type_S16 = 3,
  PJRT_Buffer_Type_S32 = 4,
  PJRT_Buffer_Type_S64 = 5,
  PJRT_Buffer_Type_U8 = 6,
  PJRT_Buffer_Type_U16 = 7,
  PJRT_Buffer_Type_U32 = 8,
  PJRT_Buffer_Type_U64 = 9,
  PJRT_Buffer_Type_F16 = 10,
  PJRT_Buffer_Type_F32 = 11,
  PJRT_Buffer_Type_F64 = 12,
  PJRT_Buffer_Type_BF16 = 13,
  PJRT_Buffer_Type_C64 = 14,
  PJRT_Buffer_Type_C128 = 15,
  PJRT_Buffer_Type_F8E5M2 = 16,
  PJRT_Buffer_Type_F8E4M3FN = 17,
  PJRT_Buffer_Type_F8E4M3B11FNUZ = 18,
  PJRT_Buffer_Type_F8E5M2FNUZ = 19,
  PJRT_Buffer_Type_F8E4M3FNUZ = 20,
  PJRT_Buffer_Type_S4 = 21,
  PJRT_Buffer_Type_U4 = 22,
  PJRT_Buffer_Type_TOKEN = 23,
  PJRT_Buffer_Type_S2 = 24,
  PJRT_Buffer_Type_U2 = 25,
  PJRT_Buffer_Type_F8E4M3 = 26,
  PJRT_Buffer_Type_F8E3M4 = 27,
  PJRT_Buffer_Type_F8E8M0FNU = 28,
  PJRT_Buffer_Type_F4E2M1FN = 29,
  PJRT_Buffer_Type_S1 = 30,
  PJRT_Buffer_Type_U1 = 31,
} PJRT_Buffer_Type;

/* Extension type ids are plain ints here: plugins may report ids newer than any list we keep.
 * Only the raw-buffer extension (experimental upstream, no ABI promise) is named. */
typedef int PJRT_Extension_Type;
#define TPS_PJRT_EXTENSION_TYPE_RAW_BUFFER 8

_Static_assert(sizeof(void *) == 8 && sizeof(size_t) == 8, "tpusync assumes an LP64 ABI");
_Static_assert(sizeof(PJRT_Error_Code) == sizeof(int), "enum size");
_Static_assert(sizeof(PJRT_NamedValue_Type) == sizeof(int), "enum size");
_Static_assert(sizeof(PJRT_Buffer_Type) == sizeof(int), "enum size");

/* ---- Header structs ------------------------------------------------------------------------ */

/* One link of the list of optional extensions (PJRT_Api.extension_start, and any args struct's
 * extension_start). An extension struct embeds this as its first member. */
typedef struct PJRT_Extension_Base {
  size_t struct_size;
  PJRT_Extension_Type type;
  struct PJRT_Extension_Base *next;
} PJRT_Extension_Base;

/* The version the plugin was built with (filled in by the plugin). */
typedef struct PJRT_Api_Version {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  int major_version;
  int minor_version;
} PJRT_Api_Version;

/* A named attribute or option value. value_size: element count for strings and lists, 1 for
 * scalars. */
typedef struct PJRT_NamedValue {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  const char *name;
  size_t name_size;
  PJRT_NamedValue_Type type;
  union {
    const char *string_value;
    int64_t int64_value;
    const int64_t *int64_array_value;
    float float_value;
    bool bool_value;
  };
  size_t value_size;
} PJRT_NamedValue;

enum {
  PJRT_Extension_Base_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Extension_Base, next),
  PJRT_Api_Version_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Api_Version, minor_version),
  PJRT_NamedValue_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_NamedValue, value_size),
};

/* ---- Args structs (every one starts with struct_size, extension_start) --------------------- */

/* Errors. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Error *error;
} PJRT_Error_Destroy_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  const PJRT_Error *error;
  const char *message;  /* out; valid until the error is destroyed; not NUL-terminated */
  size_t message_size;  /* out */
} PJRT_Error_Message_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  const PJRT_Error *error;
  PJRT_Error_Code code;  /* out */
} PJRT_Error_GetCode_Args;

/* Plugin. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
} PJRT_Plugin_Initialize_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  const PJRT_NamedValue *attributes;  /* out; owned by the plugin */
  size_t num_attributes;              /* out */
} PJRT_Plugin_Attributes_Args;

/* Events. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Event *event;
} PJRT_Event_Destroy_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Event *event;
} PJRT_Event_Await_Args;

/* Called once the event is ready. The callback owns `error` (NULL on success) and must destroy
 * it. It may run on a plugin thread, or at once on the caller's thread. */
typedef void (*PJRT_Event_OnReadyCallback)(PJRT_Error *error, void *user_arg);

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Event *event;
  PJRT_Event_OnReadyCallback callback;
  void *user_arg;
} PJRT_Event_OnReady_Args;

/* Client. The key-value store callbacks are function pointers that tpusync never sets (it
 * passes NULL: a single-process client); they are declared as untyped pointers. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  const PJRT_NamedValue *create_options;
  size_t num_options;
  void *kv_get_callback;      /* PJRT_KeyValueGetCallback */
  void *kv_get_user_arg;
  void *kv_put_callback;      /* PJRT_KeyValuePutCallback */
  void *kv_put_user_arg;
  PJRT_Client *client;        /* out */
  void *kv_try_get_callback;  /* PJRT_KeyValueTryGetCallback (0.61) */
  void *kv_try_get_user_arg;  /* (0.61) */
} PJRT_Client_Create_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
} PJRT_Client_Destroy_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
  const char *platform_name;  /* out; owned by the client; not NUL-terminated */
  size_t platform_name_size;  /* out */
} PJRT_Client_PlatformName_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
  const char *platform_version;  /* out; owned by the client; not NUL-terminated */
  size_t platform_version_size;  /* out */
} PJRT_Client_PlatformVersion_Args;

/* Wraps existing device memory in a PJRT_Buffer without copying. Not every plugin offers it. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
  void *device_buffer_ptr;
  const int64_t *dims;
  size_t num_dims;
  PJRT_Buffer_Type element_type;
  PJRT_Buffer_MemoryLayout *layout;  /* NULL: the default layout */
  PJRT_Device *device;               /* deprecated; ignored when memory is set */
  void (*on_delete_callback)(void *device_buffer_ptr, void *user_arg);
  void *on_delete_callback_arg;
  intptr_t stream;
  PJRT_Buffer *buffer;  /* out */
  PJRT_Memory *memory;  /* (0.66) */
} PJRT_Client_CreateViewOfDeviceBuffer_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
  void *data;
  size_t size;
} PJRT_Client_DmaMap_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
  void *data;
} PJRT_Client_DmaUnmap_Args;

/* Buffers. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Buffer *buffer;
} PJRT_Buffer_Destroy_Args;

/* Copies transfer_size bytes of the buffer's on-device representation, starting at offset, to
 * dst; completion is signalled by `event`, which the caller owns. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Buffer *buffer;
  void *dst;
  int64_t offset;
  int64_t transfer_size;
  PJRT_Event *event;  /* out */
} PJRT_Buffer_CopyRawToHost_Args;

/* A device by its global id (the id JAX reports as Device.id). */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Client *client;
  int id;
  PJRT_Device *device;  /* out; owned by the client */
} PJRT_Client_LookupDevice_Args;

/* ---- The raw-buffer extension (type 8; experimental upstream, no ABI promise) -------------
 * A PJRT_RawBuffer aliases a PJRT_Buffer's device memory; it offers the in-place host->device
 * write the core API lacks. The extension struct is a PJRT_Extension_Base followed by function
 * pointers; its struct_size says how many the plugin has (check before calling one). */
typedef struct PJRT_RawBuffer PJRT_RawBuffer;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Buffer *buffer;
  PJRT_RawBuffer *raw_buffer;  /* out; the caller owns it */
} PJRT_RawBuffer_CreateRawAliasOfBuffer_Args;

typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_RawBuffer *buffer;
} PJRT_RawBuffer_Destroy_Args;

/* Copies transfer_size bytes from src into the raw buffer at byte offset; `event`, which the
 * caller owns, is ready when the write is done. */
typedef struct {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_RawBuffer *buffer;
  const void *src;
  int64_t offset;
  int64_t transfer_size;
  PJRT_Event *event;  /* out */
} PJRT_RawBuffer_CopyRawHostToDevice_Args;

typedef PJRT_Error *PJRT_RawBuffer_CreateRawAliasOfBuffer_Fn(
    PJRT_RawBuffer_CreateRawAliasOfBuffer_Args *args);
typedef PJRT_Error *PJRT_RawBuffer_Destroy_Fn(PJRT_RawBuffer_Destroy_Args *args);
typedef PJRT_Error *PJRT_RawBuffer_CopyRawHostToDevice_Fn(
    PJRT_RawBuffer_CopyRawHostToDevice_Args *args);

typedef struct {
  PJRT_Extension_Base base;
  PJRT_RawBuffer_CreateRawAliasOfBuffer_Fn *PJRT_RawBuffer_CreateRawAliasOfBuffer;
  PJRT_RawBuffer_Destroy_Fn *PJRT_RawBuffer_Destroy;
  void *unused_get_on_device_size_in_bytes;
  void *unused_get_memory_space;
  PJRT_RawBuffer_CopyRawHostToDevice_Fn *PJRT_RawBuffer_CopyRawHostToDevice;
} PJRT_RawBuffer_Extension;

enum {
  PJRT_Error_Destroy_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Error_Destroy_Args, error),
  PJRT_Error_Message_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Error_Message_Args, message_size),
  PJRT_Error_GetCode_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Error_GetCode_Args, code),
  PJRT_Plugin_Initialize_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Plugin_Initialize_Args, extension_start),
  PJRT_Plugin_Attributes_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Plugin_Attributes_Args, num_attributes),
  PJRT_Event_Destroy_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Event_Destroy_Args, event),
  PJRT_Event_Await_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Event_Await_Args, event),
  PJRT_Event_OnReady_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Event_OnReady_Args, user_arg),
  PJRT_Client_Create_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Client_Create_Args, kv_try_get_user_arg),
  PJRT_Client_Destroy_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Client_Destroy_Args, client),
  PJRT_Client_PlatformName_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Client_PlatformName_Args, platform_name_size),
  PJRT_Client_PlatformVersion_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Client_PlatformVersion_Args, platform_version_size),
  PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Client_CreateViewOfDeviceBuffer_Args, memory),
  PJRT_Client_DmaMap_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Client_DmaMap_Args, size),
  PJRT_Client_DmaUnmap_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Client_DmaUnmap_Args, data),
  PJRT_Buffer_Destroy_Args_STRUCT_SIZE = TPS_PJRT_SIZE_UPTO(PJRT_Buffer_Destroy_Args, buffer),
  PJRT_Buffer_CopyRawToHost_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Buffer_CopyRawToHost_Args, event),
  PJRT_Client_LookupDevice_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_Client_LookupDevice_Args, device),
  PJRT_RawBuffer_CreateRawAliasOfBuffer_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_RawBuffer_CreateRawAliasOfBuffer_Args, raw_buffer),
  PJRT_RawBuffer_Destroy_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_RawBuffer_Destroy_Args, buffer),
  PJRT_RawBuffer_CopyRawHostToDevice_Args_STRUCT_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_RawBuffer_CopyRawHostToDevice_Args, event),
  /* the extension as far as tpusync uses it: through CopyRawHostToDevice */
  PJRT_RawBuffer_Extension_USED_SIZE =
      TPS_PJRT_SIZE_UPTO(PJRT_RawBuffer_Extension, PJRT_RawBuffer_CopyRawHostToDevice),
};

/* ---- Function types of the slots tpusync uses --------------------------------------------- */

typedef void PJRT_Error_Destroy_Fn(PJRT_Error_Destroy_Args *args);
typedef void PJRT_Error_Message_Fn(PJRT_Error_Message_Args *args);
typedef PJRT_Error *PJRT_Error_GetCode_Fn(PJRT_Error_GetCode_Args *args);
typedef PJRT_Error *PJRT_Plugin_Initialize_Fn(PJRT_Plugin_Initialize_Args *args);
typedef PJRT_Error *PJRT_Plugin_Attributes_Fn(PJRT_Plugin_Attributes_Args *args);
typedef PJRT_Error *PJRT_Event_Destroy_Fn(PJRT_Event_Destroy_Args *args);
typedef PJRT_Error *PJRT_Event_Await_Fn(PJRT_Event_Await_Args *args);
typedef PJRT_Error *PJRT_Event_OnReady_Fn(PJRT_Event_OnReady_Args *args);
typedef PJRT_Error *PJRT_Client_Create_Fn(PJRT_Client_Create_Args *args);
typedef PJRT_Error *PJRT_Client_Destroy_Fn(PJRT_Client_Destroy_Args *args);
typedef PJRT_Error *PJRT_Client_PlatformName_Fn(PJRT_Client_PlatformName_Args *args);
typedef PJRT_Error *PJRT_Client_PlatformVersion_Fn(PJRT_Client_PlatformVersion_Args *args);
typedef PJRT_Error *PJRT_Buffer_Destroy_Fn(PJRT_Buffer_Destroy_Args *args);
typedef PJRT_Error *PJRT_Client_CreateViewOfDeviceBuffer_Fn(
    PJRT_Client_CreateViewOfDeviceBuffer_Args *args);
typedef PJRT_Error *PJRT_Buffer_CopyRawToHost_Fn(PJRT_Buffer_CopyRawToHost_Args *args);
typedef PJRT_Error *PJRT_Client_DmaMap_Fn(PJRT_Client_DmaMap_Args *args);
typedef PJRT_Error *PJRT_Client_DmaUnmap_Fn(PJRT_Client_DmaUnmap_Args *args);
typedef PJRT_Error *PJRT_Client_LookupDevice_Fn(PJRT_Client_LookupDevice_Args *args);

/* ---- The table ------------------------------------------------------------------------------
 * A header, then one function pointer per slot: slot i lies at byte 40 + 8*i. Declared up to the
 * last slot tpusync uses (111); the plugin's table is usually longer (struct_size says how long)
 * and may be shorter. Slots tpusync does not call are unnamed placeholders, with the upstream
 * member name in a comment so that indices can be checked. */
typedef struct PJRT_Api {
  size_t struct_size;
  PJRT_Extension_Base *extension_start;
  PJRT_Api_Version pjrt_api_version;
  /*   0 */ PJRT_Error_Destroy_Fn *PJRT_Error_Destroy;
  /*   1 */ PJRT_Error_Message_Fn *PJRT_Error_Message;
  /*   2 */ PJRT_Error_GetCode_Fn *PJRT_Error_GetCode;
  /*   3 */ PJRT_Plugin_Initialize_Fn *PJRT_Plugin_Initialize;
  /*   4 */ PJRT_Plugin_Attributes_Fn *PJRT_Plugin_Attributes;
  /*   5 */ PJRT_Event_Destroy_Fn *PJRT_Event_Destroy;
  /*   6 */ void *unused_006; /* PJRT_Event_IsReady */
  /*   7 */ void *unused_007; /* PJRT_Event_Error */
  /*   8 */ PJRT_Event_Await_Fn *PJRT_Event_Await;
  /*   9 */ PJRT_Event_OnReady_Fn *PJRT_Event_OnReady;
  /*  10 */ PJRT_Client_Create_Fn *PJRT_Client_Create;
  /*  11 */ PJRT_Client_Destroy_Fn *PJRT_Client_Destroy;
  /*  12 */ PJRT_Client_PlatformName_Fn *PJRT_Client_PlatformName;
  /*  13 */ void *unused_013; /* PJRT_Client_ProcessIndex */
  /*  14 */ PJRT_Client_PlatformVersion_Fn *PJRT_Client_PlatformVersion;
  /*  15 */ void *unused_015; /* PJRT_Client_Devices */
  /*  16 */ void *unused_016; /* PJRT_Client_AddressableDevices */
  /*  17 */ PJRT_Client_LookupDevice_Fn *PJRT_Client_LookupDevice;
  /*  18 */ void *unused_018; /* PJRT_Client_LookupAddressableDevice */
  /*  19 */ void *unused_019; /* PJRT_Client_AddressableMemories */
  /*  20 */ void *unused_020; /* PJRT_Client_Compile */
  /*  21 */ void *unused_021; /* PJRT_Client_DefaultDeviceAssignment */
  /*  22 */ void *unused_022; /* PJRT_Client_BufferFromHostBuffer */
  /*  23 */ void *unused_023; /* PJRT_DeviceDescription_Id */
  /*  24 */ void *unused_024; /* PJRT_DeviceDescription_ProcessIndex */
  /*  25 */ void *unused_025; /* PJRT_DeviceDescription_Attributes */
  /*  26 */ void *unused_026; /* PJRT_DeviceDescription_Kind */
  /*  27 */ void *unused_027; /* PJRT_DeviceDescription_DebugString */
  /*  28 */ void *unused_028; /* PJRT_DeviceDescription_ToString */
  /*  29 */ void *unused_029; /* PJRT_Device_GetDescription */
  /*  30 */ void *unused_030; /* PJRT_Device_IsAddressable */
  /*  31 */ void *unused_031; /* PJRT_Device_LocalHardwareId */
  /*  32 */ void *unused_032; /* PJRT_Device_AddressableMemories */
  /*  33 */ void *unused_033; /* PJRT_Device_DefaultMemory */
  /*  34 */ void *unused_034; /* PJRT_Device_MemoryStats */
  /*  35 */ void *unused_035; /* PJRT_Memory_Id */
  /*  36 */ void *unused_036; /* PJRT_Memory_Kind */
  /*  37 */ void *unused_037; /* PJRT_Memory_DebugString */
  /*  38 */ void *unused_038; /* PJRT_Memory_ToString */
  /*  39 */ void *unused_039; /* PJRT_Memory_AddressableByDevices */
  /*  40 */ void *unused_040; /* PJRT_Executable_Destroy */
  /*  41 */ void *unused_041; /* PJRT_Executable_Name */
  /*  42 */ void *unused_042; /* PJRT_Executable_NumReplicas */
  /*  43 */ void *unused_043; /* PJRT_Executable_NumPartitions */
  /*  44 */ void *unused_044; /* PJRT_Executable_NumOutputs */
  /*  45 */ void *unused_045; /* PJRT_Executable_SizeOfGeneratedCodeInBytes */
  /*  46 */ void *unused_046; /* PJRT_Executable_GetCostAnalysis */
  /*  47 */ void *unused_047; /* PJRT_Executable_OutputMemoryKinds */
  /*  48 */ void *unused_048; /* PJRT_Executable_OptimizedProgram */
  /*  49 */ void *unused_049; /* PJRT_Executable_Serialize */
  /*  50 */ void *unused_050; /* PJRT_LoadedExecutable_Destroy */
  /*  51 */ void *unused_051; /* PJRT_LoadedExecutable_GetExecutable */
  /*  52 */ void *unused_052; /* PJRT_LoadedExecutable_AddressableDevices */
  /*  53 */ void *unused_053; /* PJRT_LoadedExecutable_Delete */
  /*  54 */ void *unused_054; /* PJRT_LoadedExecutable_IsDeleted */
  /*  55 */ void *unused_055; /* PJRT_LoadedExecutable_Execute */
  /*  56 */ void *unused_056; /* PJRT_Executable_DeserializeAndLoad */
  /*  57 */ void *unused_057; /* PJRT_LoadedExecutable_Fingerprint */
  /*  58 */ PJRT_Buffer_Destroy_Fn *PJRT_Buffer_Destroy;
  /*  59 */ void *unused_059; /* PJRT_Buffer_ElementType */
  /*  60 */ void *unused_060; /* PJRT_Buffer_Dimensions */
  /*  61 */ void *unused_061; /* PJRT_Buffer_UnpaddedDimensions */
  /*  62 */ void *unused_062; /* PJRT_Buffer_DynamicDimensionIndices */
  /*  63 */ void *unused_063; /* PJRT_Buffer_GetMemoryLayout */
  /*  64 */ void *unused_064; /* PJRT_Buffer_OnDeviceSizeInBytes */
  /*  65 */ void *unused_065; /* PJRT_Buffer_Device */
  /*  66 */ void *unused_066; /* PJRT_Buffer_Memory */
  /*  67 */ void *unused_067; /* PJRT_Buffer_Delete */
  /*  68 */ void *unused_068; /* PJRT_Buffer_IsDeleted */
  /*  69 */ void *unused_069; /* PJRT_Buffer_CopyToDevice */
  /*  70 */ void *unused_070; /* PJRT_Buffer_ToHostBuffer */
  /*  71 */ void *unused_071; /* PJRT_Buffer_IsOnCpu */
  /*  72 */ void *unused_072; /* PJRT_Buffer_ReadyEvent */
  /*  73 */ void *unused_073; /* PJRT_Buffer_UnsafePointer */
  /*  74 */ void *unused_074; /* PJRT_Buffer_IncreaseExternalReferenceCount */
  /*  75 */ void *unused_075; /* PJRT_Buffer_DecreaseExternalReferenceCount */
  /*  76 */ void *unused_076; /* PJRT_Buffer_OpaqueDeviceMemoryDataPointer */
  /*  77 */ void *unused_077; /* PJRT_CopyToDeviceStream_Destroy */
  /*  78 */ void *unused_078; /* PJRT_CopyToDeviceStream_AddChunk */
  /*  79 */ void *unused_079; /* PJRT_CopyToDeviceStream_TotalBytes */
  /*  80 */ void *unused_080; /* PJRT_CopyToDeviceStream_GranuleSize */
  /*  81 */ void *unused_081; /* PJRT_CopyToDeviceStream_CurrentBytes */
  /*  82 */ void *unused_082; /* PJRT_TopologyDescription_Create */
  /*  83 */ void *unused_083; /* PJRT_TopologyDescription_Destroy */
  /*  84 */ void *unused_084; /* PJRT_TopologyDescription_PlatformName */
  /*  85 */ void *unused_085; /* PJRT_TopologyDescription_PlatformVersion */
  /*  86 */ void *unused_086; /* PJRT_TopologyDescription_GetDeviceDescriptions */
  /*  87 */ void *unused_087; /* PJRT_TopologyDescription_Serialize */
  /*  88 */ void *unused_088; /* PJRT_TopologyDescription_Attributes */
  /*  89 */ void *unused_089; /* PJRT_Compile */
  /*  90 */ void *unused_090; /* PJRT_Executable_OutputElementTypes */
  /*  91 */ void *unused_091; /* PJRT_Executable_OutputDimensions */
  /*  92 */ void *unused_092; /* PJRT_Buffer_CopyToMemory */
  /*  93 */ PJRT_Client_CreateViewOfDeviceBuffer_Fn *PJRT_Client_CreateViewOfDeviceBuffer;
  /*  94 */ void *unused_094; /* PJRT_Executable_Fingerprint */
  /*  95 */ void *unused_095; /* PJRT_Client_TopologyDescription */
  /*  96 */ void *unused_096; /* PJRT_Executable_GetCompiledMemoryStats */
  /*  97 */ void *unused_097; /* PJRT_Memory_Kind_Id */
  /*  98 */ void *unused_098; /* PJRT_ExecuteContext_Create */
  /*  99 */ void *unused_099; /* PJRT_ExecuteContext_Destroy */
  /* 100 */ PJRT_Buffer_CopyRawToHost_Fn *PJRT_Buffer_CopyRawToHost;
  /* 101 */ void *unused_101; /* PJRT_AsyncHostToDeviceTransferManager_Destroy */
  /* 102 */ void *unused_102; /* PJRT_AsyncHostToDeviceTransferManager_TransferData */
  /* 103 */ void *unused_103; /* PJRT_Client_CreateBuffersForAsyncHostToDevice */
  /* 104 */ void *unused_104; /* PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer */
  /* 105 */ void *unused_105; /* PJRT_AsyncHostToDeviceTransferManager_Device */
  /* 106 */ void *unused_106; /* PJRT_AsyncHostToDeviceTransferManager_BufferCount */
  /* 107 */ void *unused_107; /* PJRT_AsyncHostToDeviceTransferManager_BufferSize */
  /* 108 */ void *unused_108; /* PJRT_AsyncHostToDeviceTransferManager_SetBufferError */
  /* 109 */ void *unused_109; /* PJRT_AsyncHostToDeviceTransferManager_AddMetadata */
  /* 110 */ PJRT_Client_DmaMap_Fn *PJRT_Client_DmaMap;
  /* 111 */ PJRT_Client_DmaUnmap_Fn *PJRT_Client_DmaUnmap;
} PJRT_Api;

/* The entry point a plugin library exports as the C symbol "GetPjrtApi" (found with dlsym). */
typedef const PJRT_Api *PJRT_GetPjrtApi_Fn(void);

/* Every used slot sits at 40 + 8*index. */
#define TPS_PJRT_SLOT_AT(member, index) \
  _Static_assert(offsetof(PJRT_Api, member) == 40 + 8 * (index), #member " is not slot " #index)
TPS_PJRT_SLOT_AT(PJRT_Error_Destroy, 0);
TPS_PJRT_SLOT_AT(PJRT_Error_Message, 1);
TPS_PJRT_SLOT_AT(PJRT_Error_GetCode, 2);
TPS_PJRT_SLOT_AT(PJRT_Plugin_Initialize, 3);
TPS_PJRT_SLOT_AT(PJRT_Plugin_Attributes, 4);
TPS_PJRT_SLOT_AT(PJRT_Event_Destroy, 5);
TPS_PJRT_SLOT_AT(PJRT_Event_Await, 8);
TPS_PJRT_SLOT_AT(PJRT_Event_OnReady, 9);
TPS_PJRT_SLOT_AT(PJRT_Client_Create, 10);
TPS_PJRT_SLOT_AT(PJRT_Client_Destroy, 11);
TPS_PJRT_SLOT_AT(PJRT_Client_PlatformName, 12);
TPS_PJRT_SLOT_AT(PJRT_Client_PlatformVersion, 14);
TPS_PJRT_SLOT_AT(PJRT_Client_LookupDevice, 17);
TPS_PJRT_SLOT_AT(PJRT_Buffer_Destroy, 58);
TPS_PJRT_SLOT_AT(PJRT_Client_CreateViewOfDeviceBuffer, 93);
TPS_PJRT_SLOT_AT(PJRT_Buffer_CopyRawToHost, 100);
TPS_PJRT_SLOT_AT(PJRT_Client_DmaMap, 110);
TPS_PJRT_SLOT_AT(PJRT_Client_DmaUnmap, 111);

/* Header and args struct sizes as the API defines them. */
_Static_assert(offsetof(PJRT_Api, pjrt_api_version) == 16, "PJRT_Api header");
_Static_assert(PJRT_Extension_Base_STRUCT_SIZE == 24, "PJRT_Extension_Base");
_Static_assert(PJRT_Api_Version_STRUCT_SIZE == 24, "PJRT_Api_Version");
_Static_assert(sizeof(PJRT_Api_Version) == 24, "PJRT_Api_Version is embedded by value");
_Static_assert(offsetof(PJRT_NamedValue, type) == 32, "PJRT_NamedValue.type");
_Static_assert(offsetof(PJRT_NamedValue, int64_value) == 40, "PJRT_NamedValue value union");
_Static_assert(PJRT_NamedValue_STRUCT_SIZE == 56, "PJRT_NamedValue");
_Static_assert(PJRT_Error_Destroy_Args_STRUCT_SIZE == 24, "PJRT_Error_Destroy_Args");
_Static_assert(PJRT_Error_Message_Args_STRUCT_SIZE == 40, "PJRT_Error_Message_Args");
_Static_assert(PJRT_Error_GetCode_Args_STRUCT_SIZE == 28, "PJRT_Error_GetCode_Args");
_Static_assert(PJRT_Plugin_Initialize_Args_STRUCT_SIZE == 16, "PJRT_Plugin_Initialize_Args");
_Static_assert(PJRT_Plugin_Attributes_Args_STRUCT_SIZE == 32, "PJRT_Plugin_Attributes_Args");
_Static_assert(PJRT_Event_Destroy_Args_STRUCT_SIZE == 24, "PJRT_Event_Destroy_Args");
_Static_assert(PJRT_Event_Await_Args_STRUCT_SIZE == 24, "PJRT_Event_Await_Args");
_Static_assert(PJRT_Event_OnReady_Args_STRUCT_SIZE == 40, "PJRT_Event_OnReady_Args");
_Static_assert(offsetof(PJRT_Client_Create_Args, client) == 64, "PJRT_Client_Create_Args.client");
_Static_assert(PJRT_Client_Create_Args_STRUCT_SIZE == 88, "PJRT_Client_Create_Args");
_Static_assert(PJRT_Client_Destroy_Args_STRUCT_SIZE == 24, "PJRT_Client_Destroy_Args");
_Static_assert(PJRT_Client_PlatformName_Args_STRUCT_SIZE == 40, "PJRT_Client_PlatformName_Args");
_Static_assert(PJRT_Client_PlatformVersion_Args_STRUCT_SIZE == 40,
               "PJRT_Client_PlatformVersion_Args");
_Static_assert(offsetof(PJRT_Client_CreateViewOfDeviceBuffer_Args, element_type) == 48,
               "PJRT_Client_CreateViewOfDeviceBuffer_Args.element_type");
_Static_assert(offsetof(PJRT_Client_CreateViewOfDeviceBuffer_Args, stream) == 88,
               "PJRT_Client_CreateViewOfDeviceBuffer_Args.stream");
_Static_assert(offsetof(PJRT_Client_CreateViewOfDeviceBuffer_Args, buffer) == 96,
               "PJRT_Client_CreateViewOfDeviceBuffer_Args.buffer");
_Static_assert(PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE == 112,
               "PJRT_Client_CreateViewOfDeviceBuffer_Args");
_Static_assert(PJRT_Client_DmaMap_Args_STRUCT_SIZE == 40, "PJRT_Client_DmaMap_Args");
_Static_assert(PJRT_Client_DmaUnmap_Args_STRUCT_SIZE == 32, "PJRT_Client_DmaUnmap_Args");
_Static_assert(PJRT_Buffer_Destroy_Args_STRUCT_SIZE == 24, "PJRT_Buffer_Destroy_Args");
_Static_assert(offsetof(PJRT_Buffer_CopyRawToHost_Args, event) == 48,
               "PJRT_Buffer_CopyRawToHost_Args.event");
_Static_assert(PJRT_Buffer_CopyRawToHost_Args_STRUCT_SIZE == 56,
               "PJRT_Buffer_CopyRawToHost_Args");
_Static_assert(offsetof(PJRT_Client_LookupDevice_Args, device) == 32,
               "PJRT_Client_LookupDevice_Args.device");
_Static_assert(PJRT_Client_LookupDevice_Args_STRUCT_SIZE == 40, "PJRT_Client_LookupDevice_Args");
_Static_assert(PJRT_RawBuffer_CreateRawAliasOfBuffer_Args_STRUCT_SIZE == 32,
               "PJRT_RawBuffer_CreateRawAliasOfBuffer_Args");
_Static_assert(PJRT_RawBuffer_Destroy_Args_STRUCT_SIZE == 24, "PJRT_RawBuffer_Destroy_Args");
_Static_assert(PJRT_RawBuffer_CopyRawHostToDevice_Args_STRUCT_SIZE == 56,
               "PJRT_RawBuffer_CopyRawHostToDevice_Args");
_Static_assert(offsetof(PJRT_RawBuffer_Extension, PJRT_RawBuffer_CreateRawAliasOfBuffer) == 24,
               "raw-buffer extension: CreateRawAliasOfBuffer");
_Static_assert(offsetof(PJRT_RawBuffer_Extension, PJRT_RawBuffer_Destroy) == 32,
               "raw-buffer extension: Destroy");
_Static_assert(offsetof(PJRT_RawBuffer_Extension, PJRT_RawBuffer_CopyRawHostToDevice) == 56,
               "raw-buffer extension: CopyRawHostToDevice");

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* TPUSYNC_PJRT_MIN_H */
