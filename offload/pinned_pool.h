// The pinned buffer pool (DESIGN.md §6): a fixed number of fixed-size host
// buffers allocated once — cudaHostAlloc through the accelerator when CUDA is
// active, otherwise page-aligned and mlocked — handed out and returned, so
// pinned memory is bounded by configuration, not by model size.
//
// Thread-safety: every method of PinnedBufferPool may be called from any thread;
// a PinnedBuffer is used by one thread at a time.
// Ownership: the pool and its leases share the memory: a PinnedBuffer is a
// move-only lease that returns its buffer when destroyed or released, and the
// memory is freed when the pool and every lease are gone. Destroying the pool
// with leases outstanding logs an error (it usually means buffers are still
// in I/O), but the leased memory stays valid until each lease is released.
// An accelerator that provides the memory must outlive the pool and every lease.
// Errors: the constructor throws Error(kBadArgument) for a zero count or size
// and Error(kOutOfMemory) when allocation fails; acquire() throws
// Error(kOutOfMemory) after its timeout, saying by how much the pool is too small.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace strata {
class Accelerator;
}

namespace strata::offload {

struct PinnedPoolOptions {
  size_t buffer_count = 4;
  size_t buffer_nbytes = size_t{64} << 20;  // rounded up to 4096
  // How long acquire() waits for a buffer before declaring the pool too small.
  std::chrono::milliseconds acquire_timeout{60000};
  std::string name = "pinned pool";  // for messages
};

struct PinnedPoolStats {
  size_t buffer_count = 0;
  size_t buffer_nbytes = 0;
  size_t in_use = 0;          // buffers leased now
  size_t peak_in_use = 0;     // most buffers leased at once
  uint64_t acquires = 0;      // successful acquires
  uint64_t waited = 0;        // acquires that had to block (backpressure)
  uint64_t timeouts = 0;      // acquires that gave up
  double wait_seconds = 0;    // total time spent blocked in acquire
};

class PinnedBufferPool;
namespace detail {
struct PinnedPoolState;
}

// A leased buffer. Move-only; returns the buffer to the pool on destruction or release().
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { release(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t nbytes() const { return nbytes_; }
  size_t index() const { return index_; }
  bool valid() const { return pool_ != nullptr; }
  void release();

 private:
  friend class PinnedBufferPool;
  PinnedBuffer(std::shared_ptr<detail::PinnedPoolState> pool, size_t index, void* data, size_t nbytes)
      : pool_(std::move(pool)), index_(index), data_(data), nbytes_(nbytes) {}
  // Shared with the pool: keeps the memory (and the free list it returns to) alive.
  std::shared_ptr<detail::PinnedPoolState> pool_;
  size_t index_ = 0;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
};

class PinnedBufferPool {
 public:
  // accelerator: when given, memory comes from its allocate_pinned (cudaHostAlloc
  // for cuda) and it must outlive the pool and its leases; nullptr:
  // allocate_locked_host.
  explicit PinnedBufferPool(const PinnedPoolOptions& options, Accelerator* accelerator = nullptr);
  ~PinnedBufferPool();
  PinnedBufferPool(const PinnedBufferPool&) = delete;
  PinnedBufferPool& operator=(const PinnedBufferPool&) = delete;

  // Blocks until a buffer is free (backpressure), up to options.acquire_timeout.
  PinnedBuffer acquire();
  PinnedBuffer acquire_for(std::chrono::milliseconds timeout);
  // A buffer if one is free now.
  std::optional<PinnedBuffer> try_acquire();

  size_t buffer_count() const;
  size_t buffer_nbytes() const;
  size_t available() const;
  PinnedPoolStats stats() const;
  // The pool's memory as regions to register with io_uring: one per buffer, a
  // buffer over kMaxRegionNbytes split into pieces of that size (the kernel
  // refuses a larger fixed buffer). A transfer of a block size that divides
  // kMaxRegionNbytes never straddles two regions.
  static constexpr size_t kMaxRegionNbytes = size_t{1} << 30;
  std::vector<iovec> regions() const;

 private:
  // Hands out the last free buffer; the state's mutex held and a buffer free.
  PinnedBuffer take_locked();
  std::shared_ptr<detail::PinnedPoolState> state_;
};

}  // namespace strata::offload
