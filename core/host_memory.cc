// Locked, page-aligned host allocations; huge-page backing for large ones.
#include "core/host_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace strata {
namespace {

size_t round_up(size_t n, size_t unit) {
  return (n + unit - 1) / unit * unit;
}

// Huge pages are asked for unless STRATA_HUGE_PAGES=0 (for measuring their effect).
bool huge_pages_wanted() {
  const char* env = std::getenv("STRATA_HUGE_PAGES");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

// Bytes mapped for a request of nbytes: whole huge pages from kHugePageNbytes
// on (whether or not they are asked for, so freeing needs only nbytes).
size_t mapped_nbytes(size_t nbytes) {
  return nbytes >= kHugePageNbytes ? round_up(nbytes, kHugePageNbytes)
                                   : round_up(nbytes, kPageNbytes);
}

// mmap of `size` bytes aligned to `align` (a multiple of the page size).
void* map_aligned(size_t size, size_t align) {
  const size_t slack = align > kPageNbytes ? align : 0;
  void* raw =
      mmap(nullptr, size + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    raise(ErrorCategory::kOutOfMemory, "cannot map {} bytes of host memory: {}", size,
          std::strerror(errno));
  }
  if (slack == 0) return raw;
  const auto begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + align - 1) / align * align;
  if (aligned > begin) munmap(raw, aligned - begin);
  const size_t tail = begin + size + slack - (aligned + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

size_t memlock_limit_nbytes() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 0;
  return limit.rlim_cur == RLIM_INFINITY ? SIZE_MAX : static_cast<size_t>(limit.rlim_cur);
}

std::string transparent_huge_page_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!in || !std::getline(in, line)) return "unavailable";
  // "always [madvise] never": the bracketed word is the mode in force.
  const size_t open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "unavailable";
  return line.substr(open + 1, close - open - 1);
}

HostBacking host_backing(const void* ptr, size_t nbytes) {
  HostBacking backing;
  std::ifstream in("/proc/self/smaps");
  if (!in) return backing;
  backing.known = true;
  const auto lo = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t hi = lo + nbytes;
  size_t overlap = 0;  // of the current mapping with [lo, hi); 0 when not overlapping
  std::string line;
  while (std::getline(in, line)) {
    // A mapping's header: "start-end perms offset dev inode [path]" (hex addresses).
    const size_t dash = line.find('-');
    const size_t space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        line.find(':') > space) {
      const uintptr_t start = std::strtoull(line.substr(0, dash).c_str(), nullptr, 16);
      const uintptr_t end =
          std::strtoull(line.substr(dash + 1, space - dash - 1).c_str(), nullptr, 16);
      overlap = start < hi && lo < end ? std::min(end, hi) - std::max(start, lo) : 0;
      backing.nbytes += overlap;
      continue;
    }
    if (overlap > 0 && line.rfind("AnonHugePages:", 0) == 0) {
      std::istringstream fields(line.substr(14));
      size_t kib = 0;
      fields >> kib;
      backing.huge_nbytes += std::min(overlap, kib * 1024);
    }
  }
  return backing;
}

void* allocate_host(size_t nbytes) {
  if (nbytes >= kOwnMapMinNbytes) return map_aligned(round_up(nbytes, kPageNbytes), kPageNbytes);
  void* ptr = std::aligned_alloc(256, (std::max<size_t>(nbytes, 1) + 255) / 256 * 256);
  if (ptr == nullptr) raise(ErrorCategory::kOutOfMemory, "host allocation of {} bytes failed", nbytes);
  return ptr;
}

void free_host(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  if (nbytes >= kOwnMapMinNbytes) {
    munmap(ptr, round_up(nbytes, kPageNbytes));
  } else {
    std::free(ptr);
  }
}

void* allocate_locked_host(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  const bool large = nbytes >= kHugePageNbytes;
  const bool huge = large && huge_pages_wanted();
  const size_t size = mapped_nbytes(nbytes);
  // mmap gives zeroed memory and returns it to the OS on munmap. Huge pages
  // must be asked for before the memory is first touched (mlock populates it).
  void* ptr = map_aligned(size, large ? kHugePageNbytes : kPageNbytes);
  int advise_errno = 0;
  if (huge) {
    if (madvise(ptr, size, MADV_HUGEPAGE) != 0) advise_errno = errno;
  } else if (large) {
    madvise(ptr, size,
            MADV_NOHUGEPAGE);  // STRATA_HUGE_PAGES=0: 4 KiB pages even under THP "always"
  }
  if (mlock(ptr, size) != 0) {
    warn_once("mlock",
              fmt::format("cannot lock host memory (mlock: {}; RLIMIT_MEMLOCK is {} bytes); pinned "
                          "buffers will be pageable. Raise the limit with `ulimit -l unlimited`.",
                          std::strerror(errno), memlock_limit_nbytes()));
    // Populate anyway, so the huge pages (or their absence) are known now.
    if (madvise(ptr, size, MADV_POPULATE_WRITE) != 0) {
      for (size_t at = 0; at < size; at += kPageNbytes) static_cast<volatile char*>(ptr)[at] = 0;
    }
  }
  if (huge) {
    const HostBacking backing = host_backing(ptr, size);
    if (backing.known && backing.huge_nbytes < size / 2) {
      warn_once(
          "host-huge-pages",
          fmt::format("pinned host memory: the system gave {} of {} MiB as 2 MiB huge pages "
                      "(transparent_hugepage: {}{}{}); using 4 KiB pages, so O_DIRECT pieces "
                      "span many scatter-gather segments and the block layer may split them "
                      "(enable THP: echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)",
                      backing.huge_nbytes >> 20, size >> 20, transparent_huge_page_mode(),
                      advise_errno != 0 ? ", madvise(MADV_HUGEPAGE): " : "",
                      advise_errno != 0 ? std::strerror(advise_errno) : ""));
    }
  }
  return ptr;
}

void free_locked_host(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  munmap(ptr, mapped_nbytes(nbytes));  // also unlocks
}

}  // namespace strata
