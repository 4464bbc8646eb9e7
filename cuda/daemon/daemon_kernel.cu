// GPU entry point of the daemon: one persistent kernel per context, one block
// per channel.  Warp 0 runs the scheduler (schedule.cuh, shared with the
// simulator); the other warps move data when it asks them to (move.cuh).
// With args.link_block, one more block (index nblocks) reads the host link.
#include "schedule.cuh"

extern "C" __global__ void __launch_bounds__(512, 1) dfccl_daemon(dfccl_daemon_args args) {
  __shared__ dfccl::BlockShared sm;
  // The scheduler reads its arguments through a pointer.  The parameter's
  // address would make a copy in local memory, which every acquire (it
  // invalidates L1) may send back to L2; shared memory stays on chip.
  __shared__ dfccl_daemon_args shared_args;
  if (blockIdx.x == args.nblocks) {
    // The link block (args.link_block): its control warp reads the host
    // link; it moves no data, so its other warps leave at once.
    if (threadIdx.x >= dfccl::kControlThreads) return;
    if (threadIdx.x == 0) shared_args = args;
    __syncwarp();
    dfccl::link_block(&shared_args, &sm);
  } else if (threadIdx.x < dfccl::kControlThreads) {
    if (threadIdx.x == 0) shared_args = args;
    __syncwarp();
    dfccl::daemon_block(&shared_args, &sm, blockIdx.x);
  } else {
    dfccl::mover_loop(&sm);
  }
}

// A CUDA graph's arm node (graph.cuh): one thread pushes one replay of a
// captured collective.  Captured on the application's stream with the
// descriptor bound at capture, so every replay runs it.
extern "C" __global__ void __launch_bounds__(32, 1) dfccl_graph_arm_node(dfccl_daemon_args args, dfccl_graph_arm arm) {
  if (threadIdx.x == 0) dfccl::graph_arm(&args, &arm);
}
