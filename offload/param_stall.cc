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
                const std::string& name, const std::vector<Event*>& waits, const LayerTally& layers,
                bool after_update) {
  const bool pending = std::any_of(waits.begin(), waits.end(), [](Event* e) { return !e->query(); });
  if (!pending) {
    for (Event* e : waits) compute.wait(*e);
    return;
  }
  if (stats.stall_log == nullptr) stats.stall_log = std::make_shared<StallLog>(op_count, layers);
  const size_t index = stall_index(op, phase);
  {
    std::lock_guard lock(stats.stall_log->mutex);
    OpStall& entry = stats.stall_log->entries[index];
    if (entry.op < 0) {  // the stream reads only seconds/windows/layer: set here, once
      entry.op = op;
      entry.phase = phase;
      entry.name = name;
      entry.layer = layers.op_layer(op);
    }
  }
  compute.launch_host_func([log = stats.stall_log] {
    const int64_t now = trace::now_ns();
    std::lock_guard lock(log->mutex);
    log->begin_ns = now;
  });
  for (Event* e : waits) compute.wait(*e);
  compute.launch_host_func([log = stats.stall_log, index, after_update] {
    const int64_t end = trace::now_ns();
    int64_t begin = 0;
    std::string_view name;
    double layer_seconds = 0;
    size_t slot = 0;
    {
      std::lock_guard lock(log->mutex);
      begin = log->begin_ns;
      OpStall& entry = log->entries[index];
      const double seconds = static_cast<double>(end - begin) * 1e-9;
      entry.seconds += seconds;
      ++entry.windows;
      log->seconds += seconds;
      if (after_update) log->update_seconds += seconds;
      ++log->windows;
      name = entry.name;  // set before this function was enqueued; never changes
      slot = static_cast<size_t>(entry.layer + 1);
      layer_seconds = log->layer_seconds[slot] += seconds;
    }
    if (trace::enabled()) {
      trace::counter((*log->layer_names)[slot].stall, static_cast<int64_t>(layer_seconds * 1e6));
      trace::Args args;
      args.detail_key = "op";
      args.detail = name;
      args.value_key = "stall_us";
      args.value = (end - begin) / 1000;
      trace::complete("engine", "param stall", begin, end, args);
    }
  });
}

void end_step_timeline(Stream& compute, const PrefetchStats& stats, const LayerTally& layers) {
  if (!trace::enabled()) return;
  layers.trace_reset();
  if (stats.stall_log == nullptr) return;
  compute.launch_host_func([log = stats.stall_log] {
    std::lock_guard lock(log->mutex);
    for (size_t slot = 0; slot < log->layer_seconds.size(); ++slot) {
      if (log->layer_seconds[slot] > 0) trace::counter((*log->layer_names)[slot].stall, 0);
    }
  });
}

std::vector<LayerFetch> PrefetchStats::per_layer() const {
  std::vector<LayerFetch> out = layer_counts;
  if (stall_log == nullptr) return out;
  std::lock_guard lock(stall_log->mutex);
  for (const OpStall& entry : stall_log->entries) {
    if (entry.windows == 0) continue;
    const auto slot = static_cast<size_t>(entry.layer + 1);
    if (out.size() <= slot) {  // a window while paused (evaluation) counts no window, only its stall
      const size_t from = out.size();
      out.resize(slot + 1);
      for (size_t k = from; k < out.size(); ++k) out[k].layer = static_cast<int32_t>(k) - 1;
    }
    out[slot].stall_seconds += entry.seconds;
    out[slot].stalled_windows += entry.windows;
  }
  return out;
}

double PrefetchStats::param_stall_seconds() const {
  if (stall_log == nullptr) return 0;
  std::lock_guard lock(stall_log->mutex);
  return stall_log->seconds;
}

double PrefetchStats::update_stall_seconds() const {
  if (stall_log == nullptr) return 0;
  std::lock_guard lock(stall_log->mutex);
  return stall_log->update_seconds;
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
