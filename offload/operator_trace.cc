// OperatorTrace: recording, following and dropping the step's window sequence.
#include "offload/operator_trace.h"

#include <algorithm>
#include <unordered_map>

namespace strata::offload {

OperatorTrace::OperatorTrace(ParamsOf params_of, NumelOf numel_of)
    : params_of_(std::move(params_of)), numel_of_(std::move(numel_of)) {}

OperatorTrace::Advance OperatorTrace::advance(OpId op, Phase phase, bool skipped) {
  if (skipped) mark_routed(op);
  Advance result;
  const Entry window{op, phase};
  switch (state_) {
    case State::kRecording:
      recording_.push_back(window);
      recording_skipped_.push_back(skipped ? 1 : 0);
      break;
    case State::kDropped:
      break;
    case State::kFollowing:
      if (cursor_ < entries_.size() && entries_[cursor_] == window) {
        skipped_[cursor_] = skipped ? 1 : 0;  // the prediction for the next step
        result.position = cursor_++;
        break;
      }
      result.dropped = true;
      describe(cursor_, result);
      drop();
      break;
  }
  return result;
}

void OperatorTrace::mark_routed(OpId op) {
  const auto i = static_cast<size_t>(op);
  if (i >= routed_op_.size()) routed_op_.resize(i + 1, 0);
  routed_op_[i] = 1;
}

void OperatorTrace::plan_skip(OpId op, bool skipped) {
  mark_routed(op);
  if (state_ != State::kFollowing || static_cast<size_t>(op) >= of_op_.size()) return;
  const std::vector<size_t>& mine = of_op_[static_cast<size_t>(op)];
  auto it = std::lower_bound(mine.begin(), mine.end(), cursor_);
  for (auto first = it; it != mine.end(); ++it) {
    if (it != first && entries_[*it].phase == Phase::kForward) break;  // the next micro-batch's
    skipped_[*it] = skipped ? 1 : 0;
    planned_[*it] = 1;
  }
}

bool OperatorTrace::end_step() {
  bool ended_early = false;
  switch (state_) {
    case State::kRecording:
      if (!recording_.empty()) finish_recording();
      break;
    case State::kDropped:
      state_ = State::kRecording;
      break;
    case State::kFollowing:
      if (cursor_ == 0) break;  // no window this step: nothing to compare
      if (cursor_ < entries_.size()) {
        ended_early = true;
        early_ = Advance{};
        early_.dropped = true;
        describe(cursor_, early_);
        drop();
        state_ = State::kRecording;
      }
      break;
  }
  cursor_ = 0;
  std::fill(planned_.begin(), planned_.end(), 0);  // the next step's entries are predictions again
  return ended_early;
}

void OperatorTrace::describe(size_t at, Advance& out) const {
  out.at = at;
  out.trace_size = entries_.size();
  if (entries_.empty()) return;
  const size_t i = at < entries_.size() ? at : entries_.size() - 1;
  if (at < entries_.size()) out.expected = entries_[at];
  out.pass = pass_[i];
  out.backward_pass = backward_pass(i);
}

void OperatorTrace::drop() {
  state_ = State::kDropped;
  ++drops_;
  entries_.clear();
  recording_.clear();
  recording_skipped_.clear();
}

void OperatorTrace::finish_recording() {
  entries_ = std::move(recording_);
  skipped_ = std::move(recording_skipped_);
  recording_.clear();
  recording_skipped_.clear();
  const size_t n = entries_.size();
  planned_.assign(n, 0);
  of_op_.clear();
  for (size_t i = 0; i < n; ++i) {
    const auto op = static_cast<size_t>(entries_[i].op);
    if (op >= of_op_.size()) of_op_.resize(op + 1);
    of_op_[op].push_back(i);
  }
  pass_.assign(n, 0);
  offset_.assign(n + 1, 0);
  prefix_.assign(n + 1, 0);
  size_t pass = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && backward_pass(i) != backward_pass(i - 1)) ++pass;
    pass_[i] = pass;
    const auto& params = params_of_(entries_[i].op);
    offset_[i + 1] = offset_[i] + params.size();
    int64_t numel = 0;
    for (ParamId p : params) numel += numel_of_(p);
    prefix_[i + 1] = prefix_[i] + numel;
  }
  // Next uses, walking backwards with the latest use seen of each parameter.
  next_use_.assign(offset_[n], npos);
  std::unordered_map<ParamId, size_t> later;
  for (size_t i = n; i-- > 0;) {
    const auto& params = params_of_(entries_[i].op);
    for (size_t k = 0; k < params.size(); ++k) {
      auto it = later.find(params[k]);
      next_use_[offset_[i] + k] = it == later.end() ? npos : it->second;
    }
    for (ParamId p : params) later[p] = i;
  }
  state_ = State::kFollowing;
  cursor_ = 0;
}

}  // namespace strata::offload
