/* The simulator's streams: a host thread per stream running its operations
 * in order, like a CUDA stream's hardware queue.  Only what dfccl issues on
 * application streams (cuStreamWriteValue32, cuStreamWaitValue32 GEQ) and a
 * delay (a kernel that runs for a while) are modelled; "device memory" is
 * host memory, so the addresses are host pointers. */
#ifndef DFCCL_SIM_STREAM_H
#define DFCCL_SIM_STREAM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dfccl_sim_stream dfccl_sim_stream;

dfccl_sim_stream *dfccl_sim_stream_create(void);
/* *addr = value, once every earlier operation has finished (release store). */
void dfccl_sim_stream_write32(dfccl_sim_stream *s, uint64_t addr, uint32_t value);
/* Later operations wait until (int32_t)(*addr - value) >= 0 (cuStreamWaitValue32 GEQ). */
void dfccl_sim_stream_wait32(dfccl_sim_stream *s, uint64_t addr, uint32_t value);
/* Later operations wait `ns` nanoseconds after the earlier ones finished. */
void dfccl_sim_stream_delay(dfccl_sim_stream *s, uint64_t ns);
/* Operations queued and not finished yet. */
uint64_t dfccl_sim_stream_pending(dfccl_sim_stream *s);
/* Waits until the operations queued before the call have finished, or for
 * `timeout_ns` (0: no limit); nonzero if they have. */
int dfccl_sim_stream_synchronize(dfccl_sim_stream *s, uint64_t timeout_ns);
/* Drops what has not run (a wait that never ends included), then frees it. */
void dfccl_sim_stream_destroy(dfccl_sim_stream *s);

#ifdef __cplusplus
}
#endif

#endif
