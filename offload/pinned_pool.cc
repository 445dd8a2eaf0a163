// The pinned buffer pool: one allocation split into equal buffers, a free list
// and a condition variable for backpressure.
#include "offload/pinned_pool.h"

#include <algorithm>

#include "core/accelerator.h"
#include "core/error.h"
#include "core/host_memory.h"
#include "core/log.h"

namespace strata::offload {
namespace {

// runtime/config's format_size lives above offload in the layering.
std::string mib(size_t nbytes) { return fmt::format("{:.1f} MiB", static_cast<double>(nbytes) / (1 << 20)); }

}  // namespace

// The pool's memory and bookkeeping, shared by the pool and its leases so that
// a lease released after the pool was destroyed touches live memory.
namespace detail {
struct PinnedPoolState {
  PinnedPoolOptions options;
  Accelerator* accelerator = nullptr;
  void* base = nullptr;
  size_t total_nbytes = 0;

  mutable std::mutex mutex;
  std::condition_variable freed_cv;
  std::vector<size_t> free_list;  // indices of free buffers
  size_t waiting = 0;        // threads blocked in acquire
  PinnedPoolStats stats;

  ~PinnedPoolState() {
    if (accelerator != nullptr) {
      accelerator->deallocate_pinned(base);
    } else {
      free_locked_host(base, total_nbytes);
    }
  }

  void give_back(size_t index) {
    {
      std::lock_guard lock(mutex);
      free_list.push_back(index);
      --stats.in_use;
    }
    freed_cv.notify_one();
  }
};
}  // namespace detail

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::move(other.pool_);
    other.pool_ = nullptr;
    index_ = other.index_;
    data_ = std::exchange(other.data_, nullptr);
    nbytes_ = std::exchange(other.nbytes_, 0);
  }
  return *this;
}

void PinnedBuffer::release() {
  // Dropping pool_ last: this may be the last owner, freeing the memory.
  if (pool_ != nullptr) pool_->give_back(index_);
  data_ = nullptr;
  nbytes_ = 0;
  pool_ = nullptr;
}

PinnedBufferPool::PinnedBufferPool(const PinnedPoolOptions& options, Accelerator* accelerator)
    : state_(std::make_shared<detail::PinnedPoolState>()) {
  detail::PinnedPoolState& s = *state_;
  s.options = options;
  STRATA_CHECK(s.options.buffer_count > 0, kBadArgument, "{}: buffer_count must be > 0", s.options.name);
  STRATA_CHECK(s.options.buffer_nbytes > 0, kBadArgument, "{}: buffer size must be > 0", s.options.name);
  s.options.buffer_nbytes = (s.options.buffer_nbytes + kPageNbytes - 1) / kPageNbytes * kPageNbytes;
  s.total_nbytes = s.options.buffer_nbytes * s.options.buffer_count;
  // One allocation: one mlock / cudaHostAlloc, one region to register for I/O.
  // The accelerator is set only once the memory exists (the state's destructor frees through it).
  s.base = accelerator != nullptr ? accelerator->allocate_pinned(s.total_nbytes)
                                  : allocate_locked_host(s.total_nbytes);
  s.accelerator = accelerator;
  s.free_list.reserve(s.options.buffer_count);
  for (size_t i = s.options.buffer_count; i-- > 0;) s.free_list.push_back(i);
  s.stats.buffer_count = s.options.buffer_count;
  s.stats.buffer_nbytes = s.options.buffer_nbytes;
}

PinnedBufferPool::~PinnedBufferPool() {
  std::lock_guard lock(state_->mutex);
  if (state_->stats.in_use != 0) {
    logger().error("{} destroyed with {} buffer(s) still leased; their memory is freed when the last is released",
                   state_->options.name, state_->stats.in_use);
  }
}

PinnedBuffer PinnedBufferPool::acquire() { return acquire_for(state_->options.acquire_timeout); }

PinnedBuffer PinnedBufferPool::acquire_for(std::chrono::milliseconds timeout) {
  detail::PinnedPoolState& s = *state_;
  std::unique_lock lock(s.mutex);
  if (s.free_list.empty()) {
    const auto start = std::chrono::steady_clock::now();
    ++s.waiting;
    const bool got = s.freed_cv.wait_for(lock, timeout, [&] { return !s.free_list.empty(); });
    --s.waiting;
    s.stats.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++s.stats.waited;
    if (!got) {
      ++s.stats.timeouts;
      // This request plus every other blocked one needed a buffer none could get.
      const size_t short_by = s.waiting + 1;
      raise(ErrorCategory::kOutOfMemory,
            "{} exhausted: all {} buffers of {} stayed in use for {} ms; the pool is too small by "
            "at least {} buffer(s) ({}) — raise buffer_count to {} or more",
            s.options.name, s.options.buffer_count, mib(s.options.buffer_nbytes),
            timeout.count(), short_by, mib(short_by * s.options.buffer_nbytes),
            s.options.buffer_count + short_by);
    }
  }
  return take_locked();
}

PinnedBuffer PinnedBufferPool::take_locked() {
  detail::PinnedPoolState& s = *state_;
  const size_t index = s.free_list.back();
  s.free_list.pop_back();
  ++s.stats.acquires;
  ++s.stats.in_use;
  s.stats.peak_in_use = std::max(s.stats.peak_in_use, s.stats.in_use);
  return PinnedBuffer(state_, index, static_cast<char*>(s.base) + index * s.options.buffer_nbytes,
                      s.options.buffer_nbytes);
}

std::optional<PinnedBuffer> PinnedBufferPool::try_acquire() {
  std::lock_guard lock(state_->mutex);
  if (state_->free_list.empty()) return std::nullopt;
  return take_locked();
}

size_t PinnedBufferPool::buffer_count() const { return state_->options.buffer_count; }
size_t PinnedBufferPool::buffer_nbytes() const { return state_->options.buffer_nbytes; }

size_t PinnedBufferPool::available() const {
  std::lock_guard lock(state_->mutex);
  return state_->free_list.size();
}

PinnedPoolStats PinnedBufferPool::stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->stats;
}

std::vector<iovec> PinnedBufferPool::regions() const {
  const detail::PinnedPoolState& s = *state_;
  std::vector<iovec> out;
  for (size_t i = 0; i < s.options.buffer_count; ++i) {
    char* buffer = static_cast<char*>(s.base) + i * s.options.buffer_nbytes;
    for (size_t done = 0; done < s.options.buffer_nbytes; done += kMaxRegionNbytes) {
      out.push_back(iovec{buffer + done, std::min(kMaxRegionNbytes, s.options.buffer_nbytes - done)});
    }
  }
  return out;
}

}  // namespace strata::offload
