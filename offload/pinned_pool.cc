// The pinned buffer pool: one allocation split into equal buffers, a free list
// and a condition variable for backpressure.
#include "offload/pinned_pool.h"

#include <algorithm>

#include "runtime/core/accelerator.h"
#include "runtime/core/error.h"
#include "runtime/core/host_memory.h"
#include "runtime/core/log.h"

namespace strata::offload {
namespace {

// runtime/config's format_size lives above offload in the layering.
std::string mib(size_t nbytes) { return fmt::format("{:.1f} MiB", static_cast<double>(nbytes) / (1 << 20)); }

}  // namespace

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = other.index_;
    data_ = std::exchange(other.data_, nullptr);
    nbytes_ = std::exchange(other.nbytes_, 0);
  }
  return *this;
}

void PinnedBuffer::release() {
  if (pool_ != nullptr) pool_->give_back(index_);
  pool_ = nullptr;
  data_ = nullptr;
  nbytes_ = 0;
}

PinnedBufferPool::PinnedBufferPool(const PinnedPoolOptions& options, Accelerator* accelerator)
    : options_(options), accelerator_(accelerator) {
  STRATA_CHECK(options_.buffer_count > 0, kBadArgument, "{}: buffer_count must be > 0", options_.name);
  STRATA_CHECK(options_.buffer_nbytes > 0, kBadArgument, "{}: buffer size must be > 0", options_.name);
  options_.buffer_nbytes = (options_.buffer_nbytes + kPageNbytes - 1) / kPageNbytes * kPageNbytes;
  total_nbytes_ = options_.buffer_nbytes * options_.buffer_count;
  // One allocation: one mlock / cudaHostAlloc, one region to register for I/O.
  base_ = accelerator_ != nullptr ? accelerator_->allocate_pinned(total_nbytes_)
                                  : allocate_locked_host(total_nbytes_);
  free_.reserve(options_.buffer_count);
  for (size_t i = options_.buffer_count; i-- > 0;) free_.push_back(i);
  stats_.buffer_count = options_.buffer_count;
  stats_.buffer_nbytes = options_.buffer_nbytes;
}

PinnedBufferPool::~PinnedBufferPool() {
  {
    std::lock_guard lock(mutex_);
    if (stats_.in_use != 0) {
      logger().error("{} destroyed with {} buffer(s) still leased", options_.name, stats_.in_use);
    }
  }
  if (accelerator_ != nullptr) {
    accelerator_->deallocate_pinned(base_);
  } else {
    free_locked_host(base_, total_nbytes_);
  }
}

PinnedBuffer PinnedBufferPool::acquire() { return acquire_for(options_.acquire_timeout); }

PinnedBuffer PinnedBufferPool::acquire_for(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (free_.empty()) {
    const auto start = std::chrono::steady_clock::now();
    ++waiting_;
    const bool got = freed_cv_.wait_for(lock, timeout, [&] { return !free_.empty(); });
    --waiting_;
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++stats_.waited;
    if (!got) {
      ++stats_.timeouts;
      // This request plus every other blocked one needed a buffer none could get.
      const size_t short_by = waiting_ + 1;
      raise(ErrorCategory::kOutOfMemory,
            "{} exhausted: all {} buffers of {} stayed in use for {} ms; the pool is too small by "
            "at least {} buffer(s) ({}) — raise buffer_count to {} or more",
            options_.name, options_.buffer_count, mib(options_.buffer_nbytes),
            timeout.count(), short_by, mib(short_by * options_.buffer_nbytes),
            options_.buffer_count + short_by);
    }
  }
  return take_locked();
}

std::optional<PinnedBuffer> PinnedBufferPool::try_acquire() {
  std::lock_guard lock(mutex_);
  if (free_.empty()) return std::nullopt;
  return take_locked();
}

void PinnedBufferPool::give_back(size_t index) {
  {
    std::lock_guard lock(mutex_);
    free_.push_back(index);
    --stats_.in_use;
  }
  freed_cv_.notify_one();
}

size_t PinnedBufferPool::available() const {
  std::lock_guard lock(mutex_);
  return free_.size();
}

PinnedPoolStats PinnedBufferPool::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

PinnedBuffer PinnedBufferPool::take_locked() {
  const size_t index = free_.back();
  free_.pop_back();
  ++stats_.acquires;
  ++stats_.in_use;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
  return PinnedBuffer(this, index, static_cast<char*>(base_) + index * options_.buffer_nbytes,
                      options_.buffer_nbytes);
}

std::vector<iovec> PinnedBufferPool::regions() const {
  std::vector<iovec> out;
  for (size_t i = 0; i < options_.buffer_count; ++i) {
    char* buffer = static_cast<char*>(base_) + i * options_.buffer_nbytes;
    for (size_t done = 0; done < options_.buffer_nbytes; done += kMaxRegionNbytes) {
      out.push_back(iovec{buffer + done, std::min(kMaxRegionNbytes, options_.buffer_nbytes - done)});
    }
  }
  return out;
}

}  // namespace strata::offload
