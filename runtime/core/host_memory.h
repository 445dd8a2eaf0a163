// Page-aligned host memory, locked into RAM (mlock) when RLIMIT_MEMLOCK allows.
// Used as "pinned" memory by the cpu accelerator and wherever CUDA is absent.
#pragma once

#include <cstddef>

namespace strata {

constexpr size_t kPageNbytes = 4096;

// Returns nbytes (rounded up to whole pages) of zeroed memory aligned to 4096.
// Tries mlock; when the lock limit refuses, logs one warning per process and
// returns unlocked memory. Throws Error(kOutOfMemory) if allocation fails.
void* allocate_locked_host(size_t nbytes);
// Frees memory from allocate_locked_host; nbytes must be the requested size.
void free_locked_host(void* ptr, size_t nbytes);

// RLIMIT_MEMLOCK soft limit in bytes (SIZE_MAX when unlimited).
size_t memlock_limit_nbytes();

}  // namespace strata
