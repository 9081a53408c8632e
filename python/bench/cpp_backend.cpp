// chorus as a c10d::Backend written in C++, to measure against the
// package's Python one (python/bench/dispatch.py, torch_backend.py --cpp).
//
// An all-reduce of one contiguous CPU tensor goes from torch's dispatcher
// straight to the library's C entry point (python/src/capi.rs); its wait()
// wakes from the library's thread and its future completes on one of the
// library's blocking threads: no Python on the way in or out. A failure is
// raised from wait() as the Python backend raises it
// (chorus.GroupAborted naming the ranks, chorus.WaitTimeout, ...). Every
// other operation, and all-reduces issued while coalescing, go to the
// Python backend that formed the group, with the GIL taken.
#include <torch/extension.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/py/PyProcessGroup.hpp>

namespace {

// python/src/capi.rs's `CFailure`.
struct CFailure {
  const char* class_name;
  size_t class_len;
  const char* message;
  size_t message_len;
  const size_t* ranks;
  size_t ranks_len;
};

using Done = void (*)(void*, const CFailure*);

// python/src/capi.rs's `Api`.
struct Api {
  int (*all_reduce)(const void* group, void* ptr, size_t bytes, const char* dtype, const char* op,
                    double timeout_s, Done done, void* ctx);
  int (*run_blocking)(void (*f)(void*), void* arg);
};

const char* dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return nullptr;
  }
}

const char* op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "sum";
    case c10d::ReduceOp::AVG: return "avg";
    case c10d::ReduceOp::PRODUCT: return "prod";
    case c10d::ReduceOp::MIN: return "min";
    case c10d::ReduceOp::MAX: return "max";
    default: return nullptr;
  }
}

// Raises `chorus._errors.<class_name>(message)` with its `ranks`, as the
// Python backend raises it, from a thread that may not hold the GIL.
[[noreturn]] void raise_chorus_error(const std::string& class_name, const std::string& message,
                                     const std::vector<size_t>& ranks) {
  py::gil_scoped_acquire gil;
  py::object type = py::module_::import("chorus._errors").attr(class_name.c_str());
  py::object error = type(message);
  error.attr("ranks") = py::cast(ranks);
  PyErr_SetObject(type.ptr(), error.ptr());
  throw py::error_already_set();
}

// The library's threads let go of works, and a work's tensor whose Python
// object died meanwhile takes the GIL to free it. During interpreter
// finalization taking the GIL ends the thread (pthread_exit), and that
// unwinding through a noexcept destructor aborts the process. So an atexit
// hook, which runs before finalization, closes this gate and waits out the
// threads inside; after it, works are leaked rather than freed.
class ExitGate {
 public:
  bool enter() {
    inside_.fetch_add(1);
    if (closed_.load()) {
      inside_.fetch_sub(1);
      return false;
    }
    return true;
  }

  void leave() { inside_.fetch_sub(1); }

  void close() {
    closed_.store(true);
    py::gil_scoped_release nogil;  // a thread inside may be waiting for the GIL
    while (inside_.load() != 0) {
      std::this_thread::yield();
    }
  }

 private:
  std::atomic<bool> closed_{false};
  std::atomic<int> inside_{0};
};

ExitGate exit_gate;

// Drops `work` unless the interpreter is on its way out.
template <typename T>
void let_go(c10::intrusive_ptr<T> work) {
  if (!exit_gate.enter()) {
    work.release();
    return;
  }
  work.reset();
  exit_gate.leave();
}

// An all-reduce in flight; the library holds one reference to it until
// `done`, so the tensor outlives the operation.
class AllReduceWork : public c10d::Work {
 public:
  AllReduceWork(at::Tensor tensor, const Api* api)
      : Work(-1, c10d::OpType::ALLREDUCE),
        api_(api),
        tensor_(std::move(tensor)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  // On the library's runtime thread: wakes wait() at once; the future,
  // whose callbacks may block, completes on one of the library's blocking
  // threads, and only once somebody asked for it.
  static void done(void* ctx, const CFailure* failure) {
    auto work = c10::intrusive_ptr<AllReduceWork>::reclaim(static_cast<AllReduceWork*>(ctx));
    bool future_asked;
    {
      std::lock_guard<std::mutex> lock(work->mutex_);
      if (failure) {
        work->class_name_.assign(failure->class_name, failure->class_len);
        work->message_.assign(failure->message, failure->message_len);
        work->ranks_.assign(failure->ranks, failure->ranks + failure->ranks_len);
        // What torch's future callers (DDP's reducer) see; wait() raises
        // the typed exception.
        work->error_ = std::make_exception_ptr(c10::DistBackendError(
            {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, work->class_name_ + ": " + work->message_));
      }
      work->ended_ = true;
      future_asked = work->future_asked_;
    }
    work->ended_cv_.notify_all();
    if (future_asked) {
      // The blocking thread's reference, given back in `complete_later`.
      AllReduceWork* arg = c10::intrusive_ptr<AllReduceWork>(work).release();
      if (work->api_->run_blocking(&AllReduceWork::complete_later, arg) != 0) {
        complete_later(arg);
      }
    }
    let_go(std::move(work));
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    bool ended;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ended = ended_ && !future_asked_;
      future_asked_ = true;
    }
    if (ended) {
      complete_future();  // it ended before anybody asked: done() left it
    }
    return future_;
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return ended_;
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return ended_ && !error_;
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (timeout == kNoTimeout) {
      ended_cv_.wait(lock, [&] { return ended_; });
    } else if (!ended_cv_.wait_for(lock, timeout, [&] { return ended_; })) {
      lock.unlock();
      raise_chorus_error("WaitTimeout",
                         "work not finished within " + std::to_string(timeout.count()) +
                             " ms; it goes on under its own deadline",
                         {});
    }
    if (error_) {
      std::string class_name = class_name_, message = message_;
      std::vector<size_t> ranks = ranks_;
      lock.unlock();
      raise_chorus_error(class_name, message, ranks);
    }
    return true;
  }

  std::vector<at::Tensor> result() override { return {tensor_}; }

 private:
  // Callbacks may take the GIL, so they pass the exit gate too.
  static void complete_later(void* arg) {
    auto work = c10::intrusive_ptr<AllReduceWork>::reclaim(static_cast<AllReduceWork*>(arg));
    if (!exit_gate.enter()) {
      work.release();
      return;
    }
    work->complete_future();
    work.reset();
    exit_gate.leave();
  }

  void complete_future() {
    if (error_) {
      future_->setError(error_);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
    }
  }

  const Api* api_;
  at::Tensor tensor_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  mutable std::mutex mutex_;
  std::condition_variable ended_cv_;
  bool ended_ = false;
  bool future_asked_ = false;
  std::exception_ptr error_;
  std::string class_name_;
  std::string message_;
  std::vector<size_t> ranks_;
};

class ChorusCppBackend : public c10d::Backend {
 public:
  ChorusCppBackend(py::object python, uintptr_t api, uintptr_t group, double timeout_s)
      : Backend(python.attr("rank")().cast<int>(), python.attr("size")().cast<int>()),
        python_(std::move(python)),
        api_(reinterpret_cast<const Api*>(api)),
        group_(reinterpret_cast<const void*>(group)),
        timeout_s_(timeout_s) {}

  // `group_` is the Python backend's `_core`, alive as long as `python_`.
  ~ChorusCppBackend() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      python_ = py::object();
    } else {
      python_.release();  // the interpreter is gone: nothing left to free it with
    }
  }

  const std::string getBackendName() const override { return "chorus"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const char* op = op_name(opts.reduceOp.op_);
    if (tensors.size() != 1 || !op || coalescing_) {
      return forward("allreduce", tensors, opts);
    }
    at::Tensor& t = tensors[0];
    const char* dtype = dtype_name(t.scalar_type());
    if (!dtype || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous()) {
      return forward("allreduce", tensors, opts);
    }
    auto work = c10::make_intrusive<AllReduceWork>(t, api_);
    ++fast_ops_;
    double timeout_s = opts.timeout == c10d::kUnsetTimeout ? timeout_s_ : opts.timeout.count() / 1000.0;
    // The library's reference, given back in `done`.
    AllReduceWork* ctx = c10::intrusive_ptr<AllReduceWork>(work).release();
    api_->all_reduce(group_, t.data_ptr(), t.numel() * t.element_size(), dtype, op, timeout_s,
                     &AllReduceWork::done, ctx);
    return work;
  }

  bool supportsSplitting() const override { return true; }

  // The split group's backend is the Python one's split, behind a C++ front.
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    py::object python = python_.attr("split")(store, ranks, opts);
    auto handles = python.attr("_core").attr("c_api")().cast<std::pair<uintptr_t, uintptr_t>>();
    double timeout_s = python.attr("_timeout").is_none() ? timeout_s_ : python.attr("_timeout").cast<double>();
    return c10::make_intrusive<ChorusCppBackend>(python, handles.first, handles.second, timeout_s);
  }

  bool supportsCoalescing() const override { return true; }

  // While coalescing, every operation goes through the Python backend,
  // which gathers them into the one work `endCoalescing` returns.
  void startCoalescing() override {
    py::gil_scoped_acquire gil;
    python_.attr("start_coalescing")();
    coalescing_ = true;
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    coalescing_ = false;
    return forward("end_coalescing");
  }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    py::gil_scoped_acquire gil;
    return python_.attr("options").cast<c10::intrusive_ptr<Options>>();
  }

  // Operations issued here and through the Python backend, in order
  // (what torch's debug wrapper compares across ranks).
  uint64_t getSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    return fast_ops_ + python_.attr("_get_sequence_number_for_group")().cast<uint64_t>();
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    python_.attr("monitored_barrier")(opts, wait_all_ranks);
  }

  void abort() override {
    py::gil_scoped_acquire gil;
    python_.attr("abort")();
  }

  void shutdown() override {
    py::gil_scoped_acquire gil;
    python_.attr("shutdown")();
  }

#define CHORUS_FORWARD(name, params, ...) \
  c10::intrusive_ptr<c10d::Work> name params override { return forward(#name, __VA_ARGS__); }

  CHORUS_FORWARD(broadcast, (std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts), tensors, opts)
  CHORUS_FORWARD(allreduce_sparse, (std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts), tensors,
                 opts)
  CHORUS_FORWARD(allreduce_coalesced,
                 (std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts), tensors, opts)
  CHORUS_FORWARD(reduce, (std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts), tensors, opts)
  CHORUS_FORWARD(allgather,
                 (std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::AllgatherOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(all_gather_single, (at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts),
                 output, input, opts)
  CHORUS_FORWARD(allgather_coalesced,
                 (std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::AllgatherOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(all_gather_single_coalesced,
                 (std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::AllgatherOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(gather,
                 (std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::GatherOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(scatter,
                 (std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(reduce_scatter,
                 (std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ReduceScatterOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(reduce_scatter_single,
                 (at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts), output, input,
                 opts)
  CHORUS_FORWARD(reduce_scatter_single_coalesced,
                 (std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::ReduceScatterOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(all_to_all_single,
                 (at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
                  std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts),
                 output, input, output_split_sizes, input_split_sizes, opts)
  CHORUS_FORWARD(alltoall,
                 (std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::AllToAllOptions& opts),
                 outputs, inputs, opts)
  CHORUS_FORWARD(send, (std::vector<at::Tensor>& tensors, int dst_rank, int tag), tensors, dst_rank, tag)
  CHORUS_FORWARD(recv, (std::vector<at::Tensor>& tensors, int src_rank, int tag), tensors, src_rank, tag)
  CHORUS_FORWARD(barrier, (const c10d::BarrierOptions& opts), opts)
#undef CHORUS_FORWARD

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return forward("recv_anysource", tensors, tag);
  }

 private:
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> forward(const char* name, Args&... args) {
    py::gil_scoped_acquire gil;
    py::object work = python_.attr(name)(args...);
    return c10::make_intrusive<c10d::PyProcessGroup::PyWorkHolder>(std::move(work));
  }

  py::object python_;
  const Api* api_;
  const void* group_;
  double timeout_s_;
  bool coalescing_ = false;
  uint64_t fast_ops_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("atexit").attr("register")(py::cpp_function([] { exit_gate.close(); }));
  py::class_<ChorusCppBackend, c10d::Backend, c10::intrusive_ptr<ChorusCppBackend>>(m, "ChorusCppBackend")
      .def(py::init<py::object, uintptr_t, uintptr_t, double>(), py::arg("python"), py::arg("api"),
           py::arg("group"), py::arg("timeout_s"));
}
