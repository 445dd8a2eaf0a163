// Stall accounting of the parameter coordinator: how long the compute stream
// sat at pre_op's waits for gathered parameters, per (operator, phase),
// timed on the stream itself (PrefetchStats::param_stall_seconds says why).
// Internal to offload/.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/accelerator.h"
#include "offload/param_coordinator.h"

namespace strata::offload {

// One step's stall figures. The training thread opens an entry per timed
// (op, phase) and enqueues the host functions; the compute stream's host
// functions stamp and add. The stream runs its host functions one at a time
// and in order, so one bracket is open at a time and `begin_ns` is its start.
struct StallLog {
  StallLog(size_t op_count, const LayerTally& layers)
      : entries(op_count * kPhases),
        layer_seconds(static_cast<size_t>(layers.slots())),
        layer_names(layers.counter_names()) {}
  static constexpr size_t kPhases = 3;  // Phase's values

  std::mutex mutex;
  std::vector<OpStall> entries;  // per op * kPhases + phase; op < 0 until first timed
  double seconds = 0;
  double update_seconds = 0;  // of seconds, windows waiting for the optimizer's update (wait_timed's after_update)
  int64_t windows = 0;
  int64_t begin_ns = 0;
  std::vector<double> layer_seconds;  // per layer slot (layer + 1): the timeline's running totals
  std::shared_ptr<const std::vector<LayerCounterNames>> layer_names;
};

// Makes `compute` wait for every event of `waits` (a window's parameters)
// and, when one of them is not complete yet, times that wait on the stream
// itself into stats.stall_log (created on first use for op_count operators),
// under op's layer (layers.op_layer).
void wait_timed(Stream& compute, PrefetchStats& stats, size_t op_count, OpId op, Phase phase,
                const std::string& name, const std::vector<Event*>& waits, const LayerTally& layers,
                bool after_update = false);

// The step boundary on the timeline (layer_fetch.h): every layer's byte
// counters back to 0 now, and its stall counter once the compute stream
// reaches this point. No-op unless recording.
void end_step_timeline(Stream& compute, const PrefetchStats& stats, const LayerTally& layers);

}  // namespace strata::offload
