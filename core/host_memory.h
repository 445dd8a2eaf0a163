// Page-aligned host memory, locked into RAM (mlock) when RLIMIT_MEMLOCK allows,
// backed by transparent huge pages where the system gives them. Used as
// "pinned" memory by the cpu accelerator and wherever CUDA is absent.
#pragma once

#include <cstddef>
#include <string>

namespace strata {

constexpr size_t kPageNbytes = 4096;
constexpr size_t kHugePageNbytes = size_t{2} << 20;

// Returns nbytes (rounded up to whole pages) of zeroed memory aligned to 4096.
// An allocation of at least kHugePageNbytes is rounded up to whole huge pages,
// aligned to kHugePageNbytes and asked for transparent huge pages
// (MADV_HUGEPAGE) before it is touched: O_DIRECT I/O from physically
// contiguous memory needs one scatter-gather segment per 2 MiB instead of one
// per 4 KiB page, so the block layer neither splits a piece nor refuses to
// merge neighbours (on a virtio disk without indirect descriptors each segment
// also takes a ring slot). When the system gives no huge pages (THP disabled,
// memory too fragmented) it logs one line per process and goes on with 4 KiB pages.
// Then tries mlock; when the lock limit refuses, logs one warning per process
// and returns unlocked (but populated) memory. Throws Error(kOutOfMemory) if
// allocation fails. Setting STRATA_HUGE_PAGES=0 in the environment turns the
// huge-page request off (for measuring its effect).
void* allocate_locked_host(size_t nbytes);
// Frees memory from allocate_locked_host; nbytes must be the requested size.
void free_locked_host(void* ptr, size_t nbytes);

// Ordinary (pageable) host memory, 256-byte aligned, for the cpu accelerator's
// device memory. Blocks of kOwnMapMinNbytes or more are their own mmap and go
// back to the OS when freed, so the process's resident set follows what is in
// use: the allocator cannot strand them in a thread's heap arena, as malloc
// does with blocks below its (adaptive, up to 32 MiB) mmap threshold when many
// threads allocate and free them. The bound is malloc's own initial threshold:
// at 1 MiB, a mixture of experts' many 128 KiB expert copies and gradients
// (small models, one rank thread each) stranded ~30 MB more per rank thread
// when the experts grew 4x (bench/PERFORMANCE.md, "Mixture of experts").
// Throws Error(kOutOfMemory) when allocation fails.
constexpr size_t kOwnMapMinNbytes = size_t{128} << 10;
void* allocate_host(size_t nbytes);
// Frees memory from allocate_host; nbytes must be the requested size.
void free_host(void* ptr, size_t nbytes);

// RLIMIT_MEMLOCK soft limit in bytes (SIZE_MAX when unlimited).
size_t memlock_limit_nbytes();

// How a range of this process's memory is backed, from /proc/self/smaps.
struct HostBacking {
  bool known = false;      // false when /proc/self/smaps could not be read
  size_t nbytes = 0;       // bytes of the range that lie in a mapping
  size_t huge_nbytes = 0;  // of those, bytes in transparent huge pages (the
                           // mappings' AnonHugePages, at most their overlap
                           // with the range: exact unless the kernel merged the
                           // range's mapping with a neighbouring one)
};
HostBacking host_backing(const void* ptr, size_t nbytes);

// The system's transparent huge page mode: "always", "madvise", "never", or
// "unavailable" (no /sys/kernel/mm/transparent_hugepage/enabled).
std::string transparent_huge_page_mode();

}  // namespace strata
