// Per-layer accounting of the parameter coordinator (docs/DESIGN.md §10): what
// it fetched for the operators of each decoder layer in one step — windows,
// skipped windows, allgathers and their bytes, home->pinned reads and their
// bytes, and where compute stalled. Below runtime/ a layer is only an integer
// the engine gives each operator (CoordinatedOp::layer, -1: none); nothing
// here knows what a layer is.
//
// Keys: a window and a stall count for its operator's layer; a gather and a
// read for their parameter's layer, which is the layer every operator listing
// it shares (-1 when operators of different layers list it, e.g. an embedding
// tied to lm_head). So the layers' counts add up to PrefetchStats' totals.
//
// Timeline (`--trace`): while recording, each layer has three counter tracks,
// the running totals of its step — "param bytes read: layer N", "param bytes
// gathered: layer N" (sampled by the training thread as reads and gathers are
// issued, back to 0 at the step boundary) and "param stall us: layer N"
// (sampled by the compute stream after each timed wait, back to 0 when the
// stream reaches the step boundary); "no layer" for -1. A layer's peak on a
// track is its step's figure.
//
// Thread-safety: LayerTally is used by the training thread only; the stall
// counters are written under StallLog's mutex (param_stall.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/hook_ids.h"

namespace strata::offload {

// One decoder layer's share of a step (PrefetchStats::per_layer()).
struct LayerFetch {
  int32_t layer = -1;            // the decoder layer; -1: operators outside every layer
  int64_t windows = 0;           // pre_op calls of its operators
  int64_t skipped_windows = 0;   // skip_op calls of its operators (unrouted experts)
  int64_t gathers = 0;           // allgathers of its parameters
  uint64_t gather_nbytes = 0;    // bytes of full parameters those produce (this rank)
  int64_t reads = 0;             // home->pinned reads of its parameters (nvme)
  uint64_t read_nbytes = 0;      // bytes of slices those move (this rank)
  int64_t stalled_windows = 0;   // its windows whose wait for parameters was timed
  double stall_seconds = 0;      // compute-stream time at those waits

  LayerFetch& operator+=(const LayerFetch& o);
};

// The counter-track names of one layer's slot (see the timeline above).
struct LayerCounterNames {
  std::string read, gathered, stall;
};
std::vector<LayerCounterNames> layer_counter_names(int32_t slots);

// Which layer each operator and parameter counts for, and the counting.
// Counts live in a step's vector indexed by slot = layer + 1.
class LayerTally {
 public:
  using ParamsOf = std::function<const std::vector<ParamId>&(OpId)>;
  LayerTally() = default;
  // op_layer[op]: operator op's layer (-1: none); params_of(op): its parameters.
  LayerTally(std::vector<int32_t> op_layer, size_t param_count, const ParamsOf& params_of);

  int32_t op_layer(OpId op) const { return op_layer_[static_cast<size_t>(op)]; }
  int32_t param_layer(ParamId id) const { return param_layer_[static_cast<size_t>(id)]; }
  int32_t slots() const { return slots_; }

  // The counts of op's / id's layer in `counts` (sized and labelled on first use).
  LayerFetch& of_op(std::vector<LayerFetch>& counts, OpId op) const { return at(counts, op_layer(op)); }
  LayerFetch& of_param(std::vector<LayerFetch>& counts, ParamId id) const { return at(counts, param_layer(id)); }

  // Timeline: a read or gather of `id` was counted into `entry` (no-op unless recording).
  void trace_bytes(const LayerFetch& entry) const;
  // The step boundary: every layer's byte counters back to 0 (no-op unless recording).
  void trace_reset() const;
  // Shared with the stall log, whose host functions may outlive the tally.
  const std::shared_ptr<const std::vector<LayerCounterNames>>& counter_names() const { return names_; }

 private:
  LayerFetch& at(std::vector<LayerFetch>& counts, int32_t layer) const;
  std::vector<int32_t> op_layer_, param_layer_;
  int32_t slots_ = 1;  // highest layer + 2
  std::shared_ptr<const std::vector<LayerCounterNames>> names_;
};

}  // namespace strata::offload
