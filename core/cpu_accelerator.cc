// The cpu backend: device memory is host memory under a budget, a stream is an
// ordered work queue on its own thread, an event is a position in that queue,
// a host event is a flag and a condition variable.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/accelerator.h"
#include "core/block_cache.h"
#include "core/error.h"
#include "core/host_memory.h"

namespace strata {
namespace {

constexpr uint64_t kNoTicket = std::numeric_limits<uint64_t>::max();

// Shared between a stream and the events recorded on it, so that an event
// outlives neither correctness nor its stream's error. Tasks are numbered from
// 1 in submission order; the stream's error remembers which task raised it, so
// that an event before the failure does not report it.
struct QueueState {
  std::mutex mutex;
  std::condition_variable changed;
  uint64_t submitted = 0;  // tasks enqueued so far
  uint64_t completed = 0;  // tasks finished (run or skipped)
  std::exception_ptr error;          // the first error
  uint64_t error_ticket = kNoTicket;  // the task that raised it
};

// The first `ticket` tasks of a queue: what a recorded event stands for.
struct QueuePoint {
  std::shared_ptr<QueueState> queue;  // nullptr: never recorded (complete)
  uint64_t ticket = 0;

  bool done() const {
    if (!queue) return true;
    std::lock_guard<std::mutex> lock(queue->mutex);
    return queue->completed >= ticket;
  }
  void wait() const {
    if (!queue) return;
    std::unique_lock<std::mutex> lock(queue->mutex);
    queue->changed.wait(lock, [&] { return queue->completed >= ticket; });
  }
  // The error of the tasks up to the point, or nullptr.
  std::exception_ptr error() const {
    if (!queue) return nullptr;
    std::lock_guard<std::mutex> lock(queue->mutex);
    return queue->error_ticket <= ticket ? queue->error : nullptr;
  }
};

class CpuEvent final : public Event {
 public:
  void set(QueuePoint point) {
    std::lock_guard<std::mutex> lock(mutex_);
    point_ = std::move(point);
  }
  QueuePoint snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return point_;
  }
  void synchronize() override {
    const QueuePoint point = snapshot();
    point.wait();
    if (auto error = point.error()) std::rethrow_exception(error);
  }
  bool query() override { return snapshot().done(); }

 private:
  mutable std::mutex mutex_;
  QueuePoint point_;
};

// A host event's state, shared with the stream tasks and stream-ordered frees
// that wait on it, so that they survive the event object.
struct HostState {
  std::mutex mutex;
  std::condition_variable completed_cv;
  bool done = false;
  std::exception_ptr error;

  void complete(std::exception_ptr failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (done) return;  // single-use: the first completion wins
      done = true;
      error = std::move(failure);
    }
    completed_cv.notify_all();
  }
  bool is_done() {
    std::lock_guard<std::mutex> lock(mutex);
    return done;
  }
  bool done_without_error() {
    std::lock_guard<std::mutex> lock(mutex);
    return done && error == nullptr;
  }
  // Blocks until complete; returns its error or nullptr.
  std::exception_ptr wait() {
    std::unique_lock<std::mutex> lock(mutex);
    completed_cv.wait(lock, [&] { return done; });
    return error;
  }
};

std::exception_ptr null_failure_error() {
  return std::make_exception_ptr(Error(ErrorCategory::kBadArgument, "HostEvent::fail called with a null error"));
}

class CpuHostEvent final : public HostEvent {
 public:
  CpuHostEvent() : state_(std::make_shared<HostState>()) {}
  ~CpuHostEvent() override {
    state_->complete(std::make_exception_ptr(
        Error(ErrorCategory::kInternal, "a host event was destroyed before it was signalled or failed")));
  }
  void signal() override { state_->complete(nullptr); }
  void fail(std::exception_ptr error) override { state_->complete(error ? error : null_failure_error()); }
  void synchronize() override {
    if (auto error = state_->wait()) std::rethrow_exception(error);
  }
  bool query() override { return state_->is_done(); }
  const std::shared_ptr<HostState>& state() const { return state_; }

 private:
  std::shared_ptr<HostState> state_;
};

// One thread that runs the host functions of every stream that shares it, one
// at a time, as CUDA's driver runs every stream's host functions on its single
// callback thread (AcceleratorOptions::cpu_shared_host_thread). A stream's own
// thread hands its host function over and waits for it, so the stream is held
// up by it just as a CUDA stream is.
class SharedHostThread {
 public:
  SharedHostThread() : worker_([this] { run(); }) {}
  ~SharedHostThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    worker_.join();
  }
  SharedHostThread(const SharedHostThread&) = delete;
  SharedHostThread& operator=(const SharedHostThread&) = delete;

  // Runs fn on the shared thread after the host functions handed over before
  // it; returns when it has run, rethrowing what it threw.
  void run_and_wait(std::function<void()>& fn) {
    std::packaged_task<void()> task(std::move(fn));
    std::future<void> done = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    changed_.notify_all();
    done.get();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      std::packaged_task<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();  // its exception goes to the waiting stream through the future
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::packaged_task<void()>> tasks_;  // guarded by mutex_
  bool stopping_ = false;                          // guarded by mutex_
  std::thread worker_;
};

class CpuStream final : public Stream {
 public:
  // host_thread: where this stream's host functions run (nullptr: on its own thread).
  explicit CpuStream(std::shared_ptr<SharedHostThread> host_thread)
      : state_(std::make_shared<QueueState>()), host_thread_(std::move(host_thread)), worker_([this] { run(); }) {}
  ~CpuStream() override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      stopping_ = true;
    }
    state_->changed.notify_all();
    worker_.join();
  }

  void record(Event& event) override {
    auto* cpu_event = dynamic_cast<CpuEvent*>(&event);
    if (cpu_event == nullptr) raise_foreign(event, "record");
    std::lock_guard<std::mutex> lock(state_->mutex);
    cpu_event->set(QueuePoint{state_, state_->submitted});
  }

  void wait(Event& event) override {
    // Snapshot the event's position now (as cudaStreamWaitEvent does), then
    // block this stream's thread on it; its error becomes this stream's.
    // An event already complete without error orders nothing: no task, so
    // that a caller synchronizing right after (the C API's fetch) does not
    // wait for this stream's thread to be scheduled only to pass a wait that
    // is over. (A failed one is still enqueued: its error becomes ours.)
    if (auto* cpu_event = dynamic_cast<CpuEvent*>(&event)) {
      QueuePoint point = cpu_event->snapshot();
      if (!point.queue) return;  // never recorded: complete
      if (point.done() && point.error() == nullptr) return;
      enqueue([point] {
        point.wait();
        if (auto error = point.error()) std::rethrow_exception(error);
      });
    } else if (auto* host_event = dynamic_cast<CpuHostEvent*>(&event)) {
      if (host_event->state()->done_without_error()) return;
      enqueue([state = host_event->state()] {
        if (auto error = state->wait()) std::rethrow_exception(error);
      });
    } else {
      raise_foreign(event, "wait on");
    }
  }

  void launch_host_func(std::function<void()> fn) override {
    if (!host_thread_) return enqueue(std::move(fn));
    enqueue([host_thread = host_thread_, fn = std::move(fn)]() mutable { host_thread->run_and_wait(fn); });
  }

  // Appends work to this stream's own queue: copies, memsets and waits (on
  // cuda the device's, never the host-function thread's), and host functions.
  void enqueue(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      tasks_.push_back(std::move(fn));
      ++state_->submitted;
    }
    state_->changed.notify_all();
  }

  void synchronize() override {
    uint64_t target = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      target = state_->submitted;
    }
    const QueuePoint point{state_, target};
    point.wait();
    if (auto error = point.error()) std::rethrow_exception(error);
  }

  void* native_handle() override { return nullptr; }

 private:
  [[noreturn]] static void raise_foreign(Event& event, const char* what) {
    if (dynamic_cast<HostEvent*>(&event) != nullptr) {
      raise(ErrorCategory::kBadArgument, "cpu stream: cannot {} a host event that is not from the cpu backend", what);
    }
    raise(ErrorCategory::kBadArgument,
          "cpu stream: cannot {} an event that is not from the cpu backend (host events cannot be recorded)", what);
  }

  void run() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (;;) {
      state_->changed.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      const uint64_t ticket = state_->completed + 1;
      // After the stream's first error, later work is skipped.
      const bool failed = state_->error != nullptr;
      lock.unlock();
      std::exception_ptr error;
      if (!failed) {
        try {
          task();
        } catch (...) {
          error = std::current_exception();
        }
      }
      task = nullptr;  // release captures (events, buffers) outside the lock
      lock.lock();
      if (error && !state_->error) {
        state_->error = error;
        state_->error_ticket = ticket;
      }
      ++state_->completed;
      state_->changed.notify_all();
    }
  }

  std::shared_ptr<QueueState> state_;
  std::shared_ptr<SharedHostThread> host_thread_;  // nullptr: host functions on worker_
  std::deque<std::function<void()>> tasks_;  // guarded by state_->mutex
  bool stopping_ = false;                    // guarded by state_->mutex
  std::thread worker_;
};

size_t default_budget() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  return static_cast<size_t>(pages) * static_cast<size_t>(page_size) / 2;
}

class CpuAccelerator final : public Accelerator {
 public:
  explicit CpuAccelerator(const AcceleratorOptions& options)
      : blocks_({options.memory_budget_nbytes ? options.memory_budget_nbytes : default_budget(),
                 kCachedMinNbytes, /*cache_within_peak=*/true, "cpu"}),
        host_thread_(options.cpu_shared_host_thread ? std::make_shared<SharedHostThread>() : nullptr) {}

  ~CpuAccelerator() override {
    // Streams were destroyed first (they drain), so pending frees are due.
    free_blocks(blocks_.all_blocks());
  }

  Backend backend() const override { return Backend::kCpu; }
  std::string name() const override { return "cpu"; }

  void* allocate(size_t nbytes) override {
    BlockCache::Freed dropped;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ptr = blocks_.reserve(nbytes, nbytes, dropped);
      if (ptr == nullptr) {
        try {
          ptr = allocate_host(nbytes);
        } catch (...) {
          blocks_.cancel(nbytes);
          free_blocks(dropped);
          throw;
        }
        blocks_.commit(ptr, nbytes);
      }
    }
    free_blocks(dropped);
    return ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    BlockCache::Freed freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.free(ptr, freed, "deallocate");
    }
    free_blocks(freed);
  }

  void deallocate_after(void* ptr, Event& event) override {
    if (ptr == nullptr) return;
    std::function<bool()> done;  // empty: already complete
    if (auto* cpu_event = dynamic_cast<CpuEvent*>(&event)) {
      QueuePoint point = cpu_event->snapshot();
      if (point.queue) done = [point] { return point.done(); };
    } else if (auto* host_event = dynamic_cast<CpuHostEvent*>(&event)) {
      done = [state = host_event->state()] { return state->is_done(); };
    } else {
      raise(ErrorCategory::kBadArgument, "cpu deallocate_after: the event is not from the cpu backend");
    }
    BlockCache::Freed freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.free_after(ptr, std::move(done), freed, "deallocate_after");
    }
    free_blocks(freed);
  }

  MemoryStats memory_stats() const override {
    BlockCache::Freed freed;
    MemoryStats stats;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.reap(freed);
      stats = blocks_.stats();
    }
    free_blocks(freed);
    return stats;
  }

  void* allocate_pinned(size_t nbytes) override {
    void* ptr = allocate_locked_host(nbytes);
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_.emplace(ptr, nbytes);
    return ptr;
  }

  void deallocate_pinned(void* ptr) override {
    if (ptr == nullptr) return;
    size_t nbytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pinned_.find(ptr);
      STRATA_CHECK(it != pinned_.end(), kInternal, "deallocate_pinned of unknown pointer {}", ptr);
      nbytes = it->second;
      pinned_.erase(it);
    }
    free_locked_host(ptr, nbytes);
  }

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CpuStream>(host_thread_); }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CpuEvent>(); }
  std::unique_ptr<HostEvent> create_host_event() override { return std::make_unique<CpuHostEvent>(); }

  void copy_async(void* dst, const void* src, size_t nbytes, CopyKind /*kind*/,
                  Stream& stream) override {
    cpu_stream(stream, "copy_async").enqueue([=] { std::memcpy(dst, src, nbytes); });
  }

  void memset_async(void* dst, int value, size_t nbytes, Stream& stream) override {
    cpu_stream(stream, "memset_async").enqueue([=] { std::memset(dst, value, nbytes); });
  }

 private:
  static CpuStream& cpu_stream(Stream& stream, const char* what) {
    auto* cpu = dynamic_cast<CpuStream*>(&stream);
    STRATA_CHECK(cpu != nullptr, kBadArgument, "cpu {}: the stream is not from the cpu backend", what);
    return *cpu;
  }

  static void free_blocks(const BlockCache::Freed& blocks) {
    for (const auto& [ptr, nbytes] : blocks) free_host(ptr, nbytes);
  }

  // Freed blocks of >= kOwnMapMinNbytes (allocate_host's own mappings: each
  // fresh one is page faults and kernel zeroing, every step, for every
  // gathered parameter, gradient and bucket) are kept for the next request of
  // their size while in use + cached stays within the peak (core/block_cache.h).
  static constexpr size_t kCachedMinNbytes = kOwnMapMinNbytes;
  mutable std::mutex mutex_;
  // mutable: memory_stats() observes completed stream-ordered frees.
  mutable BlockCache blocks_;
  std::unordered_map<void*, size_t> pinned_;
  // Shared by this accelerator's streams (cpu_shared_host_thread), else nullptr;
  // each stream holds it too, so it outlives the streams' last host function.
  std::shared_ptr<SharedHostThread> host_thread_;
};

}  // namespace

std::unique_ptr<Accelerator> make_cpu_accelerator(const AcceleratorOptions& options) {
  return std::make_unique<CpuAccelerator>(options);
}

}  // namespace strata
