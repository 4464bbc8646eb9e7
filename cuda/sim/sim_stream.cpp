// The simulator's streams (sim_stream.h): one thread per stream takes its
// operations in order; a wait polls host memory, as the GPU front end polls
// the word a cuStreamWaitValue32 names.
#include "sim_stream.h"

#include "dfccl/host_signals.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

enum class Op { kWrite32, kWait32, kWaitMask32, kCall, kDelay };

struct Operation {
  Op op;
  uint64_t addr;
  uint64_t value;  // the word (write, wait), the mask, or nanoseconds (delay)
  void (*fn)(const void *);                   // kCall
  std::shared_ptr<const std::string> params;  // kCall: its parameters (shared by a graph's launches)
};

std::atomic<uint32_t> *word(uint64_t addr) { return reinterpret_cast<std::atomic<uint32_t> *>(addr); }

}  // namespace

struct dfccl_sim_graph {
  std::vector<Operation> ops;
};

struct dfccl_sim_stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Operation> queue;
  dfccl_sim_graph *capture = nullptr;  // recording into it (begin_capture .. end_capture)
  uint64_t queued = 0;    // operations queued so far
  uint64_t finished = 0;  // operations run to their end
  bool stopping = false;
  std::thread thread;
};

static bool stopping(dfccl_sim_stream *s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->stopping;
}

// Runs one operation; false if the stream is being destroyed meanwhile.
static bool run(dfccl_sim_stream *s, const Operation &o) {
  switch (o.op) {
    case Op::kWrite32:
      word(o.addr)->store((uint32_t)o.value, std::memory_order_release);
      return true;
    case Op::kWait32:
    case Op::kWaitMask32:
      for (uint32_t polls = 0;; ++polls) {
        const uint32_t v = word(o.addr)->load(std::memory_order_acquire);
        if (o.op == Op::kWait32 ? (int32_t)(v - (uint32_t)o.value) >= 0 : (v & (uint32_t)o.value) != 0) return true;
        if ((polls & 63) == 63 && stopping(s)) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    case Op::kCall:
      std::atomic_thread_fence(std::memory_order_seq_cst);  // what the stream did before, as a kernel sees it
      o.fn(o.params->data());
      std::atomic_thread_fence(std::memory_order_seq_cst);
      return true;
    case Op::kDelay: {
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(o.value);
      std::unique_lock<std::mutex> lock(s->mu);
      return !s->cv.wait_until(lock, until, [s] { return s->stopping; });
    }
  }
  return true;
}

static void stream_main(dfccl_sim_stream *s) {
  dfccl_block_async_signals();
  std::unique_lock<std::mutex> lock(s->mu);
  for (;;) {
    s->cv.wait(lock, [s] { return s->stopping || !s->queue.empty(); });
    if (s->stopping) return;
    const Operation o = s->queue.front();
    lock.unlock();
    const bool done = run(s, o);
    lock.lock();
    if (!done) return;
    s->queue.pop_front();
    s->finished += 1;
    s->cv.notify_all();
  }
}

static void push(dfccl_sim_stream *s, const Operation &o) {
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->capture != nullptr) {
    s->capture->ops.push_back(o);
    return;
  }
  s->queue.push_back(o);
  s->queued += 1;
  s->cv.notify_all();
}

static void enqueue(dfccl_sim_stream *s, Op op, uint64_t addr, uint64_t value) {
  push(s, Operation{op, addr, value, nullptr, nullptr});
}

extern "C" {

dfccl_sim_stream *dfccl_sim_stream_create(void) {
  dfccl_sim_stream *s = new dfccl_sim_stream();
  s->thread = std::thread(stream_main, s);
  return s;
}

void dfccl_sim_stream_write32(dfccl_sim_stream *s, uint64_t addr, uint32_t value) {
  enqueue(s, Op::kWrite32, addr, value);
}

void dfccl_sim_stream_wait32(dfccl_sim_stream *s, uint64_t addr, uint32_t value) {
  enqueue(s, Op::kWait32, addr, value);
}

void dfccl_sim_stream_wait_mask32(dfccl_sim_stream *s, uint64_t addr, uint32_t mask) {
  enqueue(s, Op::kWaitMask32, addr, mask);
}

void dfccl_sim_stream_call(dfccl_sim_stream *s, void (*fn)(const void *), const void *params, uint64_t bytes) {
  auto copy = std::make_shared<const std::string>(static_cast<const char *>(params), (size_t)bytes);
  push(s, Operation{Op::kCall, 0, 0, fn, std::move(copy)});
}

void dfccl_sim_stream_delay(dfccl_sim_stream *s, uint64_t ns) { enqueue(s, Op::kDelay, 0, ns); }

int dfccl_sim_stream_begin_capture(dfccl_sim_stream *s) {
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->capture != nullptr) return 0;
  s->capture = new dfccl_sim_graph();
  return 1;
}

dfccl_sim_graph *dfccl_sim_stream_end_capture(dfccl_sim_stream *s) {
  std::lock_guard<std::mutex> lock(s->mu);
  dfccl_sim_graph *g = s->capture;
  s->capture = nullptr;
  return g;
}

int dfccl_sim_stream_capturing(dfccl_sim_stream *s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->capture != nullptr ? 1 : 0;
}

int dfccl_sim_graph_launch(dfccl_sim_graph *g, dfccl_sim_stream *s) {
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->capture != nullptr) return 0;
  for (const Operation &o : g->ops) s->queue.push_back(o);
  s->queued += g->ops.size();
  s->cv.notify_all();
  return 1;
}

uint64_t dfccl_sim_graph_size(dfccl_sim_graph *g) { return g->ops.size(); }

void dfccl_sim_graph_destroy(dfccl_sim_graph *g) { delete g; }

uint64_t dfccl_sim_stream_pending(dfccl_sim_stream *s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->queued - s->finished;
}

int dfccl_sim_stream_synchronize(dfccl_sim_stream *s, uint64_t timeout_ns) {
  std::unique_lock<std::mutex> lock(s->mu);
  const uint64_t target = s->queued;
  auto reached = [s, target] { return s->finished >= target; };
  if (timeout_ns == 0) {
    s->cv.wait(lock, reached);
    return 1;
  }
  return s->cv.wait_for(lock, std::chrono::nanoseconds(timeout_ns), reached) ? 1 : 0;
}

void dfccl_sim_stream_destroy(dfccl_sim_stream *s) {
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stopping = true;
    s->cv.notify_all();
  }
  s->thread.join();
  delete s->capture;  // a capture never ended
  delete s;
}

}  // extern "C"
