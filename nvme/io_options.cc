// Engine names and validation of the `aio` options.
#include "nvme/io_options.h"

#include "runtime/core/error.h"

namespace strata::nvme {

std::string_view engine_kind_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kUring: return "uring";
    case EngineKind::kAio: return "aio";
    case EngineKind::kPsync: return "psync";
  }
  return "unknown";
}

EngineKind parse_engine_kind(std::string_view text) {
  if (text == "uring" || text == "io_uring") return EngineKind::kUring;
  if (text == "aio" || text == "libaio") return EngineKind::kAio;
  if (text == "psync") return EngineKind::kPsync;
  raise(ErrorCategory::kBadArgument, "unknown I/O engine '{}': accepted values are uring, aio, psync",
        text);
}

void AioOptions::validate() const {
  STRATA_CHECK(block_size > 0 && block_size % kDirectIoAlignment == 0 && block_size <= kMaxBlockNbytes,
               kBadArgument, "aio.block_size = {} must be a positive multiple of {} and at most {} (1 GiB)",
               block_size, kDirectIoAlignment, kMaxBlockNbytes);
  STRATA_CHECK(queue_depth >= 1 && queue_depth <= kMaxQueueDepth, kBadArgument,
               "aio.queue_depth = {} must be in [1, {}]", queue_depth, kMaxQueueDepth);
  STRATA_CHECK(thread_count >= 1 && thread_count <= kMaxThreadCount, kBadArgument,
               "aio.thread_count = {} must be in [1, {}]", thread_count, kMaxThreadCount);
}

}  // namespace strata::nvme
