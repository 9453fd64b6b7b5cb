/* Block copies through a PJRT plugin, completed by event callbacks (see pjrt_copy.h). */
#include "tpusync/pjrt_copy.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the callbacks of one tps_pjrt_copy call count down. Lives on the caller's stack: the
 * caller returns only once `remaining` is 0, and a callback touches it last under the mutex. */
typedef struct latch {
  const PJRT_Api *api;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  size_t remaining;
  int code;  /* first failure's PJRT error code, 0 while none */
  char *message;
  size_t message_size;
} latch;

typedef struct pending {
  latch *latch;
  PJRT_Event *event;
} pending;

static int slot_present(const PJRT_Api *api, const void *slot) {
  size_t offset = (size_t)((const char *)slot - (const char *)api);
  return offset + sizeof(void *) <= api->struct_size && *(void *const *)slot != NULL;
}

/* Records a failure (the first one wins). Call with the latch's mutex held. */
static void fail_locked(latch *l, int code, const char *text, size_t text_size) {
  if (l->code != 0) return;
  l->code = code > 0 ? code : PJRT_Error_Code_UNKNOWN;
  if (l->message_size == 0) return;
  size_t n = text_size < l->message_size - 1 ? text_size : l->message_size - 1;
  memcpy(l->message, text, n);
  l->message[n] = '\0';
}

static void fail(latch *l, int code, const char *text) {
  pthread_mutex_lock(&l->mu);
  fail_locked(l, code, text, strlen(text));
  pthread_mutex_unlock(&l->mu);
}

/* Reads, records and destroys a PJRT_Error the caller owns. */
static void fail_with_error(latch *l, PJRT_Error *error) {
  const PJRT_Api *api = l->api;
  const char *text = "(no message)";
  size_t text_size = strlen(text);
  int code = PJRT_Error_Code_UNKNOWN;
  if (slot_present(api, &api->PJRT_Error_Message)) {
    PJRT_Error_Message_Args m = {0};
    m.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE;
    m.error = error;
    api->PJRT_Error_Message(&m);
    if (m.message != NULL) {
      text = m.message;
      text_size = m.message_size;
    }
  }
  if (slot_present(api, &api->PJRT_Error_GetCode)) {
    PJRT_Error_GetCode_Args c = {0};
    c.struct_size = PJRT_Error_GetCode_Args_STRUCT_SIZE;
    c.error = error;
    PJRT_Error *code_error = api->PJRT_Error_GetCode(&c);
    if (code_error == NULL) {
      code = (int)c.code;
    } else if (slot_present(api, &api->PJRT_Error_Destroy)) {
      PJRT_Error_Destroy_Args d = {PJRT_Error_Destroy_Args_STRUCT_SIZE, NULL, code_error};
      api->PJRT_Error_Destroy(&d);
    }
  }
  pthread_mutex_lock(&l->mu);
  fail_locked(l, code, text, text_size);
  pthread_mutex_unlock(&l->mu);
  if (slot_present(api, &api->PJRT_Error_Destroy)) {
    PJRT_Error_Destroy_Args d = {PJRT_Error_Destroy_Args_STRUCT_SIZE, NULL, error};
    api->PJRT_Error_Destroy(&d);
  }
}

static void destroy_event(latch *l, PJRT_Event *event) {
  PJRT_Event_Destroy_Args d = {PJRT_Event_Destroy_Args_STRUCT_SIZE, NULL, event};
  PJRT_Error *error = l->api->PJRT_Event_Destroy(&d);
  if (error != NULL) fail_with_error(l, error);
}

static void count_down(latch *l) {
  pthread_mutex_lock(&l->mu);
  if (--l->remaining == 0) pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);  /* the last touch of the latch */
}

/* PJRT_Event_OnReady callback: may run on a plugin thread, or at once inside OnReady. */
static void on_ready(PJRT_Error *error, void *user_arg) {
  pending *p = (pending *)user_arg;
  latch *l = p->latch;
  if (error != NULL) fail_with_error(l, error);
  destroy_event(l, p->event);
  count_down(l);
}

/* Hands the copy's event to on_ready; when the plugin refuses the callback, waits for the copy
 * here instead (its destination must not be released while the device may still write it). */
static void watch(latch *l, pending *p) {
  const PJRT_Api *api = l->api;
  PJRT_Event_OnReady_Args r = {0};
  r.struct_size = PJRT_Event_OnReady_Args_STRUCT_SIZE;
  r.event = p->event;
  r.callback = on_ready;
  r.user_arg = p;
  PJRT_Error *error = api->PJRT_Event_OnReady(&r);
  if (error == NULL) return;
  fail_with_error(l, error);
  if (slot_present(api, &api->PJRT_Event_Await)) {
    PJRT_Event_Await_Args a = {PJRT_Event_Await_Args_STRUCT_SIZE, NULL, p->event};
    PJRT_Error *await_error = api->PJRT_Event_Await(&a);
    if (await_error != NULL) fail_with_error(l, await_error);
  }
  destroy_event(l, p->event);
  count_down(l);
}

/* The target holding [address, address + nbytes), or NULL; *partial is set when the range
 * starts inside a target but does not end inside it. */
static const tps_pjrt_target *find_target(const tps_pjrt_target *targets, size_t n,
                                          uint64_t address, uint64_t nbytes, int *partial) {
  size_t lo = 0, hi = n;
  while (lo < hi) { /* the last target whose base is <= address */
    size_t mid = lo + (hi - lo) / 2;
    if (targets[mid].base <= address) lo = mid + 1; else hi = mid;
  }
  if (lo == 0) return NULL;
  const tps_pjrt_target *t = &targets[lo - 1];
  uint64_t offset = address - t->base;
  if (offset >= t->size) return NULL;
  if (nbytes > t->size - offset) {
    *partial = 1;
    return NULL;
  }
  return t;
}

/* Issues one row; returns 0, or nonzero when it failed (recorded in the latch). */
static int issue(latch *l, const PJRT_RawBuffer_Extension *raw_ext,
                 const tps_pjrt_target *targets, size_t n_targets, const tps_segment *row,
                 pending *p, size_t *issued) {
  const PJRT_Api *api = l->api;
  int partial = 0;
  char text[160];
  if (row->nbytes == 0) return 0;
  const tps_pjrt_target *from = find_target(targets, n_targets, row->src, row->nbytes, &partial);
  const tps_pjrt_target *to = find_target(targets, n_targets, row->dst, row->nbytes, &partial);
  if (partial || (from != NULL && to != NULL)) {
    snprintf(text, sizeof text, "segment %#llx -> %#llx (%llu bytes) %s",
             (unsigned long long)row->src, (unsigned long long)row->dst,
             (unsigned long long)row->nbytes,
             partial ? "crosses the end of a device buffer" : "is device to device");
    fail(l, PJRT_Error_Code_INVALID_ARGUMENT, text);
    return 1;
  }
  if (from == NULL && to == NULL) { /* host to host */
    memcpy((void *)(uintptr_t)row->dst, (const void *)(uintptr_t)row->src, row->nbytes);
    return 0;
  }
  PJRT_Error *error;
  if (from != NULL) {
    if (from->buffer == NULL) {
      fail(l, PJRT_Error_Code_FAILED_PRECONDITION, "a device buffer has no view to read");
      return 1;
    }
    PJRT_Buffer_CopyRawToHost_Args a = {0};
    a.struct_size = PJRT_Buffer_CopyRawToHost_Args_STRUCT_SIZE;
    a.buffer = from->buffer;
    a.dst = (void *)(uintptr_t)row->dst;
    a.offset = (int64_t)(row->src - from->base);
    a.transfer_size = (int64_t)row->nbytes;
    error = api->PJRT_Buffer_CopyRawToHost(&a);
    p->event = a.event;
  } else {
    if (to->raw == NULL || raw_ext == NULL) {
      fail(l, PJRT_Error_Code_FAILED_PRECONDITION, "a device buffer has no raw alias to write");
      return 1;
    }
    PJRT_RawBuffer_CopyRawHostToDevice_Args a = {0};
    a.struct_size = PJRT_RawBuffer_CopyRawHostToDevice_Args_STRUCT_SIZE;
    a.buffer = to->raw;
    a.src = (const void *)(uintptr_t)row->src;
    a.offset = (int64_t)(row->dst - to->base);
    a.transfer_size = (int64_t)row->nbytes;
    error = raw_ext->PJRT_RawBuffer_CopyRawHostToDevice(&a);
    p->event = a.event;
  }
  if (error != NULL) {
    fail_with_error(l, error);
    return 1;
  }
  if (p->event == NULL) {
    fail(l, PJRT_Error_Code_INTERNAL, "the plugin returned neither an event nor an error");
    return 1;
  }
  ++*issued;
  pthread_mutex_lock(&l->mu);
  ++l->remaining;
  pthread_mutex_unlock(&l->mu);
  p->latch = l;
  watch(l, p);
  return 0;
}

int tps_pjrt_copy(const PJRT_Api *api, const PJRT_RawBuffer_Extension *raw_ext,
                  const tps_pjrt_target *targets, size_t n_targets, const tps_segment *rows,
                  size_t n_rows, char *message, size_t message_size, size_t *issued) {
  latch l;
  size_t count = 0;
  memset(&l, 0, sizeof l);
  l.api = api;
  l.message = message;
  l.message_size = message_size;
  if (message_size) message[0] = '\0';
  pthread_mutex_init(&l.mu, NULL);
  pthread_cond_init(&l.cv, NULL);
  l.remaining = 1; /* held by this call until every copy is issued */
  pending *slots = n_rows ? calloc(n_rows, sizeof *slots) : NULL;
  if (n_rows && slots == NULL) {
    fail(&l, PJRT_Error_Code_RESOURCE_EXHAUSTED, "out of memory for copy events");
  } else {
    for (size_t i = 0; i < n_rows; ++i) {
      if (issue(&l, raw_ext, targets, n_targets, &rows[i], &slots[i], &count)) break;
    }
  }
  pthread_mutex_lock(&l.mu);
  --l.remaining;
  while (l.remaining != 0) pthread_cond_wait(&l.cv, &l.mu);
  int code = l.code;
  pthread_mutex_unlock(&l.mu);
  pthread_cond_destroy(&l.cv);
  pthread_mutex_destroy(&l.mu);
  free(slots);
  if (issued != NULL) *issued = count;
  return code;
}
