// Options of the NVMe I/O engine, mirroring DeepSpeed's `aio` config block, plus
// the choice of backend. Plain data; no I/O happens here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

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

// How requests are cut and queued: the two settings aio.auto_tune chooses.
struct IoSetting {
  size_t block_size = size_t{1} << 20;  // bytes per piece
  int queue_depth = 8;                  // pieces in flight per worker
  bool operator==(const IoSetting&) const = default;
};

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

  // aio.auto_tune: the handle tries each of tune_candidates() on the first
  // auto_tune_nbytes of reads and, separately, of writes, measures what each
  // achieves (bytes / busy time, from the completions), keeps the fastest per
  // direction and logs its choice (nvme/online_tuner.h). Only how requests are
  // cut into pieces and how many are in flight changes, never the data.
  bool auto_tune = false;
  uint64_t auto_tune_nbytes = uint64_t{512} << 20;  // traffic per direction spent tuning
  int auto_tune_rounds = 2;  // passes over the candidates (the second in reverse order,
                             // so a drift in the drive or the workload cancels)
  std::vector<IoSetting> auto_tune_candidates;  // empty: kDefaultTuneCandidates

  // The settings auto_tune tries: {block_size, queue_depth} first (kept unless
  // another measures more than 2% faster), then auto_tune_candidates (or the defaults)
  // without repeats. Just {block_size, queue_depth} when auto_tune is off.
  std::vector<IoSetting> tune_candidates() const;
  // The deepest queue any piece may ask for; each worker's ring is made this deep.
  int max_queue_depth() const;

  // Throws Error(kBadArgument) naming the field when a value is out of range
  // (block_size must be a positive multiple of 4096, at most kMaxBlockNbytes;
  // queue_depth in [1, 4096];
  // thread_count in [1, 256]; the same for every auto_tune candidate), or when
  // auto_tune is combined with the psync engine (one piece at a time: there is
  // no queue to tune) or given no traffic to tune on.
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
// What aio.auto_tune tries besides the configured setting: smaller pieces at
// the default's 8 MiB in flight, and 32 MiB in flight as a deeper queue or as
// larger pieces. Each slice gives a candidate auto_tune_nbytes / (candidates x
// rounds) of traffic: 64 MiB with the defaults (the default setting is one of
// the four), twice what the deepest candidate keeps in flight per worker.
inline constexpr IoSetting kDefaultTuneCandidates[] = {
    {size_t{256} << 10, 32}, {size_t{1} << 20, 8}, {size_t{1} << 20, 32}, {size_t{4} << 20, 8}};

}  // namespace strata::nvme
