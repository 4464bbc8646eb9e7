// GPU entry point of the daemon: one persistent kernel per context, one block
// per channel.  Warp 0 runs the scheduler (schedule.cuh, shared with the
// simulator); the other warps move data when it asks them to (move.cuh).
#include "schedule.cuh"

extern "C" __global__ void __launch_bounds__(512, 1) dfccl_daemon(dfccl_daemon_args args) {
  __shared__ dfccl::BlockShared sm;
  if (threadIdx.x < dfccl::kControlThreads) {
    dfccl::daemon_block(&args, &sm, blockIdx.x);
  } else {
    dfccl::mover_loop(&sm);
  }
}
