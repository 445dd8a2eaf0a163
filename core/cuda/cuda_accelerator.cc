// The cuda backend: a caching device allocator under a budget over CUDA's
// stream-ordered allocator on a stream of its own (so that returning memory
// never waits for other streams), with stream-ordered frees, CUDA streams whose errors are tracked on the host
// (core/cuda/cuda_stream.h), events, host events the device waits on,
// pinned memory (our locked host memory, cudaHostRegister-ed), async copies.
#include <cuda.h>  // driver types for cuStreamWaitValue32 (the function comes from the runtime's entry point)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/accelerator.h"
#include "core/block_cache.h"
#include "core/cuda/nccl_api.h"
#include "core/error.h"
#include "core/host_memory.h"
#include "core/log.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_guard.h"
#include "core/cuda/cuda_stream.h"

#include <cublas_v2.h>
#include <nccl.h>

namespace strata {
namespace cuda_internal {
namespace {

constexpr uint64_t kNoPosition = UINT64_MAX;

// Kernels load when CUDA starts (CUDA_MODULE_LOADING=EAGER), not at their
// first launch (LAZY, CUDA's default since 12.2): loading a module can wait
// for the whole context, and a first launch while a stream is parked on a
// host event that the launching thread signals later would never return.
// Set when this library loads, before anything in the process can start CUDA;
// a value the user set is kept (and named when an accelerator is made).
const char* const kUserModuleLoading = [] {
  const char* value = std::getenv("CUDA_MODULE_LOADING");
  if (value == nullptr) setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  return value;
}();

// Recycles cudaEvent_t handles: every Stream::record takes a fresh one (so a
// point once seen by a wait or a stream-ordered free never moves), and giving
// one back makes no CUDA call, so it may happen inside a host function.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t event : free_) cudaEventDestroy(event);
  }
  cudaEvent_t take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    DeviceGuard guard(device_);
    cudaEvent_t event = nullptr;
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  void give(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(event);
  }

 private:
  const int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// 32-bit words of host memory mapped into the device, for host events that a
// stream waits on with cuStreamWaitValue32. A word only ever grows (cyclically):
// a host event takes a word and a target one above the word's last value and
// stores the target when it completes; a wait is "word >= target" (cyclic).
// So a word can be reused as soon as its event completed, even while streams
// still have to pass waits on the old target: a later value satisfies them.
class FlagPool {
 public:
  struct Slot {
    uint32_t* host = nullptr;
    CUdeviceptr device = 0;
    uint32_t target = 0;
  };

  explicit FlagPool(int device) : device_(device) {}
  ~FlagPool() {
    for (void* page : pages_) cudaFreeHost(page);
  }

  Slot take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) add_page_locked();
    Slot slot = free_.back();
    free_.pop_back();
    slot.target += 1;  // free_ holds the last value stored in the word
    return slot;
  }
  // `slot.target` must have been stored in the word.
  void give(const Slot& slot) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(slot);
  }

 private:
  static constexpr size_t kPageNbytes = 4096;

  void add_page_locked() {
    DeviceGuard guard(device_);
    void* page = nullptr;
    // Portable: any context may use it; mapped: the device reads it in place.
    STRATA_CUDA_CHECK(cudaHostAlloc(&page, kPageNbytes, cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(page, 0, kPageNbytes);
    void* device_page = nullptr;
    const cudaError_t result = cudaHostGetDevicePointer(&device_page, page, 0);
    if (result != cudaSuccess) {
      cudaFreeHost(page);
      check_cuda(result, "cudaHostGetDevicePointer");
    }
    pages_.push_back(page);
    auto* words = static_cast<uint32_t*>(page);
    for (size_t i = 0; i < kPageNbytes / sizeof(uint32_t); ++i) {
      free_.push_back(Slot{words + i, reinterpret_cast<CUdeviceptr>(device_page) + i * sizeof(uint32_t), 0});
    }
  }

  const int device_;
  std::mutex mutex_;
  std::vector<void*> pages_;
  std::vector<Slot> free_;
};

using WaitValue32Fn = CUresult(CUDAAPI*)(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags);

// What an accelerator shares with the streams and events it creates.
struct Shared {
  int device = 0;
  std::shared_ptr<EventPool> events;
  std::shared_ptr<FlagPool> flags;
  // cuStreamWaitValue32 from the driver, or nullptr: host events are then
  // waited on by a host function that blocks (see CudaStream::wait).
  WaitValue32Fn wait_value32 = nullptr;
  std::atomic<bool> wait_value_works{true};
};

// The host-side error history of one stream (see cuda_stream.h). Positions
// count the stream's host functions, waits and attached sources, from 1; an
// event recorded at position p covers them up to p.
class StreamHistory {
 public:
  // Called with the stream's submission lock held, so positions follow the
  // order of the work on the device.
  uint64_t position() {
    std::lock_guard<std::mutex> lock(mutex_);
    return position_;
  }
  uint64_t next_position() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ++position_;
  }
  void add_source(uint64_t position, std::shared_ptr<ErrorSource> source) {
    std::lock_guard<std::mutex> lock(mutex_);
    sources_.push_back(Entry{position, std::move(source)});
  }
  size_t pending_sources() {
    std::lock_guard<std::mutex> lock(mutex_);
    return sources_.size();
  }
  // Keeps the error of the earliest position: that is the stream's first error
  // whatever order lazily resolved sources are looked at.
  void set_error(uint64_t position, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    set_error_locked(position, std::move(error));
  }
  // The error stored so far at or before `position`, asking no source.
  std::exception_ptr stored_error_through(uint64_t position) {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_position_ <= position ? error_ : nullptr;
  }
  // The first error at or before `position` known so far, for when the device
  // failed to reach it: sources are asked only for outcomes already decided
  // (an aborted collective, a failed host event), and other streams only for
  // errors they have stored, so nothing is decided early and nothing recurses.
  std::exception_ptr known_error_through(uint64_t position) {
    std::vector<Entry> due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Entry& entry : sources_) {
        if (entry.position > position) break;
        due.push_back(entry);
      }
    }
    for (const Entry& entry : due) {
      if (auto error = entry.source->decided_error()) set_error(entry.position, std::move(error));
    }
    return stored_error_through(position);
  }
  // The first error at or before `position`, or nullptr. Requires the work up
  // to `position` to have completed on the device. Makes no CUDA call (it runs
  // in host functions).
  //
  // Sources are resolved one at a time, oldest first, and dropped once
  // resolved, so each is looked at once however streams depend on each other:
  // a source of another stream's history that leads back here points to an
  // earlier position (device work is acyclic), which finds the oldest
  // unresolved source of this history later than it and stops. Sources are
  // asked without the lock held: they may be other histories.
  std::exception_ptr error_through(uint64_t position) {
    for (;;) {
      Entry entry;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (sources_.empty() || sources_.front().position > position) {
          return error_position_ <= position ? error_ : nullptr;
        }
        entry = sources_.front();
      }
      std::exception_ptr error = entry.source->error();
      std::lock_guard<std::mutex> lock(mutex_);
      if (error) set_error_locked(entry.position, std::move(error));
      // Another thread may have resolved it meanwhile (positions are unique).
      if (!sources_.empty() && sources_.front().position == entry.position) sources_.pop_front();
    }
  }
  // Resolves the sources whose work has completed, so that the history of a
  // stream that is rarely synchronized stays short, and so that two streams
  // that wait on each other do not keep each other alive. Host threads only.
  void prune() {
    std::vector<Entry> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      all.assign(sources_.begin(), sources_.end());
    }
    std::unordered_set<const ErrorSource*> resolved;
    for (const Entry& entry : all) {
      if (!entry.source->completed()) continue;
      if (auto error = entry.source->error()) set_error(entry.position, error);
      resolved.insert(entry.source.get());
    }
    if (resolved.empty()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    // An entry of a resolved source added meanwhile lies after the resolved
    // one, so the error (if any) is already stored at an earlier position.
    sources_.erase(std::remove_if(sources_.begin(), sources_.end(),
                                  [&](const Entry& entry) { return resolved.count(entry.source.get()) != 0; }),
                   sources_.end());
  }

 private:
  struct Entry {
    uint64_t position = 0;
    std::shared_ptr<ErrorSource> source;
  };
  void set_error_locked(uint64_t position, std::exception_ptr error) {
    if (position < error_position_) {
      error_position_ = position;
      error_ = std::move(error);
    }
  }
  std::mutex mutex_;
  uint64_t position_ = 0;
  uint64_t error_position_ = kNoPosition;
  std::exception_ptr error_;
  std::deque<Entry> sources_;  // by position
};

// A recorded event: a cudaEvent_t and the position in its stream's history.
// Immutable once made (a later record makes a new Point).
class Point final : public ErrorSource {
 public:
  Point(std::shared_ptr<EventPool> pool, cudaEvent_t event, std::shared_ptr<StreamHistory> history,
        uint64_t position)
      : pool_(std::move(pool)), event_(event), history_(std::move(history)), position_(position) {}
  ~Point() override { pool_->give(event_); }
  Point(const Point&) = delete;
  Point& operator=(const Point&) = delete;

  cudaEvent_t event() const { return event_; }
  StreamHistory& history() const { return *history_; }
  const std::shared_ptr<StreamHistory>& history_ptr() const { return history_; }
  uint64_t position() const { return position_; }

  std::exception_ptr error() override { return history_->error_through(position_); }
  // A failed query (the device is broken) counts as complete: whoever waits
  // goes on to synchronize, which reports it.
  bool completed() override { return cudaEventQuery(event_) != cudaErrorNotReady; }
  std::exception_ptr decided_error() override { return history_->stored_error_through(position_); }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
  std::shared_ptr<StreamHistory> history_;
  uint64_t position_;
};

class CudaEvent final : public Event {
 public:
  void set(std::shared_ptr<Point> point) {
    std::lock_guard<std::mutex> lock(mutex_);
    point_ = std::move(point);
  }
  std::shared_ptr<Point> point() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return point_;
  }
  void synchronize() override {
    const std::shared_ptr<Point> point = this->point();
    if (!point) return;  // never recorded: complete
    const cudaError_t result = cudaEventSynchronize(point->event());
    if (result != cudaSuccess) {
      // The device did not reach the point; report a stream error known
      // already (the cause, e.g. an aborted collective) over the CUDA error.
      if (auto error = point->history().known_error_through(point->position())) std::rethrow_exception(error);
      check_cuda(result, "cudaEventSynchronize");
    }
    if (auto error = point->error()) std::rethrow_exception(error);
  }
  bool query() override {
    const std::shared_ptr<Point> point = this->point();
    return !point || point->completed();
  }

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<Point> point_;
};

// A host event's state, shared with the streams and stream-ordered frees that
// depend on it so that they survive the event object.
class HostEventState final : public ErrorSource {
 public:
  explicit HostEventState(FlagPool::Slot slot) : slot_(slot) {}

  const FlagPool::Slot& slot() const { return slot_; }

  // The first completion wins. The flag word is written under the lock, after
  // `done_` and `error_`: a stream that passed its wait finds the outcome, and
  // the destructor (which completes too) cannot hand the word on before the
  // store. The release store orders the caller's writes (a buffer filled by
  // I/O) before the flag for the device, which reads it over PCIe.
  void complete(std::exception_ptr failure) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (done_) return;
      done_ = true;
      error_ = std::move(failure);
      if (slot_.host != nullptr) __atomic_store_n(slot_.host, slot_.target, __ATOMIC_RELEASE);
    }
    completed_cv_.notify_all();
  }
  // Blocks until complete; returns the error or nullptr.
  std::exception_ptr wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    completed_cv_.wait(lock, [&] { return done_; });
    return error_;
  }
  std::exception_ptr error() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  bool completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  std::exception_ptr decided_error() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  const FlagPool::Slot slot_;  // host == nullptr without stream memory operations
  std::mutex mutex_;
  std::condition_variable completed_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class CudaHostEvent final : public HostEvent {
 public:
  explicit CudaHostEvent(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {
    FlagPool::Slot slot;
    if (shared_->wait_value32 != nullptr) slot = shared_->flags->take();
    state_ = std::make_shared<HostEventState>(slot);
  }
  ~CudaHostEvent() override {
    // Releases any stream still held by this event (with an error), and only
    // then hands the word on.
    state_->complete(std::make_exception_ptr(
        Error(ErrorCategory::kInternal, "a host event was destroyed before it was signalled or failed")));
    if (state_->slot().host != nullptr) shared_->flags->give(state_->slot());
  }
  void signal() override { state_->complete(nullptr); }
  void fail(std::exception_ptr error) override {
    state_->complete(error ? std::move(error)
                           : std::make_exception_ptr(
                                 Error(ErrorCategory::kBadArgument, "HostEvent::fail called with a null error")));
  }
  void synchronize() override {
    if (auto error = state_->wait()) std::rethrow_exception(error);
  }
  bool query() override { return state_->completed(); }
  const std::shared_ptr<HostEventState>& state() const { return state_; }

 private:
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<HostEventState> state_;
};

// Host functions run on a CUDA driver thread where exceptions must not escape
// and CUDA must not be called; their errors go into the stream's history.
struct HostFuncCall {
  std::function<void()> fn;
  std::shared_ptr<StreamHistory> history;
  uint64_t position;
};

void CUDART_CB run_host_func(void* user_data) {
  std::unique_ptr<HostFuncCall> call(static_cast<HostFuncCall*>(user_data));
  try {
    // Everything before this position has completed on the device.
    if (call->history->error_through(call->position - 1)) return;  // skipped after a failure
    call->fn();
  } catch (...) {
    call->history->set_error(call->position, std::current_exception());
  }
}

// The fallback wait on a host event: blocks the driver's callback thread.
void CUDART_CB block_until_complete(void* user_data) {
  std::unique_ptr<std::shared_ptr<HostEventState>> state(static_cast<std::shared_ptr<HostEventState>*>(user_data));
  (*state)->wait();
}

class CudaStream final : public Stream {
 public:
  explicit CudaStream(std::shared_ptr<Shared> shared)
      : shared_(std::move(shared)), history_(std::make_shared<StreamHistory>()) {
    DeviceGuard guard(shared_->device);
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  // Accelerator::borrow_stream: a stream another library owns, never destroyed here.
  CudaStream(std::shared_ptr<Shared> shared, cudaStream_t borrowed)
      : shared_(std::move(shared)), history_(std::make_shared<StreamHistory>()), stream_(borrowed), owned_(false) {}
  ~CudaStream() override {
    if (!owned_) return;  // its owner's work goes on: only this wrapper's references go
    cudaStreamSynchronize(stream_);
    // All work is done: resolve every source, which also drops references to
    // other streams' histories.
    try {
      history_->error_through(history_->position());
    } catch (...) {
    }
    cudaStreamDestroy(stream_);
  }

  void record(Event& event) override {
    auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
    if (cuda_event == nullptr) raise_foreign(event, "record");
    cudaEvent_t handle = shared_->events->take();
    std::shared_ptr<Point> point;
    {
      std::lock_guard<std::mutex> lock(submit_mutex_);
      const cudaError_t result = cudaEventRecord(handle, stream_);
      if (result != cudaSuccess) {
        shared_->events->give(handle);
        check_cuda(result, "cudaEventRecord");
      }
      point = std::make_shared<Point>(shared_->events, handle, history_, history_->position());
    }
    cuda_event->set(std::move(point));
  }

  void wait(Event& event) override {
    if (auto* cuda_event = dynamic_cast<CudaEvent*>(&event)) {
      std::shared_ptr<Point> point = cuda_event->point();
      if (!point) return;  // never recorded: complete
      {
        std::lock_guard<std::mutex> lock(submit_mutex_);
        STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_, point->event(), 0));
        // An event of this stream brings no error it does not have already.
        if (point->history_ptr() != history_) history_->add_source(history_->next_position(), point);
      }
    } else if (auto* host_event = dynamic_cast<CudaHostEvent*>(&event)) {
      std::shared_ptr<HostEventState> state = host_event->state();
      std::lock_guard<std::mutex> lock(submit_mutex_);
      // Signalled already: nothing to hold the device for, only the outcome.
      if (!state->completed()) enqueue_host_wait(state);
      history_->add_source(history_->next_position(), state);
    } else {
      raise_foreign(event, "wait on");
    }
    if (history_->pending_sources() > kPruneAbove) history_->prune();
  }

  void launch_host_func(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    auto* call = new HostFuncCall{std::move(fn), history_, history_->next_position()};
    const cudaError_t result = cudaLaunchHostFunc(stream_, run_host_func, call);
    if (result != cudaSuccess) delete call;
    check_cuda(result, "cudaLaunchHostFunc");
  }

  void synchronize() override {
    uint64_t position = 0;
    {
      // Everything submitted before this point is covered by the sync below.
      std::lock_guard<std::mutex> lock(submit_mutex_);
      position = history_->position();
    }
    const cudaError_t result = cudaStreamSynchronize(stream_);
    if (result != cudaSuccess) {
      if (auto error = history_->known_error_through(position)) std::rethrow_exception(error);
      check_cuda(result, "cudaStreamSynchronize");
    }
    if (auto error = history_->error_through(position)) std::rethrow_exception(error);
  }

  void* native_handle() override { return stream_; }

  void attach(std::shared_ptr<ErrorSource> source) {
    {
      std::lock_guard<std::mutex> lock(submit_mutex_);
      history_->add_source(history_->next_position(), std::move(source));
    }
    if (history_->pending_sources() > kPruneAbove) history_->prune();
  }

 private:
  // Sources kept before the history is pruned (each prune queries them all).
  static constexpr size_t kPruneAbove = 16;

  [[noreturn]] static void raise_foreign(Event& event, const char* what) {
    if (dynamic_cast<HostEvent*>(&event) != nullptr) {
      raise(ErrorCategory::kBadArgument,
            "cuda stream: cannot {} this host event (host events cannot be recorded; waits take those of "
            "the cuda backend only)",
            what);
    }
    raise(ErrorCategory::kBadArgument, "cuda stream: cannot {} an event that is not from the cuda backend", what);
  }

  // Holds the stream on the device until the host event completes.
  //
  // Preferred: cuStreamWaitValue32 on the event's word of mapped host memory.
  // The device's front end polls the word; no host thread is involved, so any
  // number of transfers can be in flight, each completed by whichever thread
  // sees its I/O finish (signal() is one store). Fallback, when the driver
  // lacks stream memory operations: a host function that blocks until the
  // event completes. That pins the driver's callback thread (shared by the
  // streams of the process) while it waits, so it serializes with other host
  // functions; it is correct but slower, and signal() must then not depend on
  // another host function of this process.
  void enqueue_host_wait(const std::shared_ptr<HostEventState>& state) {
    if (state->slot().host != nullptr && shared_->wait_value_works.load()) {
      // A driver call uses the calling thread's current context: make it the
      // device's primary context (cudaSetDevice binds it), restore after.
      DeviceGuard current(shared_->device, DeviceGuard::Bind::kAlways);
      const CUresult result = shared_->wait_value32(static_cast<CUstream>(stream_), state->slot().device,
                                                    state->slot().target, CU_STREAM_WAIT_VALUE_GEQ);
      if (result == CUDA_SUCCESS) return;
      if (result != CUDA_ERROR_NOT_SUPPORTED) {
        raise(ErrorCategory::kCuda, "cuStreamWaitValue32 on a host event's flag failed (CUresult {})",
              static_cast<int>(result));
      }
      shared_->wait_value_works = false;
      logger().warn("cuda:{}: stream memory operations are not supported; streams wait on host events "
                    "through a blocking host function",
                    shared_->device);
    }
    auto* user_data = new std::shared_ptr<HostEventState>(state);
    const cudaError_t result = cudaLaunchHostFunc(stream_, block_until_complete, user_data);
    if (result != cudaSuccess) delete user_data;
    check_cuda(result, "cudaLaunchHostFunc (host event wait)");
  }

  std::shared_ptr<Shared> shared_;
  std::shared_ptr<StreamHistory> history_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = true;  // false: borrowed (Accelerator::borrow_stream)
  // Held across each enqueue so that history positions follow device order.
  // Never taken by host functions (they may run while a submission blocks).
  std::mutex submit_mutex_;
};

// Rounds requests up so freed blocks can be reused by similar sizes.
size_t round_block(size_t nbytes) {
  constexpr size_t kSmall = 1 << 20;
  if (nbytes <= kSmall) return (std::max<size_t>(nbytes, 1) + 511) / 512 * 512;
  return (nbytes + kSmall - 1) / kSmall * kSmall;
}

WaitValue32Fn find_wait_value32() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t result =
      cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &found);
  if (result != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<WaitValue32Fn>(fn);
}

class CudaAccelerator final : public Accelerator {
 public:
  CudaAccelerator(int device, const AcceleratorOptions& options) : device_(device) {
    int count = 0;
    STRATA_CUDA_CHECK(cudaGetDeviceCount(&count));
    STRATA_CHECK(device >= 0 && device < count, kCuda, "cuda:{} requested but {} device(s) present",
                 device, count);
    DeviceGuard guard(device_);
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_name_ = prop.name;
    size_t free_nbytes = 0, total_nbytes = 0;
    STRATA_CUDA_CHECK(cudaMemGetInfo(&free_nbytes, &total_nbytes));
    // Every freed block is kept (cudaFree is expensive); the budget bounds the cache.
    blocks_.emplace(BlockCache::Options{options.memory_budget_nbytes ? options.memory_budget_nbytes : free_nbytes,
                                        0, /*cache_within_peak=*/false, name()});
    shared_ = std::make_shared<Shared>();
    shared_->device = device_;
    shared_->events = std::make_shared<EventPool>(device_);
    shared_->flags = std::make_shared<FlagPool>(device_);
    shared_->wait_value32 = find_wait_value32();
    if (kUserModuleLoading != nullptr && std::string_view(kUserModuleLoading) != "EAGER") {
      logger().warn("CUDA_MODULE_LOADING={}: kernels then load at their first launch, which can deadlock while a "
                    "stream waits on a host event; unset it (strata sets EAGER)",
                    kUserModuleLoading);
    }
    int pools = 0;
    STRATA_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_));
    if (pools != 0) {
      STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&alloc_stream_, cudaStreamNonBlocking));
    } else {
      logger().warn("cuda:{}: no stream-ordered allocator; dropping cached blocks calls cudaFree, which waits for "
                    "every stream (a stream held on a host event the caller is to signal would deadlock it)",
                    device_);
    }
  }

  ~CudaAccelerator() override {
    DeviceGuard guard(device_);
    // Streams are gone (they synchronized), so pending frees are due.
    for (const auto& [ptr, nbytes] : blocks_->all_blocks()) free_now(ptr);
    if (alloc_stream_ != nullptr) {
      cudaStreamSynchronize(alloc_stream_);
      cudaStreamDestroy(alloc_stream_);
    }
    for (auto& [ptr, nbytes] : pinned_) {
      cudaHostUnregister(ptr);
      free_locked_host(ptr, nbytes);
    }
  }

  Backend backend() const override { return Backend::kCuda; }
  std::string name() const override { return fmt::format("cuda:{} ({})", device_, device_name_); }
  int device() const { return device_; }

  // The lock guards bookkeeping only: the driver's allocation and release
  // (malloc_now, release_blocks) run after it is released, on a block
  // reserved under it.
  void* allocate(size_t nbytes) override {
    const size_t block = round_block(nbytes);
    BlockCache::Freed dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (void* ptr = blocks_->reserve(nbytes, block, dropped)) return ptr;
    }
    void* ptr = nullptr;
    try {
      release_blocks(dropped);
      ptr = cuda_malloc(block, nbytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_->cancel(block);
      throw;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_->commit(ptr, block);
    return ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    BlockCache::Freed freed;  // stays empty: every block is kept
    std::lock_guard<std::mutex> lock(mutex_);
    // The caller guarantees no queued work uses the block (see accelerator.h).
    blocks_->free(ptr, freed, "deallocate");
  }

  void deallocate_after(void* ptr, Event& event) override {
    if (ptr == nullptr) return;
    std::shared_ptr<ErrorSource> completion;  // nullptr: complete already
    if (auto* cuda_event = dynamic_cast<CudaEvent*>(&event)) {
      completion = cuda_event->point();
    } else if (auto* host_event = dynamic_cast<CudaHostEvent*>(&event)) {
      completion = host_event->state();
    } else {
      raise(ErrorCategory::kBadArgument, "{} deallocate_after: the event is not from the cuda backend", name());
    }
    std::function<bool()> done;  // queries the event: never blocks, never synchronizes
    if (completion) done = [completion] { return completion->completed(); };
    BlockCache::Freed freed;  // stays empty: every block is kept
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_->free_after(ptr, std::move(done), freed, "deallocate_after");
  }

  MemoryStats memory_stats() const override {
    BlockCache::Freed freed;  // stays empty: every block is kept
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_->reap(freed);
    return blocks_->stats();
  }

  // Pinned memory is our own locked host memory (huge-page backed when large,
  // host_memory.h) registered with CUDA, not cudaHostAlloc's: that one is made
  // of scattered 4 KiB pages, which split every NVMe request that lands in it
  // (bench/strata-io/PERFORMANCE.md).
  void* allocate_pinned(size_t nbytes) override {
    DeviceGuard guard(device_);
    const size_t size = std::max<size_t>(nbytes, 1);
    void* ptr = allocate_locked_host(size);
    const cudaError_t result = cudaHostRegister(ptr, size, cudaHostRegisterPortable);
    if (result != cudaSuccess) {
      cudaGetLastError();
      free_locked_host(ptr, size);
      raise(ErrorCategory::kOutOfMemory, "cudaHostRegister of {} pinned bytes: {}", nbytes,
            cudaGetErrorString(result));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_.emplace(ptr, size);
    return ptr;
  }

  void deallocate_pinned(void* ptr) override {
    if (ptr == nullptr) return;
    size_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pinned_.find(ptr);
      STRATA_CHECK(it != pinned_.end(), kInternal, "deallocate_pinned of unknown pointer {}", ptr);
      size = it->second;
      pinned_.erase(it);
    }
    STRATA_CUDA_CHECK(cudaHostUnregister(ptr));
    free_locked_host(ptr, size);
  }

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CudaStream>(shared_); }
  std::unique_ptr<Stream> borrow_stream(void* native) override {
    STRATA_CHECK(native != nullptr, kBadArgument,
                 "borrow_stream: the stream handle is NULL (CUDA's legacy default stream cannot be borrowed: pass "
                 "the stream the work runs on, e.g. torch.cuda.current_stream().cuda_stream)");
    return std::make_unique<CudaStream>(shared_, static_cast<cudaStream_t>(native));
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(); }
  std::unique_ptr<HostEvent> create_host_event() override { return std::make_unique<CudaHostEvent>(shared_); }

  void copy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream& stream) override {
    static constexpr cudaMemcpyKind kKinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                                cudaMemcpyDeviceToDevice, cudaMemcpyHostToHost};
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kKinds[static_cast<int>(kind)],
                                      static_cast<cudaStream_t>(stream.native_handle())));
  }

  void memset_async(void* dst, int value, size_t nbytes, Stream& stream) override {
    STRATA_CUDA_CHECK(
        cudaMemsetAsync(dst, value, nbytes, static_cast<cudaStream_t>(stream.native_handle())));
  }

 private:
  // Returns blocks no queued work uses (cached ones) to the driver. Without
  // the lock. A cudaFree here waited for the whole device — a stream parked on
  // a host event that this thread signals later never got there: deadlock.
  // cudaFreeAsync on the allocator's own stream waits for nothing but that
  // stream, and synchronizing it hands the pool's memory back (its release
  // threshold is 0), so the budget still means memory the driver has.
  void release_blocks(const BlockCache::Freed& blocks) {
    if (blocks.empty()) return;
    DeviceGuard guard(device_);
    for (const auto& [ptr, nbytes] : blocks) STRATA_CUDA_CHECK(free_now(ptr));
    if (alloc_stream_ != nullptr) STRATA_CUDA_CHECK(cudaStreamSynchronize(alloc_stream_));
  }

  cudaError_t free_now(void* ptr) {
    return alloc_stream_ != nullptr ? cudaFreeAsync(ptr, alloc_stream_) : cudaFree(ptr);
  }

  // A block from the driver, usable by every stream on return.
  cudaError_t malloc_now(void** ptr, size_t nbytes) {
    if (alloc_stream_ == nullptr) return cudaMalloc(ptr, nbytes);
    const cudaError_t result = cudaMallocAsync(ptr, nbytes, alloc_stream_);
    return result != cudaSuccess ? result : cudaStreamSynchronize(alloc_stream_);
  }

  // Without the lock; the block is reserved in the budget already.
  void* cuda_malloc(size_t block, size_t requested) {
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    cudaError_t result = malloc_now(&ptr, block);
    if (result == cudaErrorMemoryAllocation) {
      // The device is fuller than the budget (other processes, fragmentation):
      // return the whole cache to the driver and retry once.
      cudaGetLastError();
      BlockCache::Freed dropped;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        dropped = blocks_->drop_cached();
      }
      release_blocks(dropped);
      result = malloc_now(&ptr, block);
    }
    if (result != cudaSuccess) {
      cudaGetLastError();
      raise(ErrorCategory::kOutOfMemory, "{}: cudaMalloc of {} bytes (requested {}) failed: {}",
            name(), block, requested, cudaGetErrorString(result));
    }
    return ptr;
  }

  const int device_;
  std::string device_name_;
  std::shared_ptr<Shared> shared_;
  // Where blocks are taken from and returned to the device's default memory
  // pool (never waits on a host event); nullptr without memory pools.
  cudaStream_t alloc_stream_ = nullptr;
  mutable std::mutex mutex_;
  // The budget, live, pending and cached blocks (core/block_cache.h); set once
  // the device's free memory is known. mutable: memory_stats() observes
  // completed stream-ordered frees.
  mutable std::optional<BlockCache> blocks_;
  std::unordered_map<void*, size_t> pinned_;
};

}  // namespace

WatchedWork::WatchedWork(std::unique_ptr<Event> done) : done_(std::move(done)) {}
WatchedWork::~WatchedWork() = default;

bool WatchedWork::decided() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::kPending && done_->query()) state_ = State::kSucceeded;
  return state_ != State::kPending;
}

bool WatchedWork::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ != State::kPending) return false;
  // Checked under the lock, so error() and the watcher agree on the outcome.
  if (done_->query()) {
    state_ = State::kSucceeded;
    return false;
  }
  state_ = State::kFailed;
  error_ = std::move(error);
  return true;
}

std::exception_ptr WatchedWork::error() {
  std::lock_guard<std::mutex> lock(mutex_);
  // The work completed (precondition) and the watcher had not failed it: the
  // watcher fails work before it makes the device end it, so this is success.
  if (state_ == State::kPending) state_ = State::kSucceeded;
  return error_;
}

std::exception_ptr WatchedWork::decided_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == State::kFailed ? error_ : nullptr;
}

bool WatchedWork::completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ != State::kPending || done_->query();
}

void attach_error_source(Stream& stream, std::shared_ptr<ErrorSource> source) {
  auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
  STRATA_CHECK(cuda_stream != nullptr, kBadArgument, "attach_error_source needs a cuda stream");
  cuda_stream->attach(std::move(source));
}

int device_index(const Accelerator& accelerator) {
  const auto* cuda = dynamic_cast<const CudaAccelerator*>(&accelerator);
  STRATA_CHECK(cuda != nullptr, kBadArgument, "{} is not a cuda accelerator", accelerator.name());
  return cuda->device();
}

}  // namespace cuda_internal

bool cuda_built() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

CudaInfo cuda_info() {
  CudaInfo info;
  info.built = true;
  cudaDriverGetVersion(&info.driver_version);
  cudaRuntimeGetVersion(&info.runtime_version);
  try {
    nccl::api().GetVersion(&info.nccl_version);  // 0 when no NCCL loads (doctor says so)
  } catch (const Error&) {
  }
  int cublas_version = 0;
  cublasHandle_t handle = nullptr;
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    info.error = cudaGetErrorString(result);
    cudaGetLastError();
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDeviceInfo device;
    device.index = i;
    device.name = prop.name;
    device.compute_major = prop.major;
    device.compute_minor = prop.minor;
    device.total_nbytes = prop.totalGlobalMem;
    char bus[32] = {};
    cudaDeviceGetPCIBusId(bus, sizeof(bus), i);
    device.pci_bus_id = bus;
    cudaSetDevice(i);
    size_t free_nbytes = 0, total = 0;
    if (cudaMemGetInfo(&free_nbytes, &total) == cudaSuccess) device.free_nbytes = free_nbytes;
    info.devices.push_back(device);
  }
  if (count > 0 && cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS) {
    cublasGetVersion(handle, &cublas_version);
    cublasDestroy(handle);
  }
  info.cublas_version = cublas_version;
  return info;
}

std::unique_ptr<Accelerator> make_cuda_accelerator(int device_index,
                                                   const AcceleratorOptions& options) {
  return std::make_unique<cuda_internal::CudaAccelerator>(device_index, options);
}

}  // namespace strata
