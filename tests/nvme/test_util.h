// Helpers for the nvme tests: aligned buffers and random data.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "nvme/io_options.h"

namespace strata::nvme::test {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char[], FreeDeleter>;

// nbytes (rounded up to the alignment) of 4096-aligned memory.
inline AlignedBuffer aligned_buffer(size_t nbytes) {
  size_t rounded = (nbytes + kDirectIoAlignment - 1) / kDirectIoAlignment * kDirectIoAlignment;
  void* p = std::aligned_alloc(kDirectIoAlignment, rounded == 0 ? kDirectIoAlignment : rounded);
  std::memset(p, 0, rounded == 0 ? kDirectIoAlignment : rounded);
  return AlignedBuffer(static_cast<char*>(p));
}

inline void fill_random(char* p, size_t nbytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= nbytes; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < nbytes; ++i) p[i] = static_cast<char>(rng());
}

// Every I/O engine, for tests that must hold on each.
inline constexpr EngineKind kEngines[] = {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync};

// Small queues and 64 KiB pieces, so a request of a few hundred KiB is several
// pieces in flight on each of `threads` workers.
inline AioOptions options_for(EngineKind engine, int threads) {
  AioOptions options;
  options.engine = engine;
  options.thread_count = threads;
  options.queue_depth = 4;
  options.block_size = 64 << 10;
  return options;
}

}  // namespace strata::nvme::test
