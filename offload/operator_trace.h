// OperatorTrace: the sequence of hook windows (operator, phase) one training
// step runs, recorded on the first step and followed on later ones, so a
// parameter coordinator can fetch ahead of need (docs/DESIGN.md §5.1).
//
// A step is everything between two step boundaries (the engine's step(): ParamCoordinator::end_step): its
// forward passes, their backward passes and, with activation checkpointing,
// the recompute windows inside backward — recorded as they come, each with its
// phase. Backward is recorded, never derived by reversing forward (attention's
// backward runs o_proj before q/k/v; a fused loss opens lm_head's backward
// window at the end of forward). For messages the entries are split into
// passes: a pass is a maximal run of forward windows (kForward) or of backward
// windows (kBackward, and kRecompute, which runs inside backward).
//
// Life cycle: kRecording (the first step, and the step after a drop) →
// end_step() → kFollowing while every window matches the next entry →
// a mismatch (another operator or phase, a window past the end, or a step
// that ends before the trace does) drops the trace: kDropped until the end
// of the step, then kRecording again. A step that recorded nothing (no window
// between two boundaries) leaves the state as it was.
//
// Besides the entries, a complete trace answers the two questions a
// coordinator asks: when is a parameter used next (next_use) and how many
// elements are fetched in between (numel_between) — the reuse distance of
// DeepSpeed's stage3_max_reuse_distance.
//
// Skipped windows (routing): a window may run no kernels this time — an expert
// no rank routed a token to (Engine::skip_op). It is an entry like any other
// (so routing never changes the sequence), and each entry remembers whether
// it was skipped when it last ran: that is the prediction for the next step.
// Before an operator's windows of one micro-batch run, the caller may replace
// the prediction with the decision (plan_skip), from its next window through
// its last one before the following forward window of the same operator.
// An operator that was ever skipped or planned is routed; an entry of a
// routed operator not planned in this step is only predicted. A coordinator
// fetches ahead only what is not skipped, and gathers nothing on a mere
// prediction; a wrong prediction costs bandwidth, never correctness.
//
// Ownership: plain data plus two callbacks set at construction (the
// coordinator's view of operators and parameter sizes), which must stay valid.
// Thread-safety: none; the training thread drives it.
// Errors: none thrown; a divergence is reported through Advance / end_step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "offload/hook_ids.h"

namespace strata::offload {

class OperatorTrace {
 public:
  struct Entry {
    OpId op = 0;
    Phase phase = Phase::kForward;
    bool operator==(const Entry&) const = default;
  };
  enum class State : uint8_t { kRecording, kFollowing, kDropped };
  static constexpr size_t npos = std::numeric_limits<size_t>::max();

  // params_of(op): the parameters an operator lists (OpInfo::params, in
  // order); numel_of(param): the elements a fetch of it brings (for a ZeRO
  // gather, the gathered numel, padding included).
  using ParamsOf = std::function<const std::vector<ParamId>&(OpId)>;
  using NumelOf = std::function<int64_t(ParamId)>;
  OperatorTrace(ParamsOf params_of, NumelOf numel_of);

  // What advance() saw.
  struct Advance {
    size_t position = npos;  // the matched entry's index (kFollowing only)
    bool dropped = false;    // this window diverged: the trace is gone
    // When dropped: the index the window would have had, the entry expected
    // there (nullopt: the window ran past the trace's end) and its pass.
    size_t at = npos;
    std::optional<Entry> expected;
    size_t pass = npos;         // the pass of `expected` (of the last entry when past the end)
    bool backward_pass = false;
    size_t trace_size = 0;      // entries the dropped trace had
  };
  // Called at each pre_op (and each skipped window): records the window, or
  // checks it against the next entry (see the life cycle). `skipped`: the
  // window runs no kernels (remembered as the entry's prediction).
  Advance advance(OpId op, Phase phase, bool skipped = false);
  // While following: op's windows from the next one up to (not including) the
  // forward window after it will be skipped (or not). No effect otherwise.
  void plan_skip(OpId op, bool skipped);
  // Whether entry i is expected to be skipped (its last run, or plan_skip).
  bool skipped(size_t i) const { return skipped_[i] != 0; }
  // Whether entry i's run is only predicted: its operator is routed and no
  // plan for it came in this step yet.
  bool predicted(size_t i) const {
    const auto op = static_cast<size_t>(entries_[i].op);
    return op < routed_op_.size() && routed_op_[op] != 0 && planned_[i] == 0;
  }
  // Called at the step boundary. Returns true when the step diverged by
  // ending before the trace did; the state moves on as described.
  bool end_step();
  // After end_step() returned true: the windows the step ran and the entry
  // (with its pass) it stopped before.
  const Advance& ended_early() const { return early_; }

  State state() const { return state_; }
  bool following() const { return state_ == State::kFollowing; }
  // How many entries the followed step has matched so far.
  size_t position() const { return cursor_; }
  // Times the trace was dropped since construction.
  int64_t drops() const { return drops_; }

  // The complete trace (valid while following or dropped; empty before the
  // first end_step that closed a recording).
  size_t size() const { return entries_.size(); }
  const Entry& entry(size_t i) const { return entries_[i]; }
  // Which pass entry i belongs to (0-based, in step order) and whether that
  // pass is a backward one.
  size_t pass_of(size_t i) const { return pass_[i]; }
  bool backward_pass(size_t i) const { return entries_[i].phase != Phase::kForward; }
  // The index of the next entry after i that lists the k-th parameter of
  // entry i's operator, or npos when it is not used again in the step.
  size_t next_use(size_t i, size_t k) const { return next_use_[offset_[i] + k]; }
  // Elements fetched by the entries strictly between i and j (i < j).
  int64_t numel_between(size_t i, size_t j) const { return prefix_[j] - prefix_[i + 1]; }

 private:
  void finish_recording();
  void mark_routed(OpId op);
  void describe(size_t at, Advance& out) const;
  void drop();

  ParamsOf params_of_;
  NumelOf numel_of_;
  State state_ = State::kRecording;
  std::vector<Entry> recording_;
  std::vector<uint8_t> recording_skipped_;
  std::vector<Entry> entries_;
  std::vector<uint8_t> skipped_;             // per entry: skipped when it last ran, or planned
  std::vector<uint8_t> planned_;             // per entry: plan_skip set it in this step
  std::vector<uint8_t> routed_op_;           // per operator: ever skipped or planned
  std::vector<std::vector<size_t>> of_op_;   // per operator: its entries, in order
  std::vector<size_t> pass_;       // per entry
  std::vector<size_t> offset_;     // per entry: its first slot in next_use_
  std::vector<size_t> next_use_;   // per (entry, k-th parameter)
  std::vector<int64_t> prefix_;    // prefix_[i]: elements of entries [0, i)
  size_t cursor_ = 0;
  Advance early_;
  int64_t drops_ = 0;
};

}  // namespace strata::offload
