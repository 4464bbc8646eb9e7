/* The simulator's "GPU": runs the daemon's blocks (cuda/daemon/schedule.cuh,
 * compiled with the host compiler) as host threads.  Launches are queued in
 * order on one stream, like kernels on the daemon's CUDA stream. */
#ifndef DFCCL_SIM_DEVICE_H
#define DFCCL_SIM_DEVICE_H

#include "dfccl/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dfccl_sim_device dfccl_sim_device;

dfccl_sim_device *dfccl_sim_device_create(void);
/* Queues one launch of args->nblocks blocks; *args is copied. */
int dfccl_sim_device_launch(dfccl_sim_device *dev, const dfccl_daemon_args *args);
/* Blocks until the launches queued before the call have finished, like
 * cuCtxSynchronize. */
void dfccl_sim_device_synchronize(dfccl_sim_device *dev);
/* Nonzero while a launch is queued or running. */
int dfccl_sim_device_busy(dfccl_sim_device *dev);
/* Waits for the queue to drain, then frees the device. */
void dfccl_sim_device_destroy(dfccl_sim_device *dev);

/* A CUDA graph's arm node (cuda/daemon/graph.cuh) as a stream operation
 * (dfccl_sim_stream_call): what the dfccl_graph_arm_node kernel runs on a GPU,
 * with the same parameters. */
typedef struct dfccl_sim_graph_arm_params {
  dfccl_daemon_args args;
  dfccl_graph_arm arm;
} dfccl_sim_graph_arm_params;
void dfccl_sim_graph_arm(const void *params);

#ifdef __cplusplus
}
#endif

#endif
