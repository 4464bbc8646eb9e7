/*
 * Submitting dfccl collectives from C, through the table of
 * <dfccl/dfccl_api.h>.  Built as a shared library; run.py (next to this
 * file) makes the communicator, binds one all-reduce plan per rank, and
 * hands this code the table and the plans:
 *
 *     cc -O2 -shared -fPIC -I"$(python -c 'import dfccl.capi as c; print(c.include_dir())')" \
 *        submit.c -o libdfccl_example.so
 *     python run.py
 *
 * Nothing here touches Python: the table's entries run without the GIL
 * unless a rare path needs it (a tag's first instance, out of slots, an
 * error).
 */
#define _POSIX_C_SOURCE 200809L

#include <dfccl/dfccl_api.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_RANKS 64
#define WAIT_NS 30000000000ll   /* 30 s: a collective that takes longer is reported */

static uint64_t clock_ns(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

/* The table must be one this code was built for (a newer one is fine). */
static int check_table(const dfccl_api *api, char *err, size_t errlen) {
  if (api == NULL || api->size < sizeof(dfccl_api) || api->version < DFCCL_API_VERSION) {
    snprintf(err, errlen, "dfccl C API table missing or too old (size %zu, version %u; built for %zu, %u)",
             api ? api->size : 0, api ? api->version : 0, sizeof(dfccl_api), DFCCL_API_VERSION);
    return -1;
  }
  return 0;
}

static int report(const dfccl_api *api, int rc, const char *what, char *err, size_t errlen) {
  if (errlen) snprintf(err, errlen, "%s: %s (%d): %s", what, api->error_string(rc), rc, api->last_error());
  return rc;
}

/* Waits for and releases handles[0..n), reporting the first failure in
 * `err` (nothing when errlen is 0). */
static int wait_all(const dfccl_api *api, dfccl_handle *handles, int n, char *err, size_t errlen) {
  int result = 0;
  for (int i = 0; i < n; i++) {
    uint32_t status = 0;
    int32_t detail = -1;
    int rc = api->wait(&handles[i], WAIT_NS, &status, &detail);
    if (rc != DFCCL_API_OK && result == 0) {
      if (rc == DFCCL_API_FAILED && errlen)
        snprintf(err, errlen, "collective %d failed with status %u (rank %d)", i, status, detail);
      else if (rc != DFCCL_API_FAILED)
        report(api, rc, "wait", err, errlen);
      result = rc == DFCCL_API_PENDING ? -100 : rc;
    }
    api->release(&handles[i]);   /* pending ones free their slots once they complete */
  }
  return result;
}

/* `iterations` rounds of one in-place all-reduce of `count` floats on every
 * rank (plans[r] is rank r's plan, bound to buffers[r]), each round waited
 * for and checked: rank r contributes (r + 1) * (round + 1) + i % 7 at
 * element i.  Returns 0, or a nonzero code with a message in `err`. */
int dfccl_example_all_reduce(const dfccl_api *api, const dfccl_plan *const *plans, float *const *buffers,
                             int nranks, size_t count, int iterations, char *err, size_t errlen) {
  dfccl_handle handles[MAX_RANKS];
  if (check_table(api, err, errlen) != 0) return -1;
  if (nranks < 1 || nranks > MAX_RANKS) {
    snprintf(err, errlen, "nranks %d outside 1..%d", nranks, MAX_RANKS);
    return -1;
  }
  for (int round = 0; round < iterations; round++) {
    for (int r = 0; r < nranks; r++)
      for (size_t i = 0; i < count; i++) buffers[r][i] = (float)((r + 1) * (round + 1) + (int)(i % 7));
    for (int r = 0; r < nranks; r++) {
      int rc = api->submit(plans[r], NULL, &handles[r]);
      if (rc != DFCCL_API_OK) {
        report(api, rc, "submit", err, errlen);
        wait_all(api, handles, r, err, 0);   /* what was submitted still completes */
        return rc;
      }
    }
    int rc = wait_all(api, handles, nranks, err, errlen);
    if (rc != 0) return rc;
    for (int r = 0; r < nranks; r++) {
      for (size_t i = 0; i < count; i++) {
        float want = (float)((round + 1) * nranks * (nranks + 1) / 2 + nranks * (int)(i % 7));
        if (buffers[r][i] != want) {
          snprintf(err, errlen, "round %d rank %d element %zu: %g, expected %g", round, r, i, buffers[r][i], want);
          return -2;
        }
      }
    }
  }
  return 0;
}

/* Host time of submissions alone: `n` rounds of one submission per plan,
 * back to back, then every collective waited for.  *submit_ns: the time
 * of the submission loop (*submit_cpu_ns: the CPU time this thread spent
 * in it); *wait_ns: of the waits after it. */
int dfccl_example_submit_loop(const dfccl_api *api, const dfccl_plan *const *plans, int nplans, int n,
                              uint64_t *submit_ns, uint64_t *submit_cpu_ns, uint64_t *wait_ns, char *err,
                              size_t errlen) {
  if (check_table(api, err, errlen) != 0) return -1;
  dfccl_handle *handles = calloc((size_t)n * (size_t)nplans, sizeof(dfccl_handle));
  if (handles == NULL) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  int submitted = 0, rc = 0;
  uint64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
  uint64_t t0 = now_ns();
  for (int i = 0; i < n && rc == 0; i++) {
    for (int p = 0; p < nplans; p++) {
      rc = api->submit(plans[p], NULL, &handles[submitted]);
      if (rc != DFCCL_API_OK) {
        report(api, rc, "submit", err, errlen);
        break;
      }
      submitted++;
    }
  }
  uint64_t t1 = now_ns();
  *submit_cpu_ns = clock_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
  int waited = wait_all(api, handles, submitted, err, rc == 0 ? errlen : 0);
  *submit_ns = t1 - t0;
  *wait_ns = now_ns() - t1;
  free(handles);
  return rc != 0 ? rc : waited;
}

/* Inside a CUDA graph capture: submits `plan`'s in-place all-reduce of
 * `buffer` on `stream`, which captures a graph, and makes that stream wait
 * for it, so that what the graph runs after it sees its result.  Nothing
 * runs now: every replay of the graph runs the collective once more, as
 * the next instance of a tag of its own.  The handle has no completion on
 * the host (test and wait refuse it); it is released at once, since the
 * graph holds what the collective needs until it is destroyed. */
int dfccl_example_capture(const dfccl_api *api, const dfccl_plan *plan, uint64_t buffer, uint64_t stream, char *err,
                          size_t errlen) {
  if (check_table(api, err, errlen) != 0) return -1;
  dfccl_submit_at at = {buffer, buffer, stream, 1, 0};
  dfccl_handle h;
  int rc = api->submit(plan, &at, &h);
  if (rc != DFCCL_API_OK) return report(api, rc, "submit (capturing)", err, errlen);
  rc = api->stream_wait(&h, stream);
  if (rc != DFCCL_API_OK) report(api, rc, "stream_wait (capturing)", err, errlen);
  int released = api->release(&h);
  if (rc == DFCCL_API_OK && released != DFCCL_API_OK) rc = report(api, released, "release", err, errlen);
  return rc;
}
