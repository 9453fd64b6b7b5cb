/* Block copies between host memory and device buffers through a PJRT plugin (the C API).
 *
 * A device buffer is described by a target: its device address range and the handles the
 * plugin gave for it (a PJRT_Buffer view for reads, a PJRT_RawBuffer alias for writes). Rows are
 * the same (src, dst, nbytes) segments the CPU copy engine takes: a row whose source lies in a
 * target is read from the device (PJRT_Buffer_CopyRawToHost), one whose destination lies in a
 * target is written to it (the raw-buffer extension's CopyRawHostToDevice), and a row that
 * touches no target is a host memcpy. Every copy is issued before any is waited for; completion
 * comes from the plugin's event callbacks (PJRT_Event_OnReady), which count down a latch the
 * caller sleeps on. Call without the GIL.
 */
#ifndef TPUSYNC_PJRT_COPY_H
#define TPUSYNC_PJRT_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "tpusync/copy_engine.h"
#include "tpusync/pjrt_min.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tps_pjrt_target {
  uint64_t base;          /* device address of the buffer's first byte */
  uint64_t size;          /* its bytes */
  PJRT_Buffer *buffer;    /* a view of it, for reads (NULL: not readable) */
  PJRT_RawBuffer *raw;    /* a raw alias of the view, for writes (NULL: not writable) */
} tps_pjrt_target;

/* Copies every row. `targets` are sorted by base and do not overlap; `raw_ext` may be NULL when
 * no target is writable. Issues nothing more after the first failure, waits for everything it
 * issued, and returns 0 on success, else a PJRT error code (the plugin's, or INVALID_ARGUMENT
 * for a row that is not wholly inside one target or reaches a device on both ends, or INTERNAL)
 * with a NUL-terminated message in `message`. `issued`, if not NULL, gets the number of device
 * copies issued. */
int tps_pjrt_copy(const PJRT_Api *api, const PJRT_RawBuffer_Extension *raw_ext,
                  const tps_pjrt_target *targets, size_t n_targets, const tps_segment *rows,
                  size_t n_rows, char *message, size_t message_size, size_t *issued);

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_PJRT_COPY_H */
