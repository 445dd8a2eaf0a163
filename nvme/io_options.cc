// Engine names and validation of the `aio` options.
#include "nvme/io_options.h"

#include <algorithm>

#include "core/error.h"

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

namespace {

void validate_setting(const IoSetting& s, std::string_view where) {
  STRATA_CHECK(s.block_size > 0 && s.block_size % kDirectIoAlignment == 0 && s.block_size <= kMaxBlockNbytes,
               kBadArgument, "{}block_size = {} must be a positive multiple of {} and at most {} (1 GiB)",
               where, s.block_size, kDirectIoAlignment, kMaxBlockNbytes);
  STRATA_CHECK(s.queue_depth >= 1 && s.queue_depth <= kMaxQueueDepth, kBadArgument,
               "{}queue_depth = {} must be in [1, {}]", where, s.queue_depth, kMaxQueueDepth);
}

}  // namespace

std::vector<IoSetting> AioOptions::tune_candidates() const {
  std::vector<IoSetting> all = {IoSetting{block_size, queue_depth}};
  if (!auto_tune) return all;
  auto add = [&](const IoSetting& s) {
    if (std::find(all.begin(), all.end(), s) == all.end()) all.push_back(s);
  };
  if (auto_tune_candidates.empty()) {
    for (const IoSetting& s : kDefaultTuneCandidates) add(s);
  } else {
    for (const IoSetting& s : auto_tune_candidates) add(s);
  }
  return all;
}

int AioOptions::max_queue_depth() const {
  int deepest = 0;
  for (const IoSetting& s : tune_candidates()) deepest = std::max(deepest, s.queue_depth);
  return deepest;
}

void AioOptions::validate() const {
  validate_setting(IoSetting{block_size, queue_depth}, "aio.");
  STRATA_CHECK(thread_count >= 1 && thread_count <= kMaxThreadCount, kBadArgument,
               "aio.thread_count = {} must be in [1, {}]", thread_count, kMaxThreadCount);
  if (!auto_tune) return;
  STRATA_CHECK(engine != EngineKind::kPsync, kBadArgument,
               "aio.auto_tune = true with aio.engine = psync: psync moves one piece at a time, so "
               "there is no queue depth to tune; use engine uring or aio, or set auto_tune false");
  STRATA_CHECK(auto_tune_nbytes > 0, kBadArgument,
               "aio.auto_tune: auto_tune_nbytes = 0 leaves no traffic to tune on");
  STRATA_CHECK(auto_tune_rounds >= 1 && auto_tune_rounds <= 16, kBadArgument,
               "aio.auto_tune: auto_tune_rounds = {} must be in [1, 16]", auto_tune_rounds);
  for (size_t i = 0; i < auto_tune_candidates.size(); ++i) {
    validate_setting(auto_tune_candidates[i], fmt::format("aio.auto_tune candidate {}: ", i));
  }
}

}  // namespace strata::nvme
