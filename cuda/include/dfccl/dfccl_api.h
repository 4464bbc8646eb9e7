/*
 * dfccl's host hot path for C and C++ callers: submit a bound collective,
 * test it, wait for it (on the host or on a stream) and release it, with no
 * Python object and, in the common case, without the GIL.
 *
 * The table is handed out by the Python extension dfccl._native.capi:
 *
 *     import dfccl._native.capi as capi
 *     capsule = capi.api_capsule()        # PyCapsule named DFCCL_API_CAPSULE
 *     plan = comm.prepare_all_reduce(n, "float32").bind(x)
 *     address = plan.c_plan               # a const dfccl_plan *, as an int
 *
 * and read in C with PyCapsule_Import(DFCCL_API_CAPSULE, 0) or
 * PyCapsule_GetPointer(capsule, DFCCL_API_CAPSULE).  Check api->size and
 * api->version before use: a table only grows (new entries at its end, the
 * version raised), so a caller built against version v may use a table of
 * any version >= v whose size covers the entries it calls.
 *
 * Lifetime: a plan is valid while the Python object that handed it out
 * (BoundPlan) is alive, or between plan_retain and plan_release.  A handle
 * holds its completion slot until it is released, whatever the plan does
 * meanwhile; release every handle (after it completed, or before: the slot
 * then frees itself when the collective completes).
 *
 * CUDA graphs: a submission on a stream that captures a graph is captured,
 * not run: every replay of the graph runs it as the next instance of a tag
 * of its own (docs/architecture.md, "CUDA graphs").  Its handle (generation
 * DFCCL_GRAPH_GEN_BIT, abi.h) has no completion on the host: stream_wait on
 * a stream of the same capture makes the graph wait for each replay; test
 * and wait return DFCCL_API_E_INVALID; release it at once (the graph holds
 * what the collective needs until it is destroyed).
 *
 * Threading: every entry may be called from any thread, with or without
 * the GIL; none blocks while holding it (a caller that holds it gives it up
 * while it waits).  Submissions to one device are serialized.  See
 * docs/architecture.md, "The C API".
 */
#ifndef DFCCL_API_H
#define DFCCL_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DFCCL_API_VERSION 1u
#define DFCCL_API_CAPSULE "dfccl._native.capi.api"

/* What the entries return.  test and wait report the collective; the
 * negative codes are errors of the call itself (last_error says more). */
enum dfccl_api_code {
  DFCCL_API_OK = 0,            /* submitted; or completed successfully */
  DFCCL_API_PENDING = 1,       /* not complete yet (wait: the timeout passed) */
  DFCCL_API_FAILED = 2,        /* completed with a failure: *status says which (dfccl_status, abi.h) */
  DFCCL_API_E_INVALID = -1,    /* a bad argument: NULL, a released or foreign handle, a bad plan */
  DFCCL_API_E_RESOURCE = -2,   /* out of completion slots, tag records or staging (Python: ResourceError) */
  DFCCL_API_E_CLOSED = -3,     /* the communicator or its device's context is closed or aborted */
  DFCCL_API_E_BACKEND = -4,    /* the device failed under the daemon, or a launch or stream call failed */
  DFCCL_API_E_PYTHON = -5      /* any other error raised by a path that runs Python */
};

/* A collective bound to its buffers (and stream): Plan.bind(...).c_plan. */
typedef struct dfccl_plan dfccl_plan;

/* One submitted collective: its device's context, completion slot and the
 * slot's generation.  Plain data; copy it freely, release it once. */
typedef struct dfccl_handle {
  void *context;
  uint32_t slot;
  uint32_t gen;
} dfccl_handle;

/* Where one submission reads and writes, instead of where the plan was bound
 * (the buffers must have the plan's shape, memory kind and device, and must
 * stay valid until the collective completes). */
typedef struct dfccl_submit_at {
  uint64_t send_addr;
  uint64_t recv_addr;
  uint64_t stream;             /* a CUstream (or a simulated stream's handle) */
  uint32_t has_stream;         /* 0: armed at once; 1: armed when `stream` reaches it */
  uint32_t reserved;
} dfccl_submit_at;

typedef struct dfccl_api {
  size_t size;                 /* sizeof(dfccl_api) of the library that filled it */
  uint32_t version;            /* DFCCL_API_VERSION of that library */
  uint32_t reserved;

  /* Submits one instance of `plan`, at `at`'s buffers and stream (NULL: as
   * bound); *out names it.  Nothing waits for peers.  On an error *out is
   * zeroed, unless the collective was published before the error (the
   * daemon's launch failed): then release it as any other. */
  int (*submit)(const dfccl_plan *plan, const dfccl_submit_at *at, dfccl_handle *out);
  /* OK, PENDING or FAILED (then *status and *detail: the dfccl_result's
   * status and the rank it names, -1 for none); either pointer may be NULL. */
  int (*test)(const dfccl_handle *h, uint32_t *status, int32_t *detail);
  /* test() after waiting up to timeout_ns (< 0: no limit) on the host. */
  int (*wait)(const dfccl_handle *h, int64_t timeout_ns, uint32_t *status, int32_t *detail);
  /* Makes `stream` wait for the collective (cuStreamWaitValue32); the host does not block. */
  int (*stream_wait)(const dfccl_handle *h, uint64_t stream);
  /* Gives the handle up (and zeroes it); releasing a zeroed handle does nothing. */
  int (*release)(dfccl_handle *h);
  /* A static description of a dfccl_api_code. */
  const char *(*error_string)(int code);
  /* The message of the last failing call on this thread ("" if none). */
  const char *(*last_error)(void);
  /* Keep a plan valid past its Python owner, and let it go (both take the GIL). */
  int (*plan_retain)(const dfccl_plan *plan);
  int (*plan_release)(const dfccl_plan *plan);
} dfccl_api;

#ifdef __cplusplus
}
#endif

#endif /* DFCCL_API_H */
