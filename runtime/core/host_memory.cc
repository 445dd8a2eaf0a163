// Locked, page-aligned host allocations.
#include "runtime/core/host_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstring>

#include "runtime/core/error.h"
#include "runtime/core/log.h"

namespace strata {

size_t memlock_limit_nbytes() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return 0;
  return limit.rlim_cur == RLIM_INFINITY ? SIZE_MAX : static_cast<size_t>(limit.rlim_cur);
}

void* allocate_locked_host(size_t nbytes) {
  const size_t rounded = (nbytes + kPageNbytes - 1) / kPageNbytes * kPageNbytes;
  if (rounded == 0) return nullptr;
  // mmap gives page-aligned, zeroed memory and returns it to the OS on munmap.
  void* ptr = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    raise(ErrorCategory::kOutOfMemory, "cannot map {} bytes of host memory: {}", rounded,
          std::strerror(errno));
  }
  if (mlock(ptr, rounded) != 0) {
    warn_once("mlock",
              fmt::format("cannot lock host memory (mlock: {}; RLIMIT_MEMLOCK is {} bytes); pinned "
                          "buffers will be pageable. Raise the limit with `ulimit -l unlimited`.",
                          std::strerror(errno), memlock_limit_nbytes()));
  }
  return ptr;
}

void free_locked_host(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  const size_t rounded = (nbytes + kPageNbytes - 1) / kPageNbytes * kPageNbytes;
  munmap(ptr, rounded);  // also unlocks
}

}  // namespace strata
