// The NCCL communicator for the cuda accelerator. Collectives are enqueued on
// the stream's cudaStream_t; the communicator is created non-blocking so that a
// dead peer can be detected (async error or timeout) and the communicator
// aborted instead of hanging.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include "partition/communicator.h"
#include "runtime/core/error.h"
#include "runtime/cuda/cuda_check.h"

namespace strata::partition {
namespace {
using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
  }
  raise(ErrorCategory::kInternal, "unknown dtype");
}

class NcclCommunicator;

// An event that, while waited on, also watches the communicator for an
// asynchronous error and the timeout.
class NcclEvent final : public Event {
 public:
  NcclEvent(NcclCommunicator& comm, std::unique_ptr<Event> inner, std::string what)
      : comm_(comm), inner_(std::move(inner)), what_(std::move(what)) {}
  void synchronize() override;
  bool query() override { return inner_->query(); }

 private:
  NcclCommunicator& comm_;
  std::unique_ptr<Event> inner_;
  std::string what_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Accelerator& accelerator, StoreClient& store, const CommunicatorOptions& options)
      : accelerator_(accelerator), store_(store), options_(options) {
    STRATA_CHECK(accelerator.backend() == Backend::kCuda, kBadArgument,
                 "the NCCL communicator needs a cuda accelerator, got {}", accelerator.name());
    ncclUniqueId id;
    std::string key = options.prefix + "/nccl_unique_id";
    if (options.rank == 0) {
      STRATA_NCCL_CHECK(ncclGetUniqueId(&id));
      store.set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      auto value = store.get(key);
      STRATA_CHECK(value.size() == sizeof(id.internal), kCommunication, "NCCL unique id under '{}' has {} bytes",
                   key, value.size());
      std::memcpy(id.internal, value.data(), sizeof(id.internal));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Non-blocking: the call returns ncclInProgress and wait_ready bounds the
    // wait by the timeout (a blocking init would hang on a missing peer).
    ncclResult_t init = ncclCommInitRankConfig(&comm_, options.world_size, id, options.rank, &config);
    if (init != ncclSuccess && init != ncclInProgress) STRATA_NCCL_CHECK(init);
    wait_ready("ncclCommInitRankConfig");
  }

  ~NcclCommunicator() override {
    if (barrier_word_ != nullptr) accelerator_.deallocate(barrier_word_);
    if (comm_ == nullptr) return;
    if (aborted_) return;
    // Finalize is asynchronous in non-blocking mode: wait (bounded) before destroying.
    ncclResult_t state = ncclCommFinalize(comm_);
    auto deadline = Clock::now() + options_.timeout;
    while (state == ncclInProgress && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ncclCommGetAsyncError(comm_, &state);
    }
    if (state == ncclSuccess) ncclCommDestroy(comm_); else ncclCommAbort(comm_);
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string_view backend() const override { return "nccl"; }

  std::unique_ptr<Event> allgather(const void* send, void* recv, size_t numel, DType dtype,
                                   Stream& stream) override {
    return enqueue("allgather", numel, dtype, stream, [&](cudaStream_t s) {
      return ncclAllGather(send, recv, numel, nccl_type(dtype), comm_, s);
    });
  }
  std::unique_ptr<Event> reduce_scatter(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                        Stream& stream) override {
    return enqueue("reduce_scatter", numel, dtype, stream, [&](cudaStream_t s) {
      return ncclReduceScatter(send, recv, numel, nccl_type(dtype), nccl_op(op), comm_, s);
    });
  }
  std::unique_ptr<Event> allreduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                   Stream& stream) override {
    return enqueue("allreduce", numel, dtype, stream, [&](cudaStream_t s) {
      return ncclAllReduce(send, recv, numel, nccl_type(dtype), nccl_op(op), comm_, s);
    });
  }
  std::unique_ptr<Event> broadcast(void* data, size_t numel, DType dtype, int root, Stream& stream) override {
    return enqueue("broadcast", numel, dtype, stream, [&](cudaStream_t s) {
      return ncclBroadcast(data, data, numel, nccl_type(dtype), root, comm_, s);
    });
  }
  std::unique_ptr<Event> barrier(Stream& stream) override {
    // NCCL has no barrier: a one-element allreduce on a scratch word orders every rank.
    if (barrier_word_ == nullptr) barrier_word_ = accelerator_.allocate(sizeof(float));
    return enqueue("barrier", 1, DType::kF32, stream, [&](cudaStream_t s) {
      return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, s);
    });
  }

  // Waits for `event`, watching for asynchronous NCCL errors and the timeout;
  // aborts the communicator and throws naming the dead rank when either fires.
  void watch(Event& event, const std::string& what) {
    // After an abort the communicator is gone and the killed kernels may have
    // "completed" the event over partial data: never report success then.
    STRATA_CHECK(!aborted_, kCommunication,
                 "NCCL {} on rank {}: the communicator was aborted by an earlier failure, so this "
                 "collective's result is undefined", what, rank());
    auto deadline = Clock::now() + options_.timeout;
    while (!event.query()) {
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      if (async_error != ncclSuccess && async_error != ncclInProgress) {
        abort_and_raise(what, ncclGetErrorString(async_error));
      }
      if (Clock::now() > deadline) abort_and_raise(what, "timed out");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    event.synchronize();
  }

 private:
  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclAvg; }

  void wait_ready(const char* what) {
    auto deadline = Clock::now() + options_.timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) abort_and_raise(what, ncclGetErrorString(state));
      if (Clock::now() > deadline) abort_and_raise(what, "timed out");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  template <typename Call>
  std::unique_ptr<Event> enqueue(const char* name, size_t numel, DType dtype, Stream& stream, Call call) {
    STRATA_CHECK(!aborted_, kCommunication, "NCCL communicator of rank {} was aborted by an earlier failure",
                 rank());
    std::string what = fmt::format("{} #{} ({} x {})", name, ++op_count_, numel, dtype_name(dtype));
    ncclResult_t result = call(static_cast<cudaStream_t>(stream.native_handle()));
    if (result != ncclSuccess && result != ncclInProgress) abort_and_raise(what, ncclGetErrorString(result));
    wait_ready(what.c_str());
    auto inner = accelerator_.create_event();
    stream.record(*inner);
    return std::make_unique<NcclEvent>(*this, std::move(inner), what);
  }

  [[noreturn]] void abort_and_raise(const std::string& what, const char* reason) {
    if (!aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);
      comm_ = nullptr;  // freed by the abort
    }
    raise(ErrorCategory::kCommunication, "NCCL {} failed on rank {} of {} (timeout {} ms): {}; {}", what, rank(),
          world_size(), options_.timeout.count(), reason, describe_dead_ranks(store_));
  }

  Accelerator& accelerator_;
  StoreClient& store_;
  CommunicatorOptions options_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  uint64_t op_count_ = 0;
  void* barrier_word_ = nullptr;
};

void NcclEvent::synchronize() { comm_.watch(*inner_, what_); }
}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Accelerator& accelerator, StoreClient& store,
                                                     const CommunicatorOptions& options) {
  return std::make_unique<NcclCommunicator>(accelerator, store, options);
}

}  // namespace strata::partition
