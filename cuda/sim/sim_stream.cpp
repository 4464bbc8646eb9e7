// The simulator's streams (sim_stream.h): one thread per stream takes its
// operations in order; a wait polls host memory, as the GPU front end polls
// the word a cuStreamWaitValue32 names.
#include "sim_stream.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace {

enum class Op { kWrite32, kWait32, kDelay };

struct Operation {
  Op op;
  uint64_t addr;
  uint64_t value;  // the word (write, wait), or nanoseconds (delay)
};

std::atomic<uint32_t> *word(uint64_t addr) { return reinterpret_cast<std::atomic<uint32_t> *>(addr); }

}  // namespace

struct dfccl_sim_stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Operation> queue;
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
      for (uint32_t polls = 0;; ++polls) {
        const uint32_t v = word(o.addr)->load(std::memory_order_acquire);
        if ((int32_t)(v - (uint32_t)o.value) >= 0) return true;
        if ((polls & 63) == 63 && stopping(s)) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    case Op::kDelay: {
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(o.value);
      std::unique_lock<std::mutex> lock(s->mu);
      return !s->cv.wait_until(lock, until, [s] { return s->stopping; });
    }
  }
  return true;
}

static void stream_main(dfccl_sim_stream *s) {
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

static void enqueue(dfccl_sim_stream *s, Op op, uint64_t addr, uint64_t value) {
  std::lock_guard<std::mutex> lock(s->mu);
  s->queue.push_back(Operation{op, addr, value});
  s->queued += 1;
  s->cv.notify_all();
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

void dfccl_sim_stream_delay(dfccl_sim_stream *s, uint64_t ns) { enqueue(s, Op::kDelay, 0, ns); }

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
  delete s;
}

}  // extern "C"
