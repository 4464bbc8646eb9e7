/*
 * The dfccl C API's entries as plain functions, for the tests to call
 * through ctypes: the table's and the handle's layouts come from the
 * header, never from a copy in Python (handles are opaque bytes there).
 */
#define _POSIX_C_SOURCE 200809L

#include <dfccl/dfccl_api.h>

#include <stdint.h>
#include <time.h>

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The codes, in dfccl_api_code order: OK, PENDING, FAILED, E_INVALID,
 * E_RESOURCE, E_CLOSED, E_BACKEND, E_PYTHON. */
void t_codes(int *out) {
  const int codes[] = {DFCCL_API_OK, DFCCL_API_PENDING, DFCCL_API_FAILED, DFCCL_API_E_INVALID,
                       DFCCL_API_E_RESOURCE, DFCCL_API_E_CLOSED, DFCCL_API_E_BACKEND, DFCCL_API_E_PYTHON};
  for (int i = 0; i < 8; i++) out[i] = codes[i];
}

size_t t_handle_bytes(void) { return sizeof(dfccl_handle); }
size_t t_api_bytes(void) { return sizeof(dfccl_api); }
unsigned t_api_version(void) { return DFCCL_API_VERSION; }
size_t t_table_size(const dfccl_api *a) { return a->size; }
unsigned t_table_version(const dfccl_api *a) { return a->version; }
uint32_t t_handle_gen(const dfccl_handle *h) { return h->gen; }
int t_handle_zeroed(const dfccl_handle *h) { return h->context == NULL && h->slot == 0 && h->gen == 0; }

int t_submit(const dfccl_api *a, const dfccl_plan *p, dfccl_handle *h) { return a->submit(p, NULL, h); }

int t_submit_at(const dfccl_api *a, const dfccl_plan *p, uint64_t send, uint64_t recv, dfccl_handle *h) {
  dfccl_submit_at at = {send, recv, 0, 0, 0};
  return a->submit(p, &at, h);
}

/* t_submit_at, armed when `stream` reaches it. */
int t_submit_on(const dfccl_api *a, const dfccl_plan *p, uint64_t send, uint64_t recv, uint64_t stream,
                dfccl_handle *h) {
  dfccl_submit_at at = {send, recv, stream, 1, 0};
  return a->submit(p, &at, h);
}

int t_test(const dfccl_api *a, const dfccl_handle *h, uint32_t *status, int32_t *detail) {
  return a->test(h, status, detail);
}

int t_wait(const dfccl_api *a, const dfccl_handle *h, int64_t timeout_ns, uint32_t *status, int32_t *detail) {
  return a->wait(h, timeout_ns, status, detail);
}

int t_stream_wait(const dfccl_api *a, const dfccl_handle *h, uint64_t stream) { return a->stream_wait(h, stream); }
int t_release(const dfccl_api *a, dfccl_handle *h) { return a->release(h); }
const char *t_error_string(const dfccl_api *a, int code) { return a->error_string(code); }
const char *t_last_error(const dfccl_api *a) { return a->last_error(); }
int t_plan_retain(const dfccl_api *a, const dfccl_plan *p) { return a->plan_retain(p); }
int t_plan_release(const dfccl_api *a, const dfccl_plan *p) { return a->plan_release(p); }

/* Submits n rounds of one instance per plan once *go is set, into
 * handles[n * nplans], recording when the loop started and ended
 * (CLOCK_MONOTONIC ns).  Returns the first failing code, or 0. */
int t_submit_when(const dfccl_api *a, const dfccl_plan *const *plans, int nplans, int n, volatile int *go,
                  char *handles, uint64_t *started, uint64_t *ended) {
  while (!*go) {
  }
  *started = now_ns();
  for (int i = 0; i < n; i++) {
    for (int p = 0; p < nplans; p++) {
      int rc = a->submit(plans[p], NULL, (dfccl_handle *)(handles + (size_t)(i * nplans + p) * sizeof(dfccl_handle)));
      if (rc != DFCCL_API_OK) return rc;
    }
  }
  *ended = now_ns();
  return 0;
}

/* Called with the GIL held (ctypes.PyDLL): sets *go and spins for ns. */
void t_hold(volatile int *go, uint64_t ns, uint64_t *started, uint64_t *ended) {
  *started = now_ns();
  *go = 1;
  while (now_ns() - *started < ns) {
  }
  *ended = now_ns();
}
