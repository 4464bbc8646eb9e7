/* The simulator's streams: a host thread per stream running its operations
 * in order, like a CUDA stream's hardware queue.  Only what dfccl issues on
 * application streams (cuStreamWriteValue32, cuStreamWaitValue32 GEQ and
 * AND, a small kernel: a call) and a delay (a kernel that runs for a while)
 * are modelled; "device memory" is host memory, so the addresses are host
 * pointers.  A stream can capture what is issued on it into a graph
 * (cuStreamBeginCapture / EndCapture), which runs it again at each launch
 * (cuGraphLaunch). */
#ifndef DFCCL_SIM_STREAM_H
#define DFCCL_SIM_STREAM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dfccl_sim_stream dfccl_sim_stream;
typedef struct dfccl_sim_graph dfccl_sim_graph;

dfccl_sim_stream *dfccl_sim_stream_create(void);
/* *addr = value, once every earlier operation has finished (release store). */
void dfccl_sim_stream_write32(dfccl_sim_stream *s, uint64_t addr, uint32_t value);
/* Later operations wait until (int32_t)(*addr - value) >= 0 (cuStreamWaitValue32 GEQ). */
void dfccl_sim_stream_wait32(dfccl_sim_stream *s, uint64_t addr, uint32_t value);
/* Later operations wait until (*addr & mask) != 0 (cuStreamWaitValue32 AND). */
void dfccl_sim_stream_wait_mask32(dfccl_sim_stream *s, uint64_t addr, uint32_t mask);
/* fn(params) once every earlier operation has finished (a kernel); the
 * `bytes` of params are copied. */
void dfccl_sim_stream_call(dfccl_sim_stream *s, void (*fn)(const void *), const void *params, uint64_t bytes);
/* Later operations wait `ns` nanoseconds after the earlier ones finished. */
void dfccl_sim_stream_delay(dfccl_sim_stream *s, uint64_t ns);
/* Operations queued and not finished yet. */
uint64_t dfccl_sim_stream_pending(dfccl_sim_stream *s);
/* Waits until the operations queued before the call have finished, or for
 * `timeout_ns` (0: no limit); nonzero if they have. */
int dfccl_sim_stream_synchronize(dfccl_sim_stream *s, uint64_t timeout_ns);
/* Drops what has not run (a wait that never ends included), then frees it. */
void dfccl_sim_stream_destroy(dfccl_sim_stream *s);

/* Capture: from begin to end, operations issued on the stream are recorded
 * into a graph instead of run.  Begin on a capturing stream and end on one
 * that is not return 0 / NULL. */
int dfccl_sim_stream_begin_capture(dfccl_sim_stream *s);
dfccl_sim_graph *dfccl_sim_stream_end_capture(dfccl_sim_stream *s);
/* Nonzero while the stream captures. */
int dfccl_sim_stream_capturing(dfccl_sim_stream *s);
/* Queues the graph's operations on `s`, in their captured order; 0 if `s`
 * is capturing (a graph launched under capture is not modelled). */
int dfccl_sim_graph_launch(dfccl_sim_graph *g, dfccl_sim_stream *s);
/* Operations the graph holds. */
uint64_t dfccl_sim_graph_size(dfccl_sim_graph *g);
/* Frees the graph (launches already queued keep their copies). */
void dfccl_sim_graph_destroy(dfccl_sim_graph *g);

#ifdef __cplusplus
}
#endif

#endif
