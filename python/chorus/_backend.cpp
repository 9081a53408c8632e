// The C++ front of the "chorus" torch backend (cpp_backend.py builds it).
//
// The operations DDP and FSDP issue most, on one contiguous CPU tensor
// (all-reduce, broadcast, all-gather into one tensor, reduce-scatter of
// one), go from torch's dispatcher straight to the library's C entry point
// (python/src/capi.rs); their wait() wakes from the library's thread and
// their future completes on one of the library's blocking threads: no
// Python on the way in or out. A failure is raised from wait() as the
// Python backend raises it (chorus.GroupAborted naming the ranks,
// chorus.WaitTimeout, ...). Every other operation, and those issued while
// coalescing, go to the Python backend that formed the group, with the GIL
// taken.
#include <torch/extension.h>

#include <atomic>
#include <condition_variable>
#include <functional>
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
  int (*collective)(const void* group, const char* kind, size_t count, const char* dtype, const void* input,
                    size_t input_bytes, void* output, size_t output_bytes, const char* op, int64_t root,
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

// An operation in flight; the library holds one reference to it until
// `done`, so its tensors outlive the operation.
class CollectiveWork : public c10d::Work {
 public:
  // `result` is what the future and result() give; `held` what else the
  // operation reads or writes; `finish` runs once it succeeded, before
  // anybody sees it ended (a copy out of a scratch tensor).
  CollectiveWork(c10d::OpType type, const Api* api, std::vector<at::Tensor> result, std::vector<at::Tensor> held,
                 std::function<void()> finish)
      : Work(-1, type),
        api_(api),
        result_(std::move(result)),
        held_(std::move(held)),
        finish_(std::move(finish)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  // On the library's runtime thread: wakes wait() at once; the future,
  // whose callbacks may block, completes on one of the library's blocking
  // threads, and only once somebody asked for it.
  static void done(void* ctx, const CFailure* failure) {
    auto work = c10::intrusive_ptr<CollectiveWork>::reclaim(static_cast<CollectiveWork*>(ctx));
    std::string finish_failed;
    if (!failure && work->finish_) {
      try {
        work->finish_();
      } catch (const std::exception& e) {
        finish_failed = e.what();
      }
    }
    bool future_asked;
    {
      std::lock_guard<std::mutex> lock(work->mutex_);
      if (failure || !finish_failed.empty()) {
        if (failure) {
          work->class_name_.assign(failure->class_name, failure->class_len);
          work->message_.assign(failure->message, failure->message_len);
          work->ranks_.assign(failure->ranks, failure->ranks + failure->ranks_len);
        } else {
          work->class_name_ = "ChorusError";
          work->message_ = "copying the result out failed: " + finish_failed;
        }
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
      CollectiveWork* arg = c10::intrusive_ptr<CollectiveWork>(work).release();
      if (work->api_->run_blocking(&CollectiveWork::complete_later, arg) != 0) {
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

  std::vector<at::Tensor> result() override { return result_; }

 private:
  // Callbacks may take the GIL, so they pass the exit gate too.
  static void complete_later(void* arg) {
    auto work = c10::intrusive_ptr<CollectiveWork>::reclaim(static_cast<CollectiveWork*>(arg));
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
      future_->markCompleted(c10::IValue(result_));
    }
  }

  const Api* api_;
  std::vector<at::Tensor> result_;
  std::vector<at::Tensor> held_;
  std::function<void()> finish_;
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

  py::object python() const { return python_; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const char* op = op_name(opts.reduceOp.op_);
    if (tensors.size() != 1 || !op || !fast(tensors[0])) {
      return forward("allreduce", tensors, opts);
    }
    at::Tensor& t = tensors[0];
    return submit(c10d::OpType::ALLREDUCE, "all_reduce", t.numel(), nullptr, t, op, -1, opts.timeout, {t}, {},
                  nullptr);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (tensors.size() != 1 || opts.rootTensor != 0 || !fast(tensors[0])) {
      return forward("broadcast", tensors, opts);
    }
    at::Tensor& t = tensors[0];
    return submit(c10d::OpType::BROADCAST, "broadcast", t.numel(), nullptr, t, nullptr, opts.rootRank,
                  opts.timeout, {t}, {}, nullptr);
  }

  // all_gather_into_tensor. FSDP gathers in place (the input is the
  // output's own block): the ranks read the input while writing the
  // output, so an overlapping input is copied first.
  c10::intrusive_ptr<c10d::Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
    if (!fast(output) || !fast(input) || output.scalar_type() != input.scalar_type() ||
        output.numel() != input.numel() * getSize()) {
      return forward("all_gather_single", output, input, opts);
    }
    at::Tensor source = overlaps(input, output) ? input.clone() : input;
    return submit(c10d::OpType::_ALLGATHER_BASE, "all_gather", input.numel(), &source, output, nullptr, -1,
                  opts.timeout, {output}, {source}, nullptr);
  }

  // reduce_scatter_tensor: the library reduces into a scratch tensor of the
  // input's size, whose rank's block is copied out once it ended.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                       const c10d::ReduceScatterOptions& opts) override {
    const char* op = op_name(opts.reduceOp.op_);
    if (!op || !fast(output) || !fast(input) || output.scalar_type() != input.scalar_type() ||
        input.numel() != output.numel() * getSize()) {
      return forward("reduce_scatter_single", output, input, opts);
    }
    at::Tensor scratch = at::empty_like(input);
    at::Tensor block = scratch.flatten().narrow(0, getRank() * output.numel(), output.numel()).view_as(output);
    std::function<void()> finish = [output, block]() mutable { output.copy_(block); };
    return submit(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter", output.numel(), &input, scratch, op,
                  -1, opts.timeout, {output}, {input, scratch}, std::move(finish));
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

  CHORUS_FORWARD(allreduce_sparse, (std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts), tensors,
                 opts)
  CHORUS_FORWARD(allreduce_coalesced,
                 (std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts), tensors, opts)
  CHORUS_FORWARD(reduce, (std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts), tensors, opts)
  CHORUS_FORWARD(allgather,
                 (std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                  const c10d::AllgatherOptions& opts),
                 outputs, inputs, opts)
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
  // A tensor the library takes as it is: a dense, contiguous CPU tensor of
  // a dtype it knows, outside coalescing (which the Python backend
  // gathers into one work).
  bool fast(const at::Tensor& t) const {
    return !coalescing_ && dtype_name(t.scalar_type()) && t.device().is_cpu() && t.layout() == at::kStrided &&
           t.is_contiguous();
  }

  static bool overlaps(const at::Tensor& a, const at::Tensor& b) {
    auto a_begin = static_cast<const char*>(a.data_ptr()), b_begin = static_cast<const char*>(b.data_ptr());
    return a.numel() > 0 && b.numel() > 0 && a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
  }

  // Hands the operation to the library; `output` is written, `input` (if
  // any, of the output's dtype) only read.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, const char* kind, int64_t count, const at::Tensor* input,
                                        at::Tensor& output, const char* op, int64_t root,
                                        std::chrono::milliseconds timeout, std::vector<at::Tensor> result,
                                        std::vector<at::Tensor> held, std::function<void()> finish) {
    auto work = c10::make_intrusive<CollectiveWork>(type, api_, std::move(result), std::move(held), std::move(finish));
    ++fast_ops_;
    double timeout_s = timeout == c10d::kUnsetTimeout ? timeout_s_ : timeout.count() / 1000.0;
    // The library's reference, given back in `done`.
    CollectiveWork* ctx = c10::intrusive_ptr<CollectiveWork>(work).release();
    api_->collective(group_, kind, static_cast<size_t>(count), dtype_name(output.scalar_type()),
                     input ? input->data_ptr() : nullptr, input ? input->nbytes() : 0, output.data_ptr(),
                     output.nbytes(), op, root, timeout_s, &CollectiveWork::done, ctx);
    return work;
  }

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
           py::arg("group"), py::arg("timeout_s"))
      .def_property_readonly("python", [](const ChorusCppBackend& self) { return self.python(); },
                             "The Python backend behind this front.");
}
