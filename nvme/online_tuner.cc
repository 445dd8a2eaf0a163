// The online tuner: slices of tuning traffic per candidate, busy-time
// accounting from completions, the choice and its log line.
#include "nvme/online_tuner.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/log.h"

namespace strata::nvme {
namespace {

// The configured setting is kept unless another candidate beats it by more
// than this: measurement noise on a live workload is a few percent, and a
// change that gains less is not worth surprising the user with.
constexpr double kKeepConfiguredMargin = 1.02;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string bytes_text(uint64_t nbytes) {
  if (nbytes % (uint64_t{1} << 20) == 0) return fmt::format("{} MiB", nbytes >> 20);
  if (nbytes % (uint64_t{1} << 10) == 0) return fmt::format("{} KiB", nbytes >> 10);
  return fmt::format("{} B", nbytes);
}

std::string setting_text(const IoSetting& s) {
  return fmt::format("{} x{}", bytes_text(s.block_size), s.queue_depth);
}

}  // namespace

OnlineTuner::OnlineTuner(const AioOptions& options, std::string label)
    : candidates_(options.tune_candidates()),
      configured_{options.block_size, options.queue_depth},
      label_(std::move(label)) {
  const int n = static_cast<int>(candidates_.size());
  for (int round = 0; round < (options.auto_tune ? options.auto_tune_rounds : 0); ++round) {
    for (int i = 0; i < n; ++i) schedule_.push_back(round % 2 == 0 ? i : n - 1 - i);
  }
  for (Direction* d : {&reads_, &writes_}) {
    d->chosen = configured_;
    for (const IoSetting& s : candidates_) d->measured.push_back(TuneMeasurement{s});
    d->clocks.resize(candidates_.size());
    if (!options.auto_tune) d->settled.store(true);  // nothing to tune: always the configured setting
  }
  if (schedule_.empty()) return;
  // Whole 4 KiB units per slice, at least one: a slice shorter than one piece
  // still gives its candidate one whole piece.
  slice_nbytes_ = std::max<uint64_t>(kDirectIoAlignment, options.auto_tune_nbytes / schedule_.size() /
                                                             kDirectIoAlignment * kDirectIoAlignment);
  total_nbytes_ = slice_nbytes_ * schedule_.size();
}

OnlineTuner::Cut OnlineTuner::cut(IoOp op, size_t remaining_nbytes) {
  Direction& d = direction(op);
  if (d.settled.load(std::memory_order_acquire)) {
    return Cut{std::min(d.chosen.block_size, remaining_nbytes), d.chosen.queue_depth, kUntracked};
  }
  std::lock_guard lock(mutex_);
  if (d.settled.load(std::memory_order_relaxed)) {
    return Cut{std::min(d.chosen.block_size, remaining_nbytes), d.chosen.queue_depth, kUntracked};
  }
  if (d.cut_nbytes >= total_nbytes_) {
    // The last slice is still in flight: carry on with its candidate.
    const int last = schedule_.back();
    const IoSetting& s = candidates_[static_cast<size_t>(last)];
    return Cut{std::min(s.block_size, remaining_nbytes), s.queue_depth, last, true};
  }
  // A piece belongs to the slice it starts in; it may run past the slice's end.
  const int index = schedule_[d.cut_nbytes / slice_nbytes_];
  const IoSetting& s = candidates_[index];
  Cut cut{std::min(s.block_size, remaining_nbytes), s.queue_depth, index};
  d.cut_nbytes += cut.nbytes;
  ++d.timed_pending;
  return cut;
}

void OnlineTuner::started(IoOp op, int tag) {
  if (tag < 0) return;
  Direction& d = direction(op);
  std::lock_guard lock(mutex_);
  if (d.settled.load(std::memory_order_relaxed)) return;
  Clock& c = d.clocks[static_cast<size_t>(tag)];
  if (c.running++ == 0) c.since_ns = now_ns();
}

void OnlineTuner::finished(IoOp op, int tag, size_t nbytes, bool ok, bool was_started, bool overtime) {
  if (tag < 0) return;
  Direction& d = direction(op);
  std::unique_lock lock(mutex_);
  if (d.settled.load(std::memory_order_relaxed)) return;
  if (was_started) {
    TuneMeasurement& m = d.measured[static_cast<size_t>(tag)];
    Clock& c = d.clocks[static_cast<size_t>(tag)];
    if (--c.running == 0) m.busy_s += static_cast<double>(now_ns() - c.since_ns) * 1e-9;
    if (ok) m.nbytes += nbytes;
  }
  if (!overtime) --d.timed_pending;
  if (d.cut_nbytes < total_nbytes_ || d.timed_pending != 0) return;
  settle(op, d);
  const std::string line = d.summary;  // constant once settled
  lock.unlock();
  logger().info("{}", line);
}

void OnlineTuner::settle(IoOp op, Direction& d) {
  // Overtime pieces may still be in flight: their time so far counts (their
  // bytes do not, a slight underestimate of the last candidate).
  const int64_t now = now_ns();
  for (size_t i = 0; i < d.clocks.size(); ++i) {
    if (d.clocks[i].running > 0) d.measured[i].busy_s += static_cast<double>(now - d.clocks[i].since_ns) * 1e-9;
  }
  size_t best = 0;
  for (size_t i = 1; i < d.measured.size(); ++i) {
    if (d.measured[i].gbps() > d.measured[best].gbps()) best = i;
  }
  // Index 0 is the configured setting (tune_candidates()).
  const double best_gbps = d.measured[best].gbps();
  std::string why;
  if (best_gbps <= 0) {
    best = 0;
    why = "no candidate moved any bytes (every piece failed?): keeping the configured setting";
  } else if (best != 0 && best_gbps <= d.measured[0].gbps() * kKeepConfiguredMargin) {
    best = 0;
    why = fmt::format("kept the configured setting: the fastest was within {:.0f}% of it",
                      (kKeepConfiguredMargin - 1) * 100);
  }
  std::string figures;
  for (size_t i = 0; i < d.measured.size(); ++i) {
    const TuneMeasurement& m = d.measured[i];
    figures += fmt::format("{}{} {:.3f}{}", i ? ", " : "", setting_text(m.setting), m.gbps(),
                           i == best ? "*" : "");
  }
  d.chosen = d.measured[best].setting;
  d.summary = fmt::format(
      "aio.auto_tune ({}): {} use block_size {} ({} bytes), queue_depth {} after {} of tuning "
      "traffic; GB/s (bytes / busy time) per block size x queue depth: {}{}{}",
      label_, op == IoOp::kRead ? "reads" : "writes", bytes_text(d.chosen.block_size),
      d.chosen.block_size, d.chosen.queue_depth, bytes_text(total_nbytes_), figures,
      why.empty() ? "" : "; ", why);
  d.settled.store(true, std::memory_order_release);
}

TuneReport OnlineTuner::report(IoOp op) const {
  const Direction& d = direction(op);
  std::lock_guard lock(mutex_);
  TuneReport r;
  r.enabled = !schedule_.empty();
  r.settled = r.enabled && d.settled.load();
  r.chosen = d.chosen;
  r.candidates = d.measured;
  r.summary = d.summary;
  return r;
}

}  // namespace strata::nvme
