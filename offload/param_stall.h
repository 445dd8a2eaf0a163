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
  explicit StallLog(size_t op_count) : entries(op_count * kPhases) {}
  static constexpr size_t kPhases = 3;  // Phase's values

  std::mutex mutex;
  std::vector<OpStall> entries;  // per op * kPhases + phase; op < 0 until first timed
  double seconds = 0;
  int64_t windows = 0;
  int64_t begin_ns = 0;
};

// Makes `compute` wait for every event of `waits` (a window's parameters)
// and, when one of them is not complete yet, times that wait on the stream
// itself into stats.stall_log (created on first use for op_count operators).
void wait_timed(Stream& compute, PrefetchStats& stats, size_t op_count, OpId op, Phase phase,
                const std::string& name, const std::vector<Event*>& waits);

}  // namespace strata::offload
