/* A STAND-IN PJRT plugin for tests on machines without a GPU or TPU.
 *
 * It serves the few PJRT C API calls tpusync's native plugin path makes, over CPU memory: a
 * "device buffer" is any host address (tests pass the memory of JAX CPU arrays), views and raw
 * aliases are bookkeeping, and every copy runs on a worker thread of the plugin's own, so events
 * complete and callbacks run on a thread other than the caller's, as on real hardware. It is
 * built from tpusync's own declarations (include/tpusync/pjrt_min.h), so it proves the calling
 * logic (event lifetimes, callbacks, errors, bounds, DMA registration), not the ABI: that is
 * what tests/native/test_pjrt_plugins.py (real plugin tables) and benchmarks/gpu_transfer.py (a real
 * GPU) are for.
 *
 * Test hooks (plain C functions, reached with ctypes): counters of live objects, and injected
 * failures (a copy refused at issue, a copy whose event completes with an error, a delay).
 *
 * Build: gcc -O2 -shared -fPIC -pthread -I include -o stand_in.so tests/helpers/pjrt_stand_in.c
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tpusync/pjrt_min.h"

struct PJRT_Error {
  PJRT_Error_Code code;
  char message[200];
};
struct PJRT_Client {
  int unused;
};
struct PJRT_Device {
  int id;
};
struct PJRT_Buffer {
  char *base;
  int64_t size;
  int device_id;
};
struct PJRT_RawBuffer {
  PJRT_Buffer *view;
};

struct PJRT_Event {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  int refs; /* the caller's handle and the worker's job */
  PJRT_Error *error; /* held until handed to a callback or copied by Await */
  PJRT_Event_OnReadyCallback callback;
  void *user_arg;
};

/* ---- counters and injected failures ---------------------------------------------------- */

static atomic_long live_events, live_views, live_raw, copies_done, copies_to_dma;
static atomic_long callbacks_on_worker, callbacks_inline, dma_maps_live, dma_map_calls;
static atomic_long refuse_countdown, fail_countdown, delay_us, corrupt_mask;

long stand_in_counter(const char *name) {
  if (!strcmp(name, "live_events")) return live_events;
  if (!strcmp(name, "live_views")) return live_views;
  if (!strcmp(name, "live_raw")) return live_raw;
  if (!strcmp(name, "copies")) return copies_done;
  if (!strcmp(name, "copies_to_dma")) return copies_to_dma;
  if (!strcmp(name, "callbacks_on_worker")) return callbacks_on_worker;
  if (!strcmp(name, "callbacks_inline")) return callbacks_inline;
  if (!strcmp(name, "dma_maps_live")) return dma_maps_live;
  if (!strcmp(name, "dma_map_calls")) return dma_map_calls;
  return -1;
}

/* The n-th next copy (1 = the next) is refused when issued; 0 turns it off. */
void stand_in_refuse_copy(long n) { refuse_countdown = n; }
/* The n-th next copy completes with a DATA_LOSS error (its bytes are not copied). */
void stand_in_fail_copy(long n) { fail_countdown = n; }
/* Every copy waits this long on the worker first (keeps events pending). */
void stand_in_delay_us(long us) { delay_us = us; }
/* Flips the first byte of every read (mask 1) and/or raw write (mask 2): a plugin that lies. */
void stand_in_corrupt(long mask) { corrupt_mask = mask; }

static int countdown_hits(atomic_long *counter) {
  long now = atomic_load(counter);
  while (now > 0) {
    if (atomic_compare_exchange_weak(counter, &now, now - 1)) return now == 1;
  }
  return 0;
}

static PJRT_Error *make_error(PJRT_Error_Code code, const char *text) {
  PJRT_Error *e = calloc(1, sizeof *e);
  e->code = code;
  snprintf(e->message, sizeof e->message, "stand-in: %s", text);
  return e;
}

/* ---- DMA registrations ------------------------------------------------------------------ */

#define MAX_DMA 256
static pthread_mutex_t dma_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { char *start; size_t size; } dma[MAX_DMA];

static int in_dma(const char *p, size_t n) {
  int found = 0;
  pthread_mutex_lock(&dma_mu);
  for (int i = 0; i < MAX_DMA && !found; ++i)
    found = dma[i].start && p >= dma[i].start && p + n <= dma[i].start + dma[i].size;
  pthread_mutex_unlock(&dma_mu);
  return found;
}

/* ---- the copy worker -------------------------------------------------------------------- */

typedef struct job {
  void *dst;
  const void *src;
  size_t n;
  int fail;
  int corrupt;
  PJRT_Event *event;
  struct job *next;
} job;

static pthread_mutex_t queue_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queue_cv = PTHREAD_COND_INITIALIZER;
static job *queue_head, *queue_tail;
static pthread_once_t worker_once = PTHREAD_ONCE_INIT;
static __thread int on_worker;

static void release_event(PJRT_Event *ev) {
  pthread_mutex_lock(&ev->mu);
  int left = --ev->refs;
  pthread_mutex_unlock(&ev->mu);
  if (left) return;
  if (ev->error) free(ev->error);
  pthread_mutex_destroy(&ev->mu);
  pthread_cond_destroy(&ev->cv);
  free(ev);
  atomic_fetch_sub(&live_events, 1);
}

static void complete(PJRT_Event *ev, PJRT_Error *error) {
  pthread_mutex_lock(&ev->mu);
  ev->done = 1;
  ev->error = error;
  PJRT_Event_OnReadyCallback cb = ev->callback;
  void *arg = ev->user_arg;
  if (cb) ev->error = NULL; /* handed to the callback */
  pthread_cond_broadcast(&ev->cv);
  pthread_mutex_unlock(&ev->mu);
  /* The worker's reference goes first: the caller's handle keeps the event alive until the
   * callback destroys it, so once the callback returns nothing of the event is left. */
  release_event(ev);
  if (cb) {
    atomic_fetch_add(&callbacks_on_worker, 1);
    cb(error, arg);
  }
}

static void *worker(void *unused) {
  (void)unused;
  on_worker = 1;
  for (;;) {
    pthread_mutex_lock(&queue_mu);
    while (!queue_head) pthread_cond_wait(&queue_cv, &queue_mu);
    job *j = queue_head;
    queue_head = j->next;
    if (!queue_head) queue_tail = NULL;
    pthread_mutex_unlock(&queue_mu);
    long us = delay_us;
    if (us > 0) {
      struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
      nanosleep(&ts, NULL);
    }
    PJRT_Error *error = NULL;
    if (j->fail) {
      error = make_error(PJRT_Error_Code_DATA_LOSS, "injected copy failure");
    } else {
      memcpy(j->dst, j->src, j->n);
      if (j->corrupt && j->n) ((unsigned char *)j->dst)[0] ^= 0x5A;
      atomic_fetch_add(&copies_done, 1);
    }
    complete(j->event, error);
    free(j);
  }
  return NULL;
}

static void start_worker(void) {
  pthread_t t;
  pthread_create(&t, NULL, worker, NULL);
  pthread_detach(t);
}

static PJRT_Event *enqueue(void *dst, const void *src, size_t n, int corrupt) {
  pthread_once(&worker_once, start_worker);
  PJRT_Event *ev = calloc(1, sizeof *ev);
  pthread_mutex_init(&ev->mu, NULL);
  pthread_cond_init(&ev->cv, NULL);
  ev->refs = 2;
  atomic_fetch_add(&live_events, 1);
  job *j = calloc(1, sizeof *j);
  j->dst = dst;
  j->src = src;
  j->n = n;
  j->fail = countdown_hits(&fail_countdown);
  j->corrupt = corrupt;
  j->event = ev;
  pthread_mutex_lock(&queue_mu);
  if (queue_tail) queue_tail->next = j; else queue_head = j;
  queue_tail = j;
  pthread_cond_signal(&queue_cv);
  pthread_mutex_unlock(&queue_mu);
  return ev;
}

/* ---- the API functions ------------------------------------------------------------------ */

static void error_destroy(PJRT_Error_Destroy_Args *a) { free(a->error); }

static void error_message(PJRT_Error_Message_Args *a) {
  a->message = a->error->message;
  a->message_size = strlen(a->error->message);
}

static PJRT_Error *error_get_code(PJRT_Error_GetCode_Args *a) {
  a->code = a->error->code;
  return NULL;
}

static PJRT_Error *plugin_initialize(PJRT_Plugin_Initialize_Args *a) {
  (void)a;
  return NULL;
}

static PJRT_Error *plugin_attributes(PJRT_Plugin_Attributes_Args *a) {
  a->attributes = NULL;
  a->num_attributes = 0;
  return NULL;
}

static PJRT_Error *event_destroy(PJRT_Event_Destroy_Args *a) {
  release_event(a->event);
  return NULL;
}

static PJRT_Error *event_await(PJRT_Event_Await_Args *a) {
  PJRT_Event *ev = a->event;
  pthread_mutex_lock(&ev->mu);
  while (!ev->done) pthread_cond_wait(&ev->cv, &ev->mu);
  PJRT_Error *copy = NULL;
  if (ev->error) {
    copy = malloc(sizeof *copy);
    *copy = *ev->error;
  }
  pthread_mutex_unlock(&ev->mu);
  return copy;
}

static PJRT_Error *event_on_ready(PJRT_Event_OnReady_Args *a) {
  PJRT_Event *ev = a->event;
  pthread_mutex_lock(&ev->mu);
  if (ev->callback) {
    pthread_mutex_unlock(&ev->mu);
    return make_error(PJRT_Error_Code_FAILED_PRECONDITION, "OnReady called twice");
  }
  if (!ev->done) {
    ev->callback = a->callback;
    ev->user_arg = a->user_arg;
    pthread_mutex_unlock(&ev->mu);
    return NULL;
  }
  PJRT_Error *error = ev->error;
  ev->error = NULL;
  ev->callback = a->callback;
  pthread_mutex_unlock(&ev->mu);
  atomic_fetch_add(on_worker ? &callbacks_on_worker : &callbacks_inline, 1);
  a->callback(error, a->user_arg); /* ready already: at once, on the caller's thread */
  return NULL;
}

static PJRT_Client the_client;
#define MAX_DEVICES 64
static PJRT_Device devices[MAX_DEVICES];

static PJRT_Error *client_create(PJRT_Client_Create_Args *a) {
  for (int i = 0; i < MAX_DEVICES; ++i) devices[i].id = i;
  a->client = &the_client;
  return NULL;
}

static PJRT_Error *client_destroy(PJRT_Client_Destroy_Args *a) {
  (void)a;
  return NULL;
}

static PJRT_Error *client_platform_name(PJRT_Client_PlatformName_Args *a) {
  if (a->client != &the_client) return make_error(PJRT_Error_Code_INVALID_ARGUMENT, "client");
  a->platform_name = "stand-in";
  a->platform_name_size = 8;
  return NULL;
}

static PJRT_Error *client_platform_version(PJRT_Client_PlatformVersion_Args *a) {
  a->platform_version = "0";
  a->platform_version_size = 1;
  return NULL;
}

static PJRT_Error *client_lookup_device(PJRT_Client_LookupDevice_Args *a) {
  if (a->client != &the_client) return make_error(PJRT_Error_Code_INVALID_ARGUMENT, "client");
  if (a->id < 0 || a->id >= MAX_DEVICES) return make_error(PJRT_Error_Code_NOT_FOUND, "no such id");
  devices[a->id].id = a->id;
  a->device = &devices[a->id];
  return NULL;
}

static PJRT_Error *create_view(PJRT_Client_CreateViewOfDeviceBuffer_Args *a) {
  if (a->struct_size < PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE - 8)
    return make_error(PJRT_Error_Code_INVALID_ARGUMENT, "args struct_size too small");
  if (a->client != &the_client || a->device == NULL || a->device_buffer_ptr == NULL)
    return make_error(PJRT_Error_Code_INVALID_ARGUMENT, "client, device or pointer missing");
  if (a->num_dims != 1 || a->element_type != PJRT_Buffer_Type_U8 || a->dims[0] <= 0)
    return make_error(PJRT_Error_Code_UNIMPLEMENTED, "views are flat uint8 here");
  PJRT_Buffer *b = calloc(1, sizeof *b);
  b->base = a->device_buffer_ptr;
  b->size = a->dims[0];
  b->device_id = a->device->id;
  a->buffer = b;
  atomic_fetch_add(&live_views, 1);
  return NULL;
}

static PJRT_Error *buffer_destroy(PJRT_Buffer_Destroy_Args *a) {
  free(a->buffer);
  atomic_fetch_sub(&live_views, 1);
  return NULL;
}

static int out_of_range(int64_t offset, int64_t n, int64_t size) {
  return offset < 0 || n < 0 || offset > size || n > size - offset;
}

static PJRT_Error *copy_raw_to_host(PJRT_Buffer_CopyRawToHost_Args *a) {
  if (out_of_range(a->offset, a->transfer_size, a->buffer->size))
    return make_error(PJRT_Error_Code_INVALID_ARGUMENT, "read outside the buffer");
  if (countdown_hits(&refuse_countdown))
    return make_error(PJRT_Error_Code_RESOURCE_EXHAUSTED, "injected refusal");
  if (in_dma(a->dst, (size_t)a->transfer_size)) atomic_fetch_add(&copies_to_dma, 1);
  a->event = enqueue(a->dst, a->buffer->base + a->offset, (size_t)a->transfer_size,
                     (int)(corrupt_mask & 1));
  return NULL;
}

static PJRT_Error *dma_map(PJRT_Client_DmaMap_Args *a) {
  atomic_fetch_add(&dma_map_calls, 1);
  pthread_mutex_lock(&dma_mu);
  for (int i = 0; i < MAX_DMA; ++i) {
    if (dma[i].start == a->data) {
      pthread_mutex_unlock(&dma_mu);
      return make_error(PJRT_Error_Code_ALREADY_EXISTS, "mapped twice");
    }
  }
  for (int i = 0; i < MAX_DMA; ++i) {
    if (!dma[i].start) {
      dma[i].start = a->data;
      dma[i].size = a->size;
      atomic_fetch_add(&dma_maps_live, 1);
      pthread_mutex_unlock(&dma_mu);
      return NULL;
    }
  }
  pthread_mutex_unlock(&dma_mu);
  return make_error(PJRT_Error_Code_RESOURCE_EXHAUSTED, "too many DMA mappings");
}

static PJRT_Error *dma_unmap(PJRT_Client_DmaUnmap_Args *a) {
  pthread_mutex_lock(&dma_mu);
  for (int i = 0; i < MAX_DMA; ++i) {
    if (dma[i].start == a->data) {
      dma[i].start = NULL;
      atomic_fetch_sub(&dma_maps_live, 1);
      pthread_mutex_unlock(&dma_mu);
      return NULL;
    }
  }
  pthread_mutex_unlock(&dma_mu);
  return make_error(PJRT_Error_Code_NOT_FOUND, "unmap of memory never mapped");
}

/* The raw-buffer extension, laid out as upstream's version with seven functions. */
static PJRT_Error *raw_alias(PJRT_RawBuffer_CreateRawAliasOfBuffer_Args *a) {
  PJRT_RawBuffer *r = calloc(1, sizeof *r);
  r->view = a->buffer;
  a->raw_buffer = r;
  atomic_fetch_add(&live_raw, 1);
  return NULL;
}

static PJRT_Error *raw_destroy(PJRT_RawBuffer_Destroy_Args *a) {
  free(a->buffer);
  atomic_fetch_sub(&live_raw, 1);
  return NULL;
}

static PJRT_Error *raw_host_to_device(PJRT_RawBuffer_CopyRawHostToDevice_Args *a) {
  PJRT_Buffer *view = a->buffer->view;
  if (out_of_range(a->offset, a->transfer_size, view->size))
    return make_error(PJRT_Error_Code_INVALID_ARGUMENT, "write outside the buffer");
  if (countdown_hits(&refuse_countdown))
    return make_error(PJRT_Error_Code_RESOURCE_EXHAUSTED, "injected refusal");
  if (in_dma(a->src, (size_t)a->transfer_size)) atomic_fetch_add(&copies_to_dma, 1);
  a->event = enqueue(view->base + a->offset, a->src, (size_t)a->transfer_size,
                     (int)(corrupt_mask & 2));
  return NULL;
}

static struct {
  PJRT_RawBuffer_Extension used;
  void *copy_device_to_host, *get_host_pointer;
} raw_extension;

static PJRT_Api api;
static pthread_once_t api_once = PTHREAD_ONCE_INIT;
static void build_api(void);

/* Whether the table offers the raw-buffer extension (in-place writes); on by default. */
void stand_in_set_writes(int on) {
  pthread_once(&api_once, build_api);
  api.extension_start = on ? &raw_extension.used.base : NULL;
}

static void build_api(void) {
  raw_extension.used.base.struct_size = sizeof raw_extension;
  raw_extension.used.base.type = TPS_PJRT_EXTENSION_TYPE_RAW_BUFFER;
  raw_extension.used.PJRT_RawBuffer_CreateRawAliasOfBuffer = raw_alias;
  raw_extension.used.PJRT_RawBuffer_Destroy = raw_destroy;
  raw_extension.used.PJRT_RawBuffer_CopyRawHostToDevice = raw_host_to_device;
  api.struct_size = sizeof api;
  api.extension_start = &raw_extension.used.base;
  api.pjrt_api_version.struct_size = PJRT_Api_Version_STRUCT_SIZE;
  api.pjrt_api_version.major_version = 0;
  api.pjrt_api_version.minor_version = 117;
  api.PJRT_Error_Destroy = error_destroy;
  api.PJRT_Error_Message = error_message;
  api.PJRT_Error_GetCode = error_get_code;
  api.PJRT_Plugin_Initialize = plugin_initialize;
  api.PJRT_Plugin_Attributes = plugin_attributes;
  api.PJRT_Event_Destroy = event_destroy;
  api.PJRT_Event_Await = event_await;
  api.PJRT_Event_OnReady = event_on_ready;
  api.PJRT_Client_Create = client_create;
  api.PJRT_Client_Destroy = client_destroy;
  api.PJRT_Client_PlatformName = client_platform_name;
  api.PJRT_Client_PlatformVersion = client_platform_version;
  api.PJRT_Client_LookupDevice = client_lookup_device;
  api.PJRT_Buffer_Destroy = buffer_destroy;
  api.PJRT_Client_CreateViewOfDeviceBuffer = create_view;
  api.PJRT_Buffer_CopyRawToHost = copy_raw_to_host;
  api.PJRT_Client_DmaMap = dma_map;
  api.PJRT_Client_DmaUnmap = dma_unmap;
}

const PJRT_Api *GetPjrtApi(void) {
  pthread_once(&api_once, build_api);
  return &api;
}
