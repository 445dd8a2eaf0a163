// The NCCL communicator for the cuda accelerator. Collectives are enqueued on
// the stream's cudaStream_t and return an ordinary event of the accelerator,
// recorded after them, so any stream of that accelerator can wait on it.
//
// The communicator is created non-blocking so that a dead peer can be detected
// and the communicator aborted instead of hanging. A watchdog thread per
// communicator polls ncclCommGetAsyncError and the age of every collective in
// flight (counted from when it starts on the device, so a collective queued
// behind long work is not timed out). On a failure it marks every collective in
// flight failed (kCommunication, naming the op, this rank and the timeout) and
// only then aborts the communicator, which makes their kernels end. Each
// collective is attached to its stream's error history (cuda_stream.h), so the
// failure reaches whoever waits: a host in Event/Stream::synchronize (woken
// when the aborted kernels end) and streams that waited on the event (their
// later events and synchronize).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <span>
#include <vector>

#include "partition/communicator.h"
#include "partition/communicator_support.h"
#include "core/cuda/nccl_api.h"
#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_guard.h"
#include "core/cuda/cuda_stream.h"

namespace strata::partition {
namespace {
using Clock = std::chrono::steady_clock;

// How often the watchdog looks at collectives in flight. Only bounds how late
// a failure is noticed (timeouts are seconds); successes need no watchdog.
constexpr std::chrono::milliseconds kWatchInterval{5};
// While a trace records, the watchdog polls finer: it times each collective
// (from the poll that sees its start event complete to the one that sees it
// decided), so this is the resolution of the "comm" spans on the NCCL track.
constexpr std::chrono::microseconds kTracedWatchInterval{200};

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kF64: return ncclFloat64;
    case DType::kF8E4M3:
    case DType::kU8: return ncclUint8;  // checkpoint bytes: moved, never summed
  }
  raise(ErrorCategory::kInternal, "unknown dtype");
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Accelerator& accelerator, StoreClient& store, const CommunicatorOptions& options)
      : accelerator_(accelerator), store_(store), options_(options),
        track_(trace::make_track("nccl " + options.prefix.substr(options.prefix.rfind('/') + 1))) {
    STRATA_CHECK(accelerator.backend() == Backend::kCuda, kBadArgument,
                 "the NCCL communicator needs a cuda accelerator, got {}", accelerator.name());
    detail::check_options(options);
    device_ = cuda_internal::device_index(accelerator);
    ncclUniqueId id;
    std::string key = options.prefix + "/nccl_unique_id";
    if (options.rank == 0) {
      STRATA_NCCL_CHECK(nccl::api().GetUniqueId(&id));
      store.set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      std::vector<char> value;
      try {
        value = store.get(key);
      } catch (const Error& e) {
        raise(ErrorCategory::kCommunication, "{}: waiting for rank {} to publish the NCCL unique id: {}",
              detail::describe_rank(options), detail::job_rank(options, 0), e.message());
      }
      STRATA_CHECK(value.size() == sizeof(id.internal), kCommunication, "NCCL unique id under '{}' has {} bytes",
                   key, value.size());
      std::memcpy(id.internal, value.data(), sizeof(id.internal));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Non-blocking: the call returns ncclInProgress and wait_ready bounds the
    // wait by the timeout (a blocking init would hang on a missing peer).
    // NCCL binds the communicator to the calling thread's current device.
    std::unique_lock<std::mutex> lock(mutex_);
    DeviceGuard guard(device_, DeviceGuard::Bind::kAlways);
    ncclResult_t init = nccl::api().CommInitRankConfig(&comm_, options.world_size, id, options.rank, &config);
    // An init that fails at once may still have made the communicator (NCCL
    // hands it out before its checks in non-blocking mode): abort frees it
    // (fail_locked), where a bare raise leaked it, as the destructor never runs.
    if (init != ncclSuccess && init != ncclInProgress) {
      abort_and_raise_locked("ncclCommInitRankConfig", nccl::api().GetErrorString(init));
    }
    wait_ready_locked("ncclCommInitRankConfig");
    lock.unlock();
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
    std::unique_lock<std::mutex> lock(mutex_);
    if (comm_ != nullptr && !aborted_) {
      try {
        DeviceGuard guard(device_, DeviceGuard::Bind::kAlways);
        // Finalize is asynchronous in non-blocking mode: it flushes what was
        // issued; wait (bounded) before destroying.
        ncclResult_t state = nccl::api().CommFinalize(comm_);
        auto deadline = Clock::now() + options_.timeout;
        while (state == ncclInProgress && Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
          nccl::api().CommGetAsyncError(comm_, &state);
        }
        if (state == ncclSuccess) {
          nccl::api().CommDestroy(comm_);
          comm_ = nullptr;
        } else {
          fail_locked("ncclCommFinalize at destruction", state == ncclInProgress
                                                              ? "it did not finish within the timeout"
                                                              : nccl::api().GetErrorString(state));
        }
      } catch (const std::exception& e) {
        logger().error("NCCL communicator of {}: {}", detail::describe_rank(options_), e.what());
      }
    }
    lock.unlock();
    // Last: a barrier in flight used it, and the communicator is quiet now.
    if (barrier_word_ != nullptr) accelerator_.deallocate(barrier_word_);
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string_view backend() const override { return "nccl"; }

  std::unique_ptr<Event> allgather(const void* send, void* recv, size_t numel, DType dtype,
                                   Stream& stream) override {
    const size_t nbytes = numel * dtype_nbytes(dtype) * static_cast<size_t>(world_size());
    return enqueue("allgather", numel, dtype, nbytes, stream, [&](cudaStream_t s) {
      return nccl::api().AllGather(send, recv, numel, nccl_type(dtype), comm_, s);
    });
  }
  std::unique_ptr<Event> reduce_scatter(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                        Stream& stream) override {
    const size_t nbytes = numel * dtype_nbytes(dtype) * static_cast<size_t>(world_size());
    return enqueue("reduce_scatter", numel, dtype, nbytes, stream, [&](cudaStream_t s) {
      return nccl::api().ReduceScatter(send, recv, numel, nccl_type(dtype), nccl_op(op), comm_, s);
    });
  }
  std::unique_ptr<Event> allreduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                   Stream& stream) override {
    return enqueue("allreduce", numel, dtype, numel * dtype_nbytes(dtype), stream, [&](cudaStream_t s) {
      return nccl::api().AllReduce(send, recv, numel, nccl_type(dtype), nccl_op(op), comm_, s);
    });
  }
  std::unique_ptr<Event> broadcast(void* data, size_t numel, DType dtype, int root, Stream& stream) override {
    return enqueue("broadcast", numel, dtype, numel * dtype_nbytes(dtype), stream, [&](cudaStream_t s) {
      return nccl::api().Broadcast(data, data, numel, nccl_type(dtype), root, comm_, s);
    });
  }
  std::unique_ptr<Event> barrier(Stream& stream) override {
    // NCCL has no barrier: a one-element allreduce on a scratch word orders every rank.
    if (barrier_word_ == nullptr) barrier_word_ = accelerator_.allocate(sizeof(float));
    return enqueue("barrier", 1, DType::kF32, sizeof(float), stream, [&](cudaStream_t s) {
      return nccl::api().AllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, s);
    });
  }
  // One NCCL group of a receive from and a send to every peer with a non-empty
  // block (both sides skip empty ones: the counts agree), the own block
  // included (NCCL copies it), as one collective.
  std::unique_ptr<Event> all_to_all(const void* send, void* recv, const AllToAllSplits& splits, DType dtype,
                                    Stream& stream) override {
    detail::check_all_to_all(options_, send, recv, splits, dtype);
    const size_t element = dtype_nbytes(dtype), sent = splits.send_total();
    return enqueue("all_to_all", sent, dtype, sent * element, stream, [&](cudaStream_t s) {
      ncclResult_t result = nccl::api().GroupStart();
      if (result != ncclSuccess) return result;
      const ncclDataType_t type = nccl_type(dtype);
      for (size_t p = 0; p < splits.send_counts.size() && (result == ncclSuccess || result == ncclInProgress); ++p) {
        const int peer = static_cast<int>(p);
        if (splits.recv_counts[p] > 0) {
          result = nccl::api().Recv(static_cast<char*>(recv) + splits.recv_displs[p] * element,
                                    splits.recv_counts[p], type, peer, comm_, s);
        }
        if (splits.send_counts[p] > 0 && (result == ncclSuccess || result == ncclInProgress)) {
          result = nccl::api().Send(static_cast<const char*>(send) + splits.send_displs[p] * element,
                                    splits.send_counts[p], type, peer, comm_, s);
        }
      }
      // The group is closed whatever happened inside it; the first error wins.
      const ncclResult_t ended = nccl::api().GroupEnd();
      return result == ncclSuccess || result == ncclInProgress ? ended : result;
    });
  }

  // One NCCL group of every send and receive, in the order given (NCCL pairs
  // a peer's sends and receives in order, as exchange() promises). Nothing is
  // checked across ranks (that would make the host wait for the device).
  std::unique_ptr<Event> exchange(std::span<const P2POp> ops, Stream& stream) override {
    detail::check_exchange(options_, ops);
    size_t numel = 0, nbytes = 0;
    for (const P2POp& op : ops) {
      numel += op.numel();
      if (op.kind == P2POp::Kind::kSend) nbytes += op.numel() * dtype_nbytes(op.dtype);
    }
    const std::vector<P2POp> list(ops.begin(), ops.end());
    return enqueue("exchange", numel, list.front().dtype, nbytes, stream, [&](cudaStream_t s) {
      const nccl::Api& api = nccl::api();
      ncclResult_t result = api.GroupStart();
      if (result != ncclSuccess) return result;
      for (const P2POp& op : list) {
        if (op.numel() == 0 || (result != ncclSuccess && result != ncclInProgress)) continue;
        result = op.kind == P2POp::Kind::kSend
                     ? api.Send(op.data, op.numel(), nccl_type(op.dtype), op.peer, comm_, s)
                     : api.Recv(op.data, op.numel(), nccl_type(op.dtype), op.peer, comm_, s);
      }
      const ncclResult_t ended = api.GroupEnd();
      return result == ncclSuccess || result == ncclInProgress ? ended : result;
    });
  }

 private:
  // A collective in flight, watched until its outcome is decided.
  struct InFlight {
    std::string what;
    std::unique_ptr<Event> start;  // recorded before the kernel
    std::shared_ptr<cuda_internal::WatchedWork> work;
    bool started = false;
    Clock::time_point started_at;
    const char* name = "";   // the collective, for its trace span
    size_t nbytes = 0;
    int64_t started_ns = 0;  // trace clock, when the watchdog saw the start event complete
  };

  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclAvg; }

  // Waits for a non-blocking call to finish, bounded by the timeout.
  void wait_ready_locked(const std::string& what) {
    auto deadline = Clock::now() + options_.timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      nccl::api().CommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) abort_and_raise_locked(what, nccl::api().GetErrorString(state));
      if (Clock::now() > deadline) abort_and_raise_locked(what, "timed out");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  template <typename Call>
  // `nbytes`: nccl-tests' size of the collective, as the Gloo communicator's
  // spans give it (allgather: the output, reduce-scatter: the input,
  // allreduce/broadcast: the buffer, all_to_all: what this rank sends), so
  // the trace's GB/s is algbw.
  std::unique_ptr<Event> enqueue(const char* name, size_t numel, DType dtype, size_t nbytes, Stream& stream,
                                 Call call) {
    std::unique_lock<std::mutex> lock(mutex_);
    STRATA_CHECK(!aborted_, kCommunication,
                 "NCCL communicator of {} was aborted by an earlier failure ({}); it cannot run {}",
                 detail::describe_rank(options_), first_failure_, name);
    std::string what = fmt::format("{} #{} ({} x {})", name, ++op_count_, numel, dtype_name(dtype));
    DeviceGuard guard(device_, DeviceGuard::Bind::kAlways);
    auto start = accelerator_.create_event();
    stream.record(*start);
    try {
      ncclResult_t result = call(static_cast<cudaStream_t>(stream.native_handle()));
      if (result != ncclSuccess && result != ncclInProgress) {
        abort_and_raise_locked(what, nccl::api().GetErrorString(result));
      }
      // In non-blocking mode the kernel may reach the stream only once this
      // returns, so the completion event is recorded after it.
      wait_ready_locked(what);
    } catch (...) {
      // Thrown here, and also the stream's error from this point (the kernel
      // may be on it), through an already failed host event: no device wait.
      auto failed = accelerator_.create_host_event();
      failed->fail(std::current_exception());
      stream.wait(*failed);
      throw;
    }
    auto done = accelerator_.create_event();
    stream.record(*done);
    auto work = std::make_shared<cuda_internal::WatchedWork>(std::move(done));
    // Later events of the stream, and streams that wait on them, report the
    // collective's outcome as the watchdog decides it.
    cuda_internal::attach_error_source(stream, work);
    auto event = accelerator_.create_event();
    stream.record(*event);
    InFlight op;
    op.name = name;
    op.nbytes = nbytes;
    op.what = std::move(what);
    op.start = std::move(start);
    op.work = std::move(work);
    in_flight_.push_back(std::move(op));
    lock.unlock();
    watch_cv_.notify_all();
    return event;
  }

  void watch() {
    try {
      DeviceGuard guard(device_, DeviceGuard::Bind::kAlways);
      std::unique_lock<std::mutex> lock(mutex_);
      while (!stopping_) {
        if (in_flight_.empty() || aborted_) {
          watch_cv_.wait(lock, [&] { return stopping_ || (!in_flight_.empty() && !aborted_); });
          continue;
        }
        poll_locked();
        if (trace::enabled()) {
          watch_cv_.wait_for(lock, kTracedWatchInterval);
        } else {
          watch_cv_.wait_for(lock, kWatchInterval);
        }
      }
    } catch (const std::exception& e) {
      // Only a broken CUDA device gets here; collectives then fail through it.
      logger().error("NCCL watchdog of {} stopped: {}", detail::describe_rank(options_), e.what());
    }
  }

  void poll_locked() {
    const auto now = Clock::now();
    const int64_t now_ns = trace::enabled() ? trace::now_ns() : 0;
    while (!in_flight_.empty() && in_flight_.front().work->decided()) {
      trace_done_locked(in_flight_.front(), now_ns);
      in_flight_.pop_front();
    }
    for (InFlight& op : in_flight_) {
      if (!op.started && op.start->query()) {
        op.started = true;
        op.started_at = now;
        op.started_ns = now_ns;
      }
    }
    if (in_flight_.empty()) return;
    ncclResult_t async_error = ncclSuccess;
    nccl::api().CommGetAsyncError(comm_, &async_error);
    if (async_error != ncclSuccess && async_error != ncclInProgress) {
      fail_locked(in_flight_.front().what, nccl::api().GetErrorString(async_error));
      return;
    }
    for (InFlight& op : in_flight_) {
      if (op.started && now - op.started_at > options_.timeout && !op.work->decided()) {
        fail_locked(op.what, fmt::format("timed out: not complete {} ms after it started on the device",
                                         options_.timeout.count()));
        return;
      }
    }
  }

  // A collective that completed, as a span on this communicator's track
  // (times as the watchdog saw them; see kTracedWatchInterval). One that
  // failed is in the error instead; one whose start the watchdog never saw
  // (the trace began meanwhile) is left out.
  void trace_done_locked(const InFlight& op, int64_t now_ns) const {
    if (now_ns == 0 || op.started_ns == 0 || op.work->error()) return;
    trace::Args args;
    args.bytes = op.nbytes;
    args.detail_key = "comm";
    args.detail = options_.prefix;
    trace::complete(track_, "comm", op.name, op.started_ns, now_ns, args);
  }

  std::string failure_message(const std::string& what, const std::string& reason) const {
    return fmt::format("NCCL {} failed on {} (timeout {} ms): {}", what, detail::describe_rank(options_),
                       options_.timeout.count(), reason);
  }

  // Fails every collective in flight, then aborts the communicator (which ends
  // their kernels): in this order, so that no aborted collective can be taken
  // for one that completed. `what` failed for `reason`.
  void fail_locked(const std::string& what, const std::string& reason) {
    if (aborted_) return;
    const std::string dead = describe_dead_ranks(store_);
    first_failure_ = failure_message(what, reason);
    for (InFlight& op : in_flight_) {
      const std::string cause =
          op.what == what ? reason : fmt::format("the communicator was aborted after {} failed: {}", what, reason);
      const std::string message = fmt::format("{}; {}", failure_message(op.what, cause), dead);
      op.work->fail(std::make_exception_ptr(Error(ErrorCategory::kCommunication, message)));
    }
    in_flight_.clear();
    aborted_ = true;
    if (comm_ != nullptr) {
      try {
        DeviceGuard guard(device_, DeviceGuard::Bind::kAlways);
        nccl::api().CommAbort(comm_);
      } catch (const std::exception& e) {
        logger().error("NCCL communicator of {}: abort: {}", detail::describe_rank(options_), e.what());
      }
      comm_ = nullptr;  // freed by the abort
    }
  }

  [[noreturn]] void abort_and_raise_locked(const std::string& what, const std::string& reason) {
    fail_locked(what, reason);
    raise(ErrorCategory::kCommunication, "{}; {}", failure_message(what, reason), describe_dead_ranks(store_));
  }

  Accelerator& accelerator_;
  StoreClient& store_;
  CommunicatorOptions options_;
  int device_ = 0;
  void* barrier_word_ = nullptr;  // used by the submitting thread only

  // Guards everything below: the submitting thread and the watchdog share the
  // communicator (an abort must not race an enqueue).
  std::mutex mutex_;
  std::condition_variable watch_cv_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  bool stopping_ = false;
  std::string first_failure_;
  uint64_t op_count_ = 0;
  const trace::Track track_;  // "nccl <traffic>": the spans trace_done_locked records
  std::deque<InFlight> in_flight_;  // in submission order
  std::thread watchdog_;
};
}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Accelerator& accelerator, StoreClient& store,
                                                     const CommunicatorOptions& options) {
  return std::make_unique<NcclCommunicator>(accelerator, store, options);
}

}  // namespace strata::partition
