// dfccl's torch.distributed backend, compiled: a c10d::Backend whose
// collectives go through dfccl's C API (dfccl/dfccl_api.h) with no Python
// on the per-call path.
//
// Per call: look the collective's shape up in the plan cache, submit the
// plan at the tensors' addresses (and on the current CUDA stream), wrap the
// handle in a Work.  The Python side (dfccl.torch's ProcessGroupDfccl, here
// "the group") owns the communicators; it is called, with the GIL, only to
// bind a plan for a shape seen for the first time, to build the dfccl error
// of a failed collective, and for the forms this file does not submit
// itself (lists, all-to-all, point-to-point, non-contiguous tensors,
// PREMUL_SUM), which it implements.
//
// Under CUDA graph capture the same path captures: the C API captures a
// submission on a capturing stream (its handle's generation is
// DFCCL_GRAPH_GEN_BIT), and the Work of a captured call waits on streams
// only (docs/torch.md, "CUDA graphs").
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <dfccl/abi.h>
#include <dfccl/dfccl_api.h>

// torch releases before 2.7 have no Backend::shutdown / abort to override.
#define DFCCL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace __attribute__((visibility("hidden"))) dfccl_torch {

namespace py = pybind11;
using c10d::OpType;
using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kNoTimeout{0};

const dfccl_api *g_api = nullptr;

// The CUDA stream torch's next kernel on `device` goes to, as a CUstream.
uint64_t current_stream(const c10::Device &device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return reinterpret_cast<uint64_t>(impl.getStream(device).native_handle());
}

// The Python exception `exc` raised in C++: pybind11 hands it back to the
// Python caller unchanged (the type, the fields tests and users read).
[[noreturn]] void throw_python(const py::object &exc) {
  PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// Lets go of a Python reference from C++ code that may not hold the GIL;
// while the interpreter is finalizing, leaks it (Python frees everything).
void drop(py::object &obj) {
  if (!obj) return;
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    obj = py::object();
  } else {
    obj.release();
  }
}

// The same as an exception_ptr (a Work's exception(), a future's error).
std::exception_ptr python_exception(const py::object &exc) {
  PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
  return std::make_exception_ptr(py::error_already_set());
}

// -- the plan cache ---------------------------------------------------------------

// What decides a plan: the collective's kind, shape, reduction and root, the
// memory it moves (device -1: CPU, the simulator) and its tag (0: none; else
// an id the group interned, see tagged_allreduce).
struct PlanKey {
  const char *kind;   // a string literal: compared by address
  int64_t count;
  int dtype;
  int op;
  int root;
  int device;
  int64_t tag;
  bool operator==(const PlanKey &o) const {
    return kind == o.kind && count == o.count && dtype == o.dtype && op == o.op && root == o.root &&
           device == o.device && tag == o.tag;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey &k) const {
    size_t h = std::hash<const void *>()(k.kind);
    for (int64_t v : {k.count, int64_t(k.dtype), int64_t(k.op), int64_t(k.root), int64_t(k.device), k.tag})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct Plan {
  const dfccl_plan *plan;   // nullptr: the group runs this shape itself (a hierarchical all-reduce)
  py::object bound;         // the BoundPlan that keeps `plan` valid
};

// Shapes kept at most (a program with ever new sizes starts again, as the
// communicator's own kept descriptors do).
constexpr size_t kPlansKept = 256;

class DfcclBackend;

// -- work -------------------------------------------------------------------------

// State shared by a backend and its works: the group (for errors and
// plans) and the thread that completes CPU futures.
struct Shared {
  py::object group;
  int rank = 0;
  std::chrono::milliseconds timeout{0};

  // CPU (simulator) futures: completed by one thread, which polls the
  // handles; future callbacks are user code and run there.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<bool()>> pending;   // true once done
  std::thread completer;
  bool stopping = false;

  void post(std::function<bool()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!completer.joinable() && !stopping) completer = std::thread([this] { run(); });
      pending.push_back(std::move(fn));
    }
    cv.notify_one();
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    auto idle = std::chrono::microseconds(5);
    while (true) {
      cv.wait(lock, [this] { return stopping || !pending.empty(); });
      if (stopping) return;
      auto batch = std::move(pending);
      pending.clear();
      lock.unlock();
      std::deque<std::function<bool()>> left;
      for (auto &fn : batch)
        if (!fn()) left.push_back(std::move(fn));
      lock.lock();
      bool progressed = left.size() < batch.size();
      for (auto &fn : left) pending.push_front(std::move(fn));
      if (!pending.empty()) {
        // Nothing completed: back off up to 200 us (the simulator's
        // daemons share the CPU with this thread).
        idle = progressed ? std::chrono::microseconds(5) : std::min(idle * 2, std::chrono::microseconds(200));
        cv.wait_for(lock, idle, [this] { return stopping; });
        if (stopping) return;
      }
    }
  }

  ~Shared() {
    stop();
    drop(group);
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    if (completer.joinable()) completer.join();
    pending.clear();
  }
};

// Where a call's collectives were submitted: the device, and for CPU
// tensors the simulated stream they follow (0: none, armed at once).
struct Placement {
  c10::Device device;
  uint64_t cpu_stream;
};

// Whether `h` names a collective captured in a CUDA graph (the C API marks
// it with this generation): it runs at each replay, never on the host.
bool captured_handle(const dfccl_handle &h) { return h.gen == DFCCL_GRAPH_GEN_BIT; }

class DfcclWork : public c10d::Work {
 public:
  // `host_blocking`: wait() blocks the host even where it is stream-ordered
  // (an eager barrier, as torch's other backends block there).
  DfcclWork(std::shared_ptr<Shared> shared, OpType type, const char *name, std::vector<at::Tensor> outputs,
            std::vector<at::Tensor> inputs, std::vector<dfccl_handle> handles, Placement where,
            std::chrono::milliseconds timeout, bool host_blocking)
      : c10d::Work(shared->rank, type),
        shared_(std::move(shared)),
        name_(name),
        outputs_(std::move(outputs)),
        inputs_(std::move(inputs)),
        handles_(std::move(handles)),
        done_(handles_.size(), false),
        device_(where.device),
        cpu_stream_(where.cpu_stream),
        captured_(!handles_.empty() && captured_handle(handles_[0])),
        host_blocking_(host_blocking && !captured_),
        timeout_(timeout.count() > 0 ? timeout : shared_->timeout) {}

  ~DfcclWork() override {
    // A captured collective's graph holds what it needs: its handles only let go.
    if (!captured_ && !poll()) {
      // Dropped before it completed (a coalesced call's parts, a Work
      // nobody waits for): the tensors live until the collective ends.
      auto handles = std::make_shared<std::vector<dfccl_handle>>(std::move(handles_));
      auto tensors = std::make_shared<std::vector<at::Tensor>>(std::move(outputs_));
      tensors->insert(tensors->end(), inputs_.begin(), inputs_.end());
      shared_->post([handles, tensors] {
        for (auto &h : *handles)
          if (h.context != nullptr && g_api->test(&h, nullptr, nullptr) == DFCCL_API_PENDING) return false;
        for (auto &h : *handles) g_api->release(&h);
        return true;
      });
    }
    for (auto &h : handles_) g_api->release(&h);
    drop(error_);
  }

  bool isCompleted() override {
    if (captured_) refuse_captured("is_completed");
    std::lock_guard<std::mutex> lock(mu_);
    return poll();
  }

  bool isSuccess() const override {
    if (captured_) refuse_captured("is_success");
    std::lock_guard<std::mutex> lock(mu_);
    return const_cast<DfcclWork *>(this)->poll() && failed_status_ == 0 && api_error_.empty();
  }

  std::exception_ptr exception() const override {
    if (captured_) return nullptr;   // a failed replay is raised by the next call
    std::lock_guard<std::mutex> lock(mu_);
    auto *self = const_cast<DfcclWork *>(this);
    if (!self->poll() || !failed()) return nullptr;
    auto &exc = self->python_error();
    py::gil_scoped_acquire gil;
    return python_exception(exc);
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  // CPU: blocks until complete (or the timeout).  CUDA (and CPU tensors on
  // a simulated stream): makes the current stream wait, without blocking
  // the host, unless a timeout is given.  Captured: the stream (under the
  // same capture) waits for each replay; a host wait is refused.
  bool wait(std::chrono::milliseconds timeout) override {
    if (captured_) {
      if (timeout.count() > 0) refuse_captured("wait(timeout)");
      uint64_t stream = wait_stream();
      for (auto &h : handles_) {
        int rc = g_api->stream_wait(&h, stream);
        if (rc < 0) raise_api(rc, "stream_wait");
      }
      return true;
    }
    bool host = !stream_ordered() || host_blocking_ || timeout.count() > 0;
    if (host) host_wait(timeout.count() > 0 ? timeout : timeout_);
    std::lock_guard<std::mutex> lock(mu_);
    poll();
    if (failed()) raise_error();
    if (!host) {
      uint64_t stream = wait_stream();
      for (size_t i = 0; i < handles_.size(); i++) {
        if (done_[i]) continue;
        int rc = g_api->stream_wait(&handles_[i], stream);
        if (rc < 0) raise_api(rc, "stream_wait");
      }
    }
    return true;
  }

  void synchronize() override {
    if (captured_) refuse_captured("synchronize");
    host_wait(timeout_);
    wait(kNoTimeout);
    if (device_.is_cuda()) {
      c10::impl::VirtualGuardImpl impl(device_.type());
      impl.synchronizeStream(impl.getStream(device_));
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> guard(future_mu_);
    if (future_) return future_;
    auto type = c10::ListType::create(c10::TensorType::get());
    if (device_.is_cuda()) {
      // Stream-ordered: ready once the current stream, which waits for the
      // collective, reaches this point.
      future_ = c10::make_intrusive<c10::ivalue::Future>(type, std::vector<c10::Device>{device_});
      wait(kNoTimeout);
      future_->markCompleted(c10::IValue(outputs_));
      return future_;
    }
    if (captured_) refuse_captured("get_future");   // a CPU future completes on the host
    future_ = c10::make_intrusive<c10::ivalue::Future>(type);
    auto self = c10::intrusive_ptr<DfcclWork>::reclaim_copy(this);
    shared_->post([self] { return self->complete_future(); });
    return future_;
  }

 private:
  bool stream_ordered() const { return device_.is_cuda() || cpu_stream_ != 0; }

  // The stream wait() orders: torch's current one (CUDA), or the simulated
  // stream the collectives follow (CPU).
  uint64_t wait_stream() const { return device_.is_cuda() ? current_stream(device_) : cpu_stream_; }

  // (under mu_) Tests the handles not seen complete; true once all are.
  bool poll() {
    bool all = true;
    for (size_t i = 0; i < handles_.size(); i++) {
      if (done_[i]) continue;
      uint32_t status = 0;
      int32_t detail = -1;
      int rc = g_api->test(&handles_[i], &status, &detail);
      if (rc == DFCCL_API_PENDING) {
        all = false;
        continue;
      }
      done_[i] = true;
      if (rc == DFCCL_API_FAILED && failed_status_ == 0) {
        failed_status_ = status;
        failed_detail_ = detail;
      } else if (rc < 0 && api_error_.empty()) {
        api_error_ = std::string(g_api->error_string(rc)) + ": " + g_api->last_error();
      }
    }
    return all;
  }

  bool failed() const { return failed_status_ != 0 || !api_error_.empty(); }

  // Waits on the host for every handle, up to `timeout` in all.
  void host_wait(std::chrono::milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    for (size_t i = 0; i < handles_.size(); i++) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (done_[i]) continue;
      }
      int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
      int rc = g_api->wait(&handles_[i], timeout.count() > 0 ? std::max<int64_t>(left, 0) : -1, nullptr, nullptr);
      if (rc == DFCCL_API_PENDING) raise_timeout(timeout);
    }
  }

  // (under mu_) The dfccl error of the failure, built once by the group.
  py::object &python_error() {
    if (!error_) {
      py::gil_scoped_acquire gil;
      if (!api_error_.empty())
        error_ = shared_->group.attr("_api_error")(name_, api_error_);
      else
        error_ = shared_->group.attr("_collective_error")(name_, failed_status_, failed_detail_);
    }
    return error_;
  }

  [[noreturn]] void raise_error() {
    auto &exc = python_error();
    py::gil_scoped_acquire gil;
    throw_python(exc);
  }

  [[noreturn]] void raise_api(int rc, const char *what) {
    py::gil_scoped_acquire gil;
    throw_python(shared_->group.attr("_api_error")(name_, std::string(what) + ": " + g_api->error_string(rc) +
                                                               ": " + g_api->last_error()));
  }

  // What the Python backend's Work raises for a host wait on a captured
  // collective (NotSupportedError).
  [[noreturn]] void refuse_captured(const char *what) const {
    py::gil_scoped_acquire gil;
    throw_python(shared_->group.attr("_captured_error")(what, name_));
  }

  [[noreturn]] void raise_timeout(std::chrono::milliseconds timeout) {
    py::gil_scoped_acquire gil;
    throw_python(shared_->group.attr("_timeout_error")(name_, timeout.count() / 1000.0));
  }

  // On the completer thread: true once the future is completed.
  bool complete_future() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!poll()) return false;
    if (failed()) {
      auto &exc = python_error();
      std::exception_ptr eptr;
      {
        py::gil_scoped_acquire gil;
        eptr = python_exception(exc);
      }
      lock.unlock();
      future_->setError(eptr);
      return true;
    }
    lock.unlock();
    future_->markCompleted(c10::IValue(outputs_));
    return true;
  }

  std::shared_ptr<Shared> shared_;
  const char *name_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> inputs_;   // kept alive until completion, as outputs_
  std::vector<dfccl_handle> handles_;
  std::vector<bool> done_;
  c10::Device device_;
  uint64_t cpu_stream_;
  bool captured_;
  bool host_blocking_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  uint32_t failed_status_ = 0;
  int32_t failed_detail_ = -1;
  std::string api_error_;
  py::object error_;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Work the group made (the forms it submits itself), kept with its Python
// object: the Python methods (wait, get_future) live as long as it does.
class GroupWork : public c10d::Work {
 public:
  explicit GroupWork(py::object work)
      : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), object_(std::move(work)) {}
  ~GroupWork() override { drop(object_); }
  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object exc = object_.attr("exception")();
    return exc.is_none() ? nullptr : python_exception(exc);
  }
  std::vector<at::Tensor> result() override { return work_->result(); }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  void synchronize() override { work_->synchronize(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  py::object object_;
};

// -- the backend ------------------------------------------------------------------

int plain_op(const c10d::ReduceOp &op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::AVG:
      return static_cast<int>(op.op_);
    default:
      return -1;   // PREMUL_SUM (a factor), bitwise ones: the group's
  }
}

bool plain_dtype(at::ScalarType t) {
  switch (t) {
    case at::kByte:
    case at::kChar:
    case at::kInt:
    case at::kLong:
    case at::kHalf:
    case at::kBFloat16:
    case at::kFloat:
    case at::kDouble:
      return true;
    default:
      return false;
  }
}

// A tensor the native path submits, on a capturing stream too (the C API
// captures it).
bool plain_tensor(const at::Tensor &t) {
  return (t.is_cpu() || t.is_cuda()) && t.is_contiguous() && t.numel() > 0 && plain_dtype(t.scalar_type());
}

class DfcclBackend : public c10d::Backend {
 public:
  DfcclBackend(int rank, int size, py::object group, std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size), shared_(std::make_shared<Shared>()) {
    shared_->group = std::move(group);
    shared_->rank = rank;
    shared_->timeout = timeout;
  }

  ~DfcclBackend() override {
    // Destroyed without shutdown() (torch releases without it): the
    // group's communicators close here.
    if (!closed_.exchange(true) && Py_IsInitialized()) {
      release();
      py::gil_scoped_acquire gil;
      try {
        shared_->group.attr("shutdown")();
      } catch (py::error_already_set &exc) {
        exc.discard_as_unraisable("dfccl.torch: closing a process group's communicators");
      }
    } else {
      release();
    }
  }

  const std::string getBackendName() const override { return "dfccl"; }

  py::object group() const { return shared_->group; }

  // How many torch calls took each path: submitted here, or handed to the
  // group (tests and the host-path probe read it).
  std::pair<int64_t, int64_t> counts() const { return {native_.load(), handed_.load()}; }

  // -- collectives ----------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> &tensors,
                                           const c10d::AllreduceOptions &opts) override {
    int op = plain_op(opts.reduceOp);
    if (tensors.size() != 1 || op < 0 || !plain_tensor(tensors[0]))
      return hand_over("allreduce", tensors, opts);
    at::Tensor &t = tensors[0];
    const dfccl_plan *plan = plan_of("all_reduce", t, t, t.numel(), op, 0, 0);
    if (plan == nullptr) return hand_over("allreduce", tensors, opts);
    auto h = submit(plan, "all_reduce", t, t);
    return make_work(OpType::ALLREDUCE, "allreduce", tensors, {}, {h}, t.device(), opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor> &tensors,
                                                     const c10d::AllreduceCoalescedOptions &opts) override {
    int op = plain_op(opts.reduceOp);
    if (op < 0 || tensors.empty() || !same_device_plain(tensors))
      return hand_over("allreduce_coalesced", tensors, opts);
    std::vector<const dfccl_plan *> plans = plans_of("all_reduce", tensors, tensors, false, op);
    if (plans.empty()) return hand_over("allreduce_coalesced", tensors, opts);
    std::vector<dfccl_handle> hs;
    for (size_t i = 0; i < tensors.size(); i++)
      push(hs, [&] { return submit(plans[i], "all_reduce", tensors[i], tensors[i]); });
    return make_work(OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, {}, std::move(hs),
                     tensors[0].device(), opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor> &tensors,
                                           const c10d::BroadcastOptions &opts) override {
    if (tensors.size() != 1 || !plain_tensor(tensors[0])) return hand_over("broadcast", tensors, opts);
    at::Tensor &t = tensors[0];
    auto h = submit("broadcast", t, t, t.numel(), 0, static_cast<int>(opts.rootRank), 0);
    return make_work(OpType::BROADCAST, "broadcast", tensors, {}, {h}, t.device(), opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor> &tensors, const c10d::ReduceOptions &opts) override {
    int op = plain_op(opts.reduceOp);
    if (tensors.size() != 1 || op < 0 || !plain_tensor(tensors[0])) return hand_over("reduce", tensors, opts);
    at::Tensor &t = tensors[0];
    auto h = submit("reduce", t, t, t.numel(), op, static_cast<int>(opts.rootRank), 0);
    return make_work(OpType::REDUCE, "reduce", tensors, {}, {h}, t.device(), opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor &output, at::Tensor &input,
                                                 const c10d::AllgatherOptions &opts) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    if (!gather_shape(outs, ins)) return hand_over("_allgather_base", output, input, opts);
    const dfccl_plan *plan = plan_of("all_gather", input, output, input.numel(), 0, 0, 0);
    if (plan == nullptr) return hand_over("_allgather_base", output, input, opts);
    auto h = submit(plan, "all_gather", input, output);
    return make_work(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", outs, ins, {h}, output.device(),
                     opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor> &outputs,
                                                                 std::vector<at::Tensor> &inputs,
                                                                 const c10d::AllgatherOptions &opts) override {
    if (!gather_shape(outputs, inputs)) return hand_over("allgather_into_tensor_coalesced", outputs, inputs, opts);
    std::vector<const dfccl_plan *> plans = plans_of("all_gather", inputs, outputs, false, 0);
    if (plans.empty()) return hand_over("allgather_into_tensor_coalesced", outputs, inputs, opts);
    std::vector<dfccl_handle> hs;
    for (size_t i = 0; i < inputs.size(); i++)
      push(hs, [&] { return submit(plans[i], "all_gather", inputs[i], outputs[i]); });
    return make_work(OpType::COALESCED, "allgather_into_tensor_coalesced", outputs, inputs, std::move(hs),
                     outputs[0].device(), opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor &output, at::Tensor &input,
                                                      const c10d::ReduceScatterOptions &opts) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    int op = plain_op(opts.reduceOp);
    if (op < 0 || !gather_shape(ins, outs)) return hand_over("_reduce_scatter_base", output, input, opts);
    const dfccl_plan *plan = plan_of("reduce_scatter", input, output, output.numel(), op, 0, 0);
    if (plan == nullptr) return hand_over("_reduce_scatter_base", output, input, opts);
    auto h = submit(plan, "reduce_scatter", input, output);
    return make_work(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", outs, ins, {h}, output.device(),
                     opts.timeout);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor> &outputs,
                                                                 std::vector<at::Tensor> &inputs,
                                                                 const c10d::ReduceScatterOptions &opts) override {
    int op = plain_op(opts.reduceOp);
    if (op < 0 || !gather_shape(inputs, outputs))
      return hand_over("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
    std::vector<const dfccl_plan *> plans = plans_of("reduce_scatter", inputs, outputs, true, op);
    if (plans.empty()) return hand_over("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
    std::vector<dfccl_handle> hs;
    for (size_t i = 0; i < inputs.size(); i++)
      push(hs, [&] { return submit(plans[i], "reduce_scatter", inputs[i], outputs[i]); });
    return make_work(OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs, inputs, std::move(hs),
                     outputs[0].device(), opts.timeout);
  }

  // Matched by tag: the k-th use of a tag on one rank meets the k-th on
  // every rank.  `tag_id`: the group's id of the tag (its _tag_id).
  c10::intrusive_ptr<c10d::Work> tagged_allreduce(at::Tensor &t, int64_t tag_id, const c10d::ReduceOp &reduce_op) {
    std::vector<at::Tensor> tensors{t};
    int op = plain_op(reduce_op);
    const dfccl_plan *plan =
        op < 0 || !plain_tensor(t) ? nullptr : plan_of("all_reduce", t, t, t.numel(), op, 0, tag_id);
    if (plan == nullptr) {
      py::gil_scoped_acquire gil;
      return handed(shared_->group.attr("_tagged_allreduce_by_id")(t, tag_id, reduce_op));
    }
    auto h = submit(plan, "all_reduce", t, t);
    return make_work(OpType::ALLREDUCE, "tagged_allreduce", tensors, {}, {h}, t.device(), c10d::kUnsetTimeout);
  }

  // A one-element all-reduce of a word kept per device, under the tag the
  // group's barrier uses (an int32 all-reduce of one element).  Eager, its
  // wait() blocks the host, as torch's other backends do; captured, wait()
  // makes the stream (so every replay) wait for every rank's barrier.
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions &opts) override {
    at::Tensor word = barrier_word(barrier_device(opts));
    std::vector<at::Tensor> tensors{word};
    auto h = submit("all_reduce", word, word, 1, static_cast<int>(c10d::ReduceOp::SUM), 0, 0);
    return make_work(OpType::BARRIER, "barrier", tensors, {}, {h}, word.device(), opts.timeout, true);
  }

  // The simulated stream (a SimStream's handle; 0: none) the collectives
  // of CPU tensors follow, as CUDA tensors' follow torch's current stream:
  // the simulator's stand-in for stream order and graph capture.
  void set_cpu_stream(uint64_t stream) { cpu_stream_.store(stream); }
  uint64_t cpu_stream() const { return cpu_stream_.load(); }

  // -- what the group submits -------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>> &outputs,
                                           std::vector<at::Tensor> &inputs,
                                           const c10d::AllgatherOptions &opts) override {
    return hand_over("allgather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>> &outputs,
                                                     std::vector<at::Tensor> &inputs,
                                                     const c10d::AllgatherOptions &opts) override {
    return hand_over("allgather_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor> &outputs,
                                                std::vector<std::vector<at::Tensor>> &inputs,
                                                const c10d::ReduceScatterOptions &opts) override {
    return hand_over("reduce_scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor &output, at::Tensor &input,
                                               std::vector<int64_t> &output_splits,
                                               std::vector<int64_t> &input_splits,
                                               const c10d::AllToAllOptions &opts) override {
    return hand_over("alltoall_base", output, input, output_splits, input_splits, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor> &outputs, std::vector<at::Tensor> &inputs,
                                          const c10d::AllToAllOptions &opts) override {
    return hand_over("alltoall", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>> &outputs,
                                        std::vector<at::Tensor> &inputs, const c10d::GatherOptions &opts) override {
    return hand_over("gather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor> &outputs,
                                         std::vector<std::vector<at::Tensor>> &inputs,
                                         const c10d::ScatterOptions &opts) override {
    return hand_over("scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor> &tensors, int dst, int tag) override {
    return hand_over("send", tensors, dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor> &tensors, int src, int tag) override {
    return hand_over("recv", tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor> &tensors, int tag) override {
    return hand_over("recv_anysource", tensors, tag);
  }

  // -- lifetime ---------------------------------------------------------------------
#if DFCCL_TORCH_AT_LEAST(2, 7)
  void shutdown() override { close("shutdown"); }
  void abort() override { close("abort"); }
#endif

  // Closes the group's communicators ("shutdown"), or fails what is pending
  // first ("abort").
  void close(const char *how) {
    closed_ = true;
    release();
    py::gil_scoped_acquire gil;
    shared_->group.attr(how)();
  }

 private:
  template <typename F>
  void push(std::vector<dfccl_handle> &hs, F &&submit_one) {
    try {
      hs.push_back(submit_one());
    } catch (...) {
      for (auto &h : hs) g_api->release(&h);   // what was submitted still completes
      throw;
    }
  }

  bool same_device_plain(const std::vector<at::Tensor> &ts) const {
    for (auto &t : ts)
      if (!plain_tensor(t) || t.device() != ts[0].device()) return false;
    return true;
  }

  // outputs[i] holds world size x inputs[i], same dtype and device.
  bool gather_shape(const std::vector<at::Tensor> &outputs, const std::vector<at::Tensor> &inputs) const {
    if (outputs.empty() || outputs.size() != inputs.size()) return false;
    for (size_t i = 0; i < outputs.size(); i++) {
      const auto &o = outputs[i], &in = inputs[i];
      if (!plain_tensor(o) || !plain_tensor(in) || o.device() != in.device() || o.device() != outputs[0].device() ||
          o.scalar_type() != in.scalar_type() || o.numel() != in.numel() * getSize())
        return false;
    }
    return true;
  }

  c10::intrusive_ptr<c10d::Work> make_work(OpType type, const char *name, std::vector<at::Tensor> outputs,
                                           std::vector<at::Tensor> inputs, std::vector<dfccl_handle> handles,
                                           c10::Device device, std::chrono::milliseconds timeout,
                                           bool host_blocking = false) {
    native_++;
    Placement where{device, device.is_cpu() ? cpu_stream_.load() : 0};
    return c10::make_intrusive<DfcclWork>(shared_, type, name, std::move(outputs), std::move(inputs),
                                          std::move(handles), where, timeout, host_blocking);
  }

  // Where a barrier goes: its options' device, else the group's first
  // communicator's kind (torch's current CUDA device, or the simulator).
  c10::Device barrier_device(const c10d::BarrierOptions &opts) {
    if (opts.device.has_value() && opts.device->is_cpu()) return c10::Device(c10::DeviceType::CPU);
    bool cuda = opts.device.has_value();
    if (!cuda) {
      std::call_once(default_cuda_once_, [this] {
        py::gil_scoped_acquire gil;
        default_cuda_ = shared_->group.attr("_default_device_type")().cast<std::string>() == "cuda";
      });
      cuda = default_cuda_;
    }
    if (!cuda) return c10::Device(c10::DeviceType::CPU);
    if (opts.device.has_value() && opts.device->has_index()) return *opts.device;
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    return impl.getDevice();
  }

  // The word a barrier on `device` reduces: made once, kept with the
  // backend (a captured barrier's graph uses it at every replay).
  at::Tensor barrier_word(const c10::Device &device) {
    int key = device.is_cuda() ? device.index() : -1;
    std::lock_guard<std::mutex> lock(words_mu_);
    auto it = barrier_words_.find(key);
    if (it != barrier_words_.end()) return it->second;
    at::Tensor word = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
    return barrier_words_.emplace(key, word).first->second;
  }

  c10::intrusive_ptr<c10d::Work> handed(py::object work) {
    handed_++;
    return c10::make_intrusive<GroupWork>(std::move(work));
  }

  // The group's method `name` (ProcessGroupDfccl), with the GIL.
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> hand_over(const char *name, Args &&...args) {
    py::gil_scoped_acquire gil;
    return handed(shared_->group.attr(name)(std::forward<Args>(args)...));
  }

  // The plan of this shape (bound on its first call); nullptr where the
  // group runs the shape itself: an all-reduce, reduce-scatter or
  // all-gather its communicator runs hierarchically (collectives chained,
  // which a plan is not).
  const dfccl_plan *plan_of(const char *kind, const at::Tensor &send, const at::Tensor &recv, int64_t count, int op,
                            int root, int64_t tag) {
    const c10::Device device = send.device();
    PlanKey key{kind, count, static_cast<int>(send.scalar_type()), op, root, device.is_cuda() ? device.index() : -1,
                tag};
    std::optional<const dfccl_plan *> known = lookup(key);
    return known ? *known : bind(key, send, recv);
  }

  // The plans of a coalesced call's shapes, one per (send, recv) pair,
  // each of count the send's numel (the recv's where `count_of_recv`);
  // empty where the group runs any of them itself (plan_of).
  std::vector<const dfccl_plan *> plans_of(const char *kind, const std::vector<at::Tensor> &sends,
                                           const std::vector<at::Tensor> &recvs, bool count_of_recv, int op) {
    std::vector<const dfccl_plan *> plans;
    for (size_t i = 0; i < sends.size(); i++) {
      const int64_t count = count_of_recv ? recvs[i].numel() : sends[i].numel();
      plans.push_back(plan_of(kind, sends[i], recvs[i], count, op, 0, 0));
      if (plans.back() == nullptr) return {};
    }
    return plans;
  }

  // Submits the plan of this shape (plan_of) at `send` / `recv` (and the
  // current stream): the per-call path, without Python once the shape is known.
  dfccl_handle submit(const char *kind, const at::Tensor &send, const at::Tensor &recv, int64_t count, int op,
                      int root, int64_t tag) {
    const dfccl_plan *plan = plan_of(kind, send, recv, count, op, root, tag);
    if (plan == nullptr) {
      py::gil_scoped_acquire gil;
      throw_python(shared_->group.attr("_api_error")(kind, "the group runs this shape itself; it has no plan"));
    }
    return submit(plan, kind, send, recv);
  }

  dfccl_handle submit(const dfccl_plan *plan, const char *kind, const at::Tensor &send, const at::Tensor &recv) {
    const c10::Device device = send.device();
    dfccl_submit_at at{};
    at.send_addr = reinterpret_cast<uint64_t>(send.data_ptr());
    at.recv_addr = reinterpret_cast<uint64_t>(recv.data_ptr());
    at.stream = device.is_cuda() ? current_stream(device) : cpu_stream_.load();
    at.has_stream = at.stream != 0 || device.is_cuda();
    dfccl_handle h{};
    int rc = g_api->submit(plan, &at, &h);
    if (rc != DFCCL_API_OK) {
      std::string why = std::string(g_api->error_string(rc)) + ": " + g_api->last_error();
      g_api->release(&h);
      py::gil_scoped_acquire gil;
      throw_python(shared_->group.attr("_api_error")(kind, why));
    }
    return h;
  }

  // The plan of a shape seen before (which may be nullptr: plan_of); none
  // for a new shape.
  std::optional<const dfccl_plan *> lookup(const PlanKey &key) {
    std::lock_guard<std::mutex> lock(plans_mu_);
    auto it = plans_.find(key);
    if (it == plans_.end()) return std::nullopt;
    return it->second.plan;
  }

  // A shape seen for the first time: the group binds its plan (a
  // rendezvous for a memory kind's first communicator), or says it runs
  // the shape itself (address 0).
  const dfccl_plan *bind(const PlanKey &key, const at::Tensor &send, const at::Tensor &recv) {
    py::gil_scoped_acquire gil;
    py::tuple made = shared_->group.attr("_c_plan")(key.kind, send, recv, key.op, key.root, key.tag);
    Plan plan{reinterpret_cast<const dfccl_plan *>(made[0].cast<uintptr_t>()), made[1]};
    std::lock_guard<std::mutex> lock(plans_mu_);
    if (plans_.size() >= kPlansKept) plans_.clear();   // under the GIL: BoundPlans may go
    return plans_.emplace(key, std::move(plan)).first->second.plan;
  }

  void release() {
    shared_->stop();
    {
      std::lock_guard<std::mutex> lock(words_mu_);
      barrier_words_.clear();
    }
    std::lock_guard<std::mutex> lock(plans_mu_);
    for (auto &entry : plans_) drop(entry.second.bound);
    plans_.clear();
  }

  std::shared_ptr<Shared> shared_;
  std::mutex plans_mu_;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans_;
  std::mutex words_mu_;
  std::unordered_map<int, at::Tensor> barrier_words_;   // device index (-1: CPU) -> word
  std::once_flag default_cuda_once_;
  bool default_cuda_ = false;
  std::atomic<uint64_t> cpu_stream_{0};
  std::atomic<bool> closed_{false};
  std::atomic<int64_t> native_{0};
  std::atomic<int64_t> handed_{0};
};

}  // namespace dfccl_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using dfccl_torch::DfcclBackend;
  namespace py = pybind11;
  m.doc() = "dfccl's compiled torch.distributed backend (dfccl.torch)";
  // The C API's table, checked once: this file was built for its version.
  auto *api = static_cast<const dfccl_api *>(PyCapsule_Import(DFCCL_API_CAPSULE, 0));
  if (api == nullptr) throw py::error_already_set();
  if (api->size < sizeof(dfccl_api) || api->version < DFCCL_API_VERSION)
    throw std::runtime_error("dfccl's C API table is older than the one dfccl.torch was built for; rebuild it");
  dfccl_torch::g_api = api;
  m.attr("API_VERSION") = DFCCL_API_VERSION;

  py::class_<DfcclBackend, c10d::Backend, c10::intrusive_ptr<DfcclBackend>>(m, "Backend")
      .def(py::init([](int rank, int size, py::object group, double timeout_s) {
             return c10::make_intrusive<DfcclBackend>(
                 rank, size, std::move(group), std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
           }),
           py::arg("rank"), py::arg("size"), py::arg("group"), py::arg("timeout_s"))
      .def_property_readonly("group", &DfcclBackend::group,
                             "The Python side (ProcessGroupDfccl): communicators, the forms it submits")
      .def("counts", &DfcclBackend::counts, "(calls submitted here, calls handed to the group)")
      .def_property("cpu_stream", &DfcclBackend::cpu_stream, &DfcclBackend::set_cpu_stream,
                    "The simulated stream's handle CPU tensors' collectives follow (0: none)")
      .def("close", &DfcclBackend::close, py::arg("how") = "shutdown",
           "Closes the group's communicators (\"abort\": fails what is pending first)")
      .def("tagged_allreduce", &DfcclBackend::tagged_allreduce, py::arg("tensor"), py::arg("tag_id"),
           py::arg("op"), py::call_guard<py::gil_scoped_release>());
}
