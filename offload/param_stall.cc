// Stall accounting: the compute stream timing its own waits for gathered
// parameters, and the figures PrefetchStats reads back.
#include "offload/param_stall.h"

#include <algorithm>

#include "core/trace_recorder.h"

namespace strata::offload {

namespace {

size_t stall_index(OpId op, Phase phase) {
  return static_cast<size_t>(op) * StallLog::kPhases + static_cast<size_t>(phase);
}

}  // namespace

void wait_timed(Stream& compute, PrefetchStats& stats, size_t op_count, OpId op, Phase phase,
                const std::string& name, const std::vector<Event*>& waits) {
  const bool pending = std::any_of(waits.begin(), waits.end(), [](Event* e) { return !e->query(); });
  if (!pending) {
    for (Event* e : waits) compute.wait(*e);
    return;
  }
  if (stats.stall_log == nullptr) stats.stall_log = std::make_shared<StallLog>(op_count);
  const size_t index = stall_index(op, phase);
  {
    std::lock_guard lock(stats.stall_log->mutex);
    OpStall& entry = stats.stall_log->entries[index];
    if (entry.op < 0) {  // the stream reads only seconds/windows: the name is set here, once
      entry.op = op;
      entry.phase = phase;
      entry.name = name;
    }
  }
  compute.launch_host_func([log = stats.stall_log] {
    const int64_t now = trace::now_ns();
    std::lock_guard lock(log->mutex);
    log->begin_ns = now;
  });
  for (Event* e : waits) compute.wait(*e);
  compute.launch_host_func([log = stats.stall_log, index] {
    const int64_t end = trace::now_ns();
    int64_t begin = 0;
    std::string_view name;
    {
      std::lock_guard lock(log->mutex);
      begin = log->begin_ns;
      OpStall& entry = log->entries[index];
      const double seconds = static_cast<double>(end - begin) * 1e-9;
      entry.seconds += seconds;
      ++entry.windows;
      log->seconds += seconds;
      ++log->windows;
      name = entry.name;  // set before this function was enqueued; never changes
    }
    if (trace::enabled()) {
      trace::Args args;
      args.detail_key = "op";
      args.detail = name;
      args.value_key = "stall_us";
      args.value = (end - begin) / 1000;
      trace::complete("engine", "param stall", begin, end, args);
    }
  });
}

double PrefetchStats::param_stall_seconds() const {
  if (stall_log == nullptr) return 0;
  std::lock_guard lock(stall_log->mutex);
  return stall_log->seconds;
}

int64_t PrefetchStats::stalled_windows() const {
  if (stall_log == nullptr) return 0;
  std::lock_guard lock(stall_log->mutex);
  return stall_log->windows;
}

std::vector<OpStall> PrefetchStats::op_stalls() const {
  std::vector<OpStall> out;
  if (stall_log == nullptr) return out;
  {
    std::lock_guard lock(stall_log->mutex);
    for (const OpStall& entry : stall_log->entries) {
      if (entry.windows > 0) out.push_back(entry);
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const OpStall& a, const OpStall& b) { return a.seconds > b.seconds; });
  return out;
}

}  // namespace strata::offload
