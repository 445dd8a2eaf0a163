// BlockCache: the budget, the live and pending blocks, the cache.
#include "core/block_cache.h"

#include <algorithm>
#include <iterator>

#include "core/error.h"

namespace strata {

BlockCache::BlockCache(Options options) : options_(std::move(options)) {}

void* BlockCache::reserve(size_t requested, size_t block, Freed& to_free) {
  reap(to_free);
  if (auto hit = cached_.find(block); hit != cached_.end()) {
    // The same size again (a gathered parameter, a gradient, a bucket).
    void* ptr = hit->second->ptr;
    uncache(hit);
    commit(ptr, block);
    in_use_ += block;
    peak_ = std::max(peak_, in_use_);
    return ptr;
  }
  if (block > options_.capacity - in_use_) {
    raise(ErrorCategory::kOutOfMemory,
          "{} device memory: requested {} bytes{}, {} in use ({} of them waiting for stream-ordered frees), {} "
          "cached, capacity {} ({} free)",
          options_.device, requested, block == requested ? "" : fmt::format(" (a block of {})", block), in_use_,
          pending_nbytes_, cached_nbytes_, options_.capacity, options_.capacity - in_use_ - cached_nbytes_);
  }
  // Cached bytes count against the budget: drop the largest until it fits.
  while (in_use_ + cached_nbytes_ + block > options_.capacity) {
    auto largest = std::prev(cached_.end());
    to_free.emplace_back(largest->second->ptr, largest->first);
    uncache(largest);
  }
  in_use_ += block;  // reserved; cancel() undoes it
  peak_ = std::max(peak_, in_use_);
  return nullptr;
}

void BlockCache::commit(void* ptr, size_t block) { live_.emplace(ptr, block); }

void BlockCache::cancel(size_t block) { in_use_ -= block; }

std::unordered_map<void*, size_t>::iterator BlockCache::live(void* ptr, const char* what) {
  auto it = live_.find(ptr);
  STRATA_CHECK(it != live_.end() && pending_ptrs_.count(ptr) == 0, kInternal,
               "{} {} of unknown or already freed pointer {}", options_.device, what, ptr);
  return it;
}

void BlockCache::free(void* ptr, Freed& to_free, const char* what) {
  auto it = live(ptr, what);
  const size_t nbytes = it->second;
  in_use_ -= nbytes;
  live_.erase(it);
  release(ptr, nbytes, to_free);
  reap(to_free);
}

void BlockCache::free_after(void* ptr, std::function<bool()> done, Freed& to_free, const char* what) {
  auto it = live(ptr, what);
  if (!done || done()) {
    const size_t nbytes = it->second;
    in_use_ -= nbytes;
    live_.erase(it);
    release(ptr, nbytes, to_free);
  } else {
    pending_.push_back(Pending{ptr, it->second, std::move(done)});
    pending_ptrs_.insert(ptr);
    pending_nbytes_ += it->second;
  }
  reap(to_free);
}

void BlockCache::reap(Freed& to_free) {
  auto due = std::partition(pending_.begin(), pending_.end(), [](Pending& p) { return !p.done(); });
  for (auto it = due; it != pending_.end(); ++it) {
    in_use_ -= it->nbytes;
    pending_nbytes_ -= it->nbytes;
    pending_ptrs_.erase(it->ptr);
    live_.erase(it->ptr);
    release(it->ptr, it->nbytes, to_free);
  }
  pending_.erase(due, pending_.end());
}

void BlockCache::release(void* ptr, size_t nbytes, Freed& to_free) {
  const bool keep =
      nbytes >= options_.min_cached_nbytes && (!options_.cache_within_peak || in_use_ + nbytes <= peak_);
  if (!keep) {
    to_free.emplace_back(ptr, nbytes);
    return;
  }
  // Within the peak: the least recently cached blocks make room.
  while (options_.cache_within_peak && in_use_ + cached_nbytes_ + nbytes > peak_) {
    const Cached oldest = cached_order_.front();
    auto range = cached_.equal_range(oldest.nbytes);
    auto it = std::find_if(range.first, range.second,
                           [&](const auto& entry) { return entry.second->ptr == oldest.ptr; });
    to_free.emplace_back(oldest.ptr, oldest.nbytes);
    uncache(it);
  }
  cached_.emplace(nbytes, cached_order_.insert(cached_order_.end(), Cached{nbytes, ptr}));
  cached_nbytes_ += nbytes;
}

void BlockCache::uncache(std::multimap<size_t, std::list<Cached>::iterator>::iterator it) {
  cached_nbytes_ -= it->first;
  cached_order_.erase(it->second);
  cached_.erase(it);
}

MemoryStats BlockCache::stats() const {
  MemoryStats stats;
  stats.capacity_nbytes = options_.capacity;
  stats.in_use_nbytes = in_use_;
  stats.peak_nbytes = peak_;
  stats.pending_free_nbytes = pending_nbytes_;
  stats.cached_nbytes = cached_nbytes_;
  return stats;
}

BlockCache::Freed BlockCache::drop_cached() {
  Freed out;
  for (const Cached& block : cached_order_) out.emplace_back(block.ptr, block.nbytes);
  cached_.clear();
  cached_order_.clear();
  cached_nbytes_ = 0;
  return out;
}

BlockCache::Freed BlockCache::all_blocks() const {
  Freed out;
  for (const auto& [ptr, nbytes] : live_) out.emplace_back(ptr, nbytes);
  for (const Cached& block : cached_order_) out.emplace_back(block.ptr, block.nbytes);
  return out;
}

}  // namespace strata
