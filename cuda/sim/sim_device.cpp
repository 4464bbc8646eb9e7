// The simulator's device: a stream thread that runs queued daemon launches,
// each as one host thread per block executing the same daemon_block() the GPU
// kernel runs.
#include "sim_device.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "../daemon/schedule.cuh"
#include "dfccl/host_signals.h"

struct dfccl_sim_device {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<dfccl_daemon_args> queue;
  uint64_t launched = 0;  // launches queued so far
  uint64_t finished = 0;  // launches run to their end
  bool running = false;
  bool stopping = false;
  std::thread stream;
};

static void run_launch(const dfccl_daemon_args &args) {
  std::vector<std::thread> blocks;
  blocks.reserve(args.nblocks + 1);
  for (uint32_t b = 0; b < args.nblocks; ++b) {
    blocks.emplace_back([&args, b]() {
      dfccl::BlockShared sm;
      dfccl::daemon_block(&args, &sm, b);
    });
  }
  if (args.link_block) {
    blocks.emplace_back([&args]() {
      dfccl::BlockShared sm;
      dfccl::link_block(&args, &sm);
    });
  }
  for (auto &t : blocks) t.join();
}

static void stream_main(dfccl_sim_device *dev) {
  dfccl_block_async_signals();  // and the block threads it starts (host_signals.h)
  std::unique_lock<std::mutex> lock(dev->mu);
  for (;;) {
    dev->cv.wait(lock, [dev] { return dev->stopping || !dev->queue.empty(); });
    if (dev->queue.empty()) return;  // stopping, and nothing left to run
    dfccl_daemon_args args = dev->queue.front();
    dev->running = true;
    lock.unlock();
    run_launch(args);
    lock.lock();
    dev->queue.pop_front();
    dev->finished += 1;
    dev->running = false;
    dev->cv.notify_all();
  }
}

extern "C" {

dfccl_sim_device *dfccl_sim_device_create(void) {
  dfccl_sim_device *dev = new dfccl_sim_device();
  dev->stream = std::thread(stream_main, dev);
  return dev;
}

int dfccl_sim_device_launch(dfccl_sim_device *dev, const dfccl_daemon_args *args) {
  if (args->nblocks == 0 || args->nblocks > DFCCL_MAX_CHANNELS) return -1;
  std::lock_guard<std::mutex> lock(dev->mu);
  if (dev->stopping) return -1;
  dev->queue.push_back(*args);
  dev->launched += 1;
  dev->cv.notify_all();
  return 0;
}

void dfccl_sim_device_synchronize(dfccl_sim_device *dev) {
  // Like cuCtxSynchronize: waits for the launches queued before the call.
  std::unique_lock<std::mutex> lock(dev->mu);
  const uint64_t target = dev->launched;
  dev->cv.wait(lock, [dev, target] { return dev->finished >= target; });
}

int dfccl_sim_device_busy(dfccl_sim_device *dev) {
  std::lock_guard<std::mutex> lock(dev->mu);
  return (!dev->queue.empty() || dev->running) ? 1 : 0;
}

void dfccl_sim_graph_arm(const void *params) {
  const dfccl_sim_graph_arm_params *p = static_cast<const dfccl_sim_graph_arm_params *>(params);
  dfccl::graph_arm(&p->args, &p->arm);
}

void dfccl_sim_device_destroy(dfccl_sim_device *dev) {
  {
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->stopping = true;
    dev->cv.notify_all();
  }
  dev->stream.join();
  delete dev;
}

}  // extern "C"
