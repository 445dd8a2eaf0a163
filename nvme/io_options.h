// Options of the NVMe I/O engine, mirroring DeepSpeed's `aio` config block, plus
// the choice of backend. Plain data; no I/O happens here.
#pragma once

#include <cstddef>
#include <string_view>

namespace strata::nvme {

// Which kernel interface moves the bytes.
enum class EngineKind {
  kUring,  // io_uring (default): one ring per worker, fixed buffers when registered
  kAio,    // Linux native AIO (libaio): one io_context per worker
  kPsync,  // pread/pwrite on the worker thread, one piece at a time (reference)
};

// "uring" | "aio" | "psync".
std::string_view engine_kind_name(EngineKind kind);
// Accepts "uring" (also "io_uring"), "aio" (also "libaio"), "psync".
// Throws Error(kBadArgument) naming the accepted values otherwise.
EngineKind parse_engine_kind(std::string_view text);

// The `aio` block. Defaults are DeepSpeed's (v0.19) except the engine, which is ours.
struct AioOptions {
  size_t block_size = size_t{1} << 20;  // bytes per piece a request is split into
  int queue_depth = 8;                  // pieces in flight per worker
  int thread_count = 1;                 // workers, each with its own ring / io_context
  bool single_submit = false;           // submit pieces one syscall each instead of batched
  bool overlap_events = true;           // refill the queue as completions arrive (false:
                                        // wait for the whole batch before submitting more)
  EngineKind engine = EngineKind::kUring;
  bool register_buffers = true;         // io_uring: use fixed buffers for registered memory

  // Throws Error(kBadArgument) naming the field when a value is out of range
  // (block_size must be a positive multiple of 4096, at most kMaxBlockNbytes;
  // queue_depth in [1, 4096];
  // thread_count in [1, 256]).
  void validate() const;
};

// Alignment O_DIRECT requires of buffer address, file offset and length here.
constexpr size_t kDirectIoAlignment = 4096;
// Largest piece: io_uring lengths are 32-bit, and 1 GiB keeps pieces inside one
// registered fixed buffer (offload::PinnedBufferPool::kMaxRegionNbytes).
constexpr size_t kMaxBlockNbytes = size_t{1} << 30;
// Largest queue_depth and thread_count AioOptions::validate() accepts.
constexpr int kMaxQueueDepth = 4096;
constexpr int kMaxThreadCount = 256;

}  // namespace strata::nvme
