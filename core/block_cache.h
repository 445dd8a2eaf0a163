// The budgeted block bookkeeping both accelerators share: every block handed
// out and its size, the blocks freed "after" stream work (kept until that work
// is seen complete), a cache of free blocks reused by requests of the same
// size, and the budget (capacity) that in-use plus cached bytes never exceed.
// A BlockCache never allocates or frees memory itself: the accelerator gets a
// block from its system allocator (mmap, cudaMallocAsync) after reserve(), and
// frees the blocks reserve(), free(), free_after() and reap() hand back in a
// `Freed` list — outside its own lock when freeing can wait (cudaFreeAsync
// and a stream synchronization).
//
// Policy (Options): which freed blocks are kept. The cpu accelerator keeps
// only its own >= 128 KiB mappings (each fresh one is page faults and kernel
// zeroing) and only while in use + cached stays within the peak in use, so
// caching never holds more memory than was once in use at the same time: a
// freed block that would pass the peak evicts the least recently cached
// blocks first (a step's transient sizes come back each micro-batch; a size
// used once per step, held in the cache, would otherwise push every other
// block back to the system); the cuda accelerator keeps every block (cudaFree
// is expensive), its cache bounded by the budget alone. Requests reuse a
// cached block of exactly their size: the caller rounds sizes into classes
// first (cuda does), so one huge block is never held for a small request.
//
// Thread-safety: none; the accelerator calls it under its own mutex.
// Errors: Error(kOutOfMemory) from reserve() saying what is in use, pending,
// cached and free; Error(kInternal) for a pointer that is not a live block.
#pragma once

#include <cstddef>
#include <functional>
#include <list>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/accelerator.h"

namespace strata {

class BlockCache {
 public:
  struct Options {
    size_t capacity = 0;           // the budget: in use + cached never exceed it
    size_t min_cached_nbytes = 0;  // smaller freed blocks go back to the system
    bool cache_within_peak = false;  // keep a freed block only while in use + cached <= the peak
    std::string device;              // for messages: "cpu", "cuda:0 (NVIDIA H100)"
  };
  // Blocks (pointer, size) the caller returns to its system allocator.
  using Freed = std::vector<std::pair<void*, size_t>>;

  explicit BlockCache(Options options);

  // A block of `block` bytes (`requested` as the caller asked, for messages):
  // a cached one of exactly that size, live on return; else nullptr, with the
  // block's bytes reserved in the budget and the cached blocks dropped to make
  // room appended to `to_free`. Then the caller allocates and calls commit(),
  // or cancel() when its allocator fails.
  void* reserve(size_t requested, size_t block, Freed& to_free);
  void commit(void* ptr, size_t block);
  void cancel(size_t block);

  // `ptr` (a live block) is free now: cached, or appended to `to_free`.
  void free(void* ptr, Freed& to_free, const char* what);
  // `ptr` is free once done() returns true (polled, must never block); until
  // then it stays in use. done empty: free now.
  void free_after(void* ptr, std::function<bool()> done, Freed& to_free, const char* what);
  // Frees the blocks free_after() holds whose done() is now true.
  void reap(Freed& to_free);

  // In use (pending frees included), peak, pending, cached, capacity.
  MemoryStats stats() const;
  // Every cached block, emptying the cache.
  Freed drop_cached();
  // Every block this cache knows (live, pending, cached): the accelerator's
  // destructor frees them once its streams have drained.
  Freed all_blocks() const;

 private:
  struct Pending {
    void* ptr;
    size_t nbytes;
    std::function<bool()> done;
  };
  std::unordered_map<void*, size_t>::iterator live(void* ptr, const char* what);
  // A block that left use: kept per the policy, else appended to to_free.
  void release(void* ptr, size_t nbytes, Freed& to_free);

  Options options_;
  size_t in_use_ = 0;  // live blocks, pending ones included
  size_t peak_ = 0;
  size_t pending_nbytes_ = 0;
  size_t cached_nbytes_ = 0;
  std::unordered_map<void*, size_t> live_;  // every block handed out and not yet free
  std::vector<Pending> pending_;
  std::unordered_set<void*> pending_ptrs_;
  struct Cached {
    size_t nbytes;
    void* ptr;
  };
  // Takes `it` out of the cache (both indexes below).
  void uncache(std::multimap<size_t, std::list<Cached>::iterator>::iterator it);
  std::list<Cached> cached_order_;  // free blocks, least recently cached first
  std::multimap<size_t, std::list<Cached>::iterator> cached_;  // the same blocks by size
};

}  // namespace strata
