# The layout self-check of tpusync's PJRT_Api declarations, included by pjrt.pyx: the byte offset
# of every slot used and the STRUCT_SIZE of every struct filled in, as the C compiler lays them
# out (tests compare them with the facts of the public header).

cdef dict _pjrt_slot_offsets_c():
    # Byte offsets of the used slots, as the C compiler lays out our PJRT_Api declaration.
    cdef PJRT_Api t
    cdef char *base = <char *> &t
    return {
        "PJRT_Error_Destroy": <size_t> (<char *> &t.PJRT_Error_Destroy - base),
        "PJRT_Error_Message": <size_t> (<char *> &t.PJRT_Error_Message - base),
        "PJRT_Error_GetCode": <size_t> (<char *> &t.PJRT_Error_GetCode - base),
        "PJRT_Plugin_Initialize": <size_t> (<char *> &t.PJRT_Plugin_Initialize - base),
        "PJRT_Plugin_Attributes": <size_t> (<char *> &t.PJRT_Plugin_Attributes - base),
        "PJRT_Event_Destroy": <size_t> (<char *> &t.PJRT_Event_Destroy - base),
        "PJRT_Event_Await": <size_t> (<char *> &t.PJRT_Event_Await - base),
        "PJRT_Event_OnReady": <size_t> (<char *> &t.PJRT_Event_OnReady - base),
        "PJRT_Client_Create": <size_t> (<char *> &t.PJRT_Client_Create - base),
        "PJRT_Client_Destroy": <size_t> (<char *> &t.PJRT_Client_Destroy - base),
        "PJRT_Client_PlatformName": <size_t> (<char *> &t.PJRT_Client_PlatformName - base),
        "PJRT_Client_PlatformVersion": <size_t> (<char *> &t.PJRT_Client_PlatformVersion - base),
        "PJRT_Buffer_Destroy": <size_t> (<char *> &t.PJRT_Buffer_Destroy - base),
        "PJRT_Client_CreateViewOfDeviceBuffer":
            <size_t> (<char *> &t.PJRT_Client_CreateViewOfDeviceBuffer - base),
        "PJRT_Buffer_CopyRawToHost": <size_t> (<char *> &t.PJRT_Buffer_CopyRawToHost - base),
        "PJRT_Client_DmaMap": <size_t> (<char *> &t.PJRT_Client_DmaMap - base),
        "PJRT_Client_DmaUnmap": <size_t> (<char *> &t.PJRT_Client_DmaUnmap - base),
        "PJRT_Client_LookupDevice": <size_t> (<char *> &t.PJRT_Client_LookupDevice - base),
    }


cdef dict _PJRT_SLOT_OFFSETS = _pjrt_slot_offsets_c()


def _slot_offsets():
    """{slot name: byte offset in PJRT_Api} of the slots tpusync uses (layout self-check)."""
    return dict(_PJRT_SLOT_OFFSETS)


def _struct_sizes():
    """{struct name: STRUCT_SIZE} of the structs tpusync fills in (layout self-check)."""
    return {
        "PJRT_Extension_Base": PJRT_Extension_Base_STRUCT_SIZE,
        "PJRT_Api_Version": PJRT_Api_Version_STRUCT_SIZE,
        "PJRT_NamedValue": PJRT_NamedValue_STRUCT_SIZE,
        "PJRT_Error_Destroy_Args": PJRT_Error_Destroy_Args_STRUCT_SIZE,
        "PJRT_Error_Message_Args": PJRT_Error_Message_Args_STRUCT_SIZE,
        "PJRT_Error_GetCode_Args": PJRT_Error_GetCode_Args_STRUCT_SIZE,
        "PJRT_Plugin_Initialize_Args": PJRT_Plugin_Initialize_Args_STRUCT_SIZE,
        "PJRT_Plugin_Attributes_Args": PJRT_Plugin_Attributes_Args_STRUCT_SIZE,
        "PJRT_Event_Destroy_Args": PJRT_Event_Destroy_Args_STRUCT_SIZE,
        "PJRT_Event_Await_Args": PJRT_Event_Await_Args_STRUCT_SIZE,
        "PJRT_Event_OnReady_Args": PJRT_Event_OnReady_Args_STRUCT_SIZE,
        "PJRT_Client_Create_Args": PJRT_Client_Create_Args_STRUCT_SIZE,
        "PJRT_Client_Destroy_Args": PJRT_Client_Destroy_Args_STRUCT_SIZE,
        "PJRT_Client_PlatformName_Args": PJRT_Client_PlatformName_Args_STRUCT_SIZE,
        "PJRT_Client_PlatformVersion_Args": PJRT_Client_PlatformVersion_Args_STRUCT_SIZE,
        "PJRT_Client_CreateViewOfDeviceBuffer_Args":
            PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE,
        "PJRT_Client_DmaMap_Args": PJRT_Client_DmaMap_Args_STRUCT_SIZE,
        "PJRT_Client_DmaUnmap_Args": PJRT_Client_DmaUnmap_Args_STRUCT_SIZE,
        "PJRT_Buffer_Destroy_Args": PJRT_Buffer_Destroy_Args_STRUCT_SIZE,
        "PJRT_Buffer_CopyRawToHost_Args": PJRT_Buffer_CopyRawToHost_Args_STRUCT_SIZE,
        "PJRT_Client_LookupDevice_Args": PJRT_Client_LookupDevice_Args_STRUCT_SIZE,
        "PJRT_RawBuffer_CreateRawAliasOfBuffer_Args":
            PJRT_RawBuffer_CreateRawAliasOfBuffer_Args_STRUCT_SIZE,
        "PJRT_RawBuffer_Destroy_Args": PJRT_RawBuffer_Destroy_Args_STRUCT_SIZE,
        "PJRT_RawBuffer_CopyRawHostToDevice_Args":
            PJRT_RawBuffer_CopyRawHostToDevice_Args_STRUCT_SIZE,
        "PJRT_RawBuffer_Extension (used part)": PJRT_RawBuffer_Extension_USED_SIZE,
    }
