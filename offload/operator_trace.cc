// OperatorTrace: recording, following and dropping the step's window sequence.
#include "offload/operator_trace.h"

#include <unordered_map>

namespace strata::offload {

OperatorTrace::OperatorTrace(ParamsOf params_of, NumelOf numel_of)
    : params_of_(std::move(params_of)), numel_of_(std::move(numel_of)) {}

OperatorTrace::Advance OperatorTrace::advance(OpId op, Phase phase) {
  Advance result;
  const Entry window{op, phase};
  switch (state_) {
    case State::kRecording:
      recording_.push_back(window);
      break;
    case State::kDropped:
      break;
    case State::kFollowing:
      if (cursor_ < entries_.size() && entries_[cursor_] == window) {
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
}

void OperatorTrace::finish_recording() {
  entries_ = std::move(recording_);
  recording_.clear();
  const size_t n = entries_.size();
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
