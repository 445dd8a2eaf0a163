// The cpu backend: device memory is host memory under a budget, a stream is an
// ordered work queue on its own thread, an event is a position in that queue.
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "runtime/core/accelerator.h"
#include "runtime/core/error.h"
#include "runtime/core/host_memory.h"

namespace strata {
namespace {

// Shared between a stream and the events recorded on it, so that an event
// outlives neither correctness nor its stream's error.
struct QueueState {
  std::mutex mutex;
  std::condition_variable changed;
  uint64_t submitted = 0;  // tasks enqueued so far
  uint64_t completed = 0;  // tasks finished (run or skipped)
  ErrorSlot error;
};

class CpuEvent final : public Event {
 public:
  void set(std::shared_ptr<QueueState> queue, uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_ = std::move(queue);
    ticket_ = ticket;
  }
  void synchronize() override {
    auto [queue, ticket] = snapshot();
    if (!queue) return;
    std::unique_lock<std::mutex> lock(queue->mutex);
    queue->changed.wait(lock, [&] { return queue->completed >= ticket; });
    lock.unlock();
    queue->error.rethrow_if_set();
  }
  bool query() override {
    auto [queue, ticket] = snapshot();
    if (!queue) return true;
    std::lock_guard<std::mutex> lock(queue->mutex);
    return queue->completed >= ticket;
  }
  std::pair<std::shared_ptr<QueueState>, uint64_t> snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {queue_, ticket_};
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<QueueState> queue_;
  uint64_t ticket_ = 0;
};

class CpuStream final : public Stream {
 public:
  CpuStream() : state_(std::make_shared<QueueState>()), worker_([this] { run(); }) {}
  ~CpuStream() override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      stopping_ = true;
    }
    state_->changed.notify_all();
    worker_.join();
  }

  void record(Event& event) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    static_cast<CpuEvent&>(event).set(state_, state_->submitted);
  }

  void wait(Event& event) override {
    // Snapshot the event's current position now (as cudaStreamWaitEvent does),
    // then block this stream's thread on it. A failure upstream fails this stream.
    auto [queue, ticket] = static_cast<CpuEvent&>(event).snapshot();
    launch_host_func([queue, ticket] {
      CpuEvent position;
      position.set(queue, ticket);
      position.synchronize();
    });
  }

  void launch_host_func(std::function<void()> fn) override {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      tasks_.push_back(std::move(fn));
      ++state_->submitted;
    }
    state_->changed.notify_all();
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lock(state_->mutex);
    const uint64_t target = state_->submitted;
    state_->changed.wait(lock, [&] { return state_->completed >= target; });
    lock.unlock();
    state_->error.rethrow_if_set();
  }

  void* native_handle() override { return nullptr; }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (;;) {
      state_->changed.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      if (!state_->error.has_error()) {
        try {
          task();
        } catch (...) {
          state_->error.set(std::current_exception());
        }
      }
      lock.lock();
      ++state_->completed;
      state_->changed.notify_all();
    }
  }

  std::shared_ptr<QueueState> state_;
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
      : capacity_(options.memory_budget_nbytes ? options.memory_budget_nbytes : default_budget()) {}

  ~CpuAccelerator() override {
    for (auto& [ptr, nbytes] : allocations_) std::free(ptr);
  }

  Backend backend() const override { return Backend::kCpu; }
  std::string name() const override { return "cpu"; }

  void* allocate(size_t nbytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (nbytes > capacity_ - in_use_) {
      raise(ErrorCategory::kOutOfMemory,
            "cpu device memory: requested {} bytes, {} in use, capacity {} ({} free)", nbytes,
            in_use_, capacity_, capacity_ - in_use_);
    }
    void* ptr = std::aligned_alloc(256, (std::max<size_t>(nbytes, 1) + 255) / 256 * 256);
    if (ptr == nullptr) {
      raise(ErrorCategory::kOutOfMemory, "cpu device memory: host allocation of {} bytes failed",
            nbytes);
    }
    allocations_.emplace(ptr, nbytes);
    in_use_ += nbytes;
    peak_ = std::max(peak_, in_use_);
    return ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = allocations_.find(ptr);
    STRATA_CHECK(it != allocations_.end(), kInternal, "cpu deallocate of unknown pointer {}", ptr);
    in_use_ -= it->second;
    allocations_.erase(it);
    std::free(ptr);
  }

  MemoryStats memory_stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return MemoryStats{capacity_, in_use_, peak_, 0};
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

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CpuStream>(); }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CpuEvent>(); }

  void copy_async(void* dst, const void* src, size_t nbytes, CopyKind /*kind*/,
                  Stream& stream) override {
    stream.launch_host_func([=] { std::memcpy(dst, src, nbytes); });
  }

  void memset_async(void* dst, int value, size_t nbytes, Stream& stream) override {
    stream.launch_host_func([=] { std::memset(dst, value, nbytes); });
  }

 private:
  mutable std::mutex mutex_;
  const size_t capacity_;
  size_t in_use_ = 0;
  size_t peak_ = 0;
  std::unordered_map<void*, size_t> allocations_;
  std::unordered_map<void*, size_t> pinned_;
};

}  // namespace

std::unique_ptr<Accelerator> make_cpu_accelerator(const AcceleratorOptions& options) {
  return std::make_unique<CpuAccelerator>(options);
}

}  // namespace strata
