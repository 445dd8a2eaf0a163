// Per-layer accounting of the parameter coordinator: see layer_fetch.h.
#include "offload/layer_fetch.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/trace_recorder.h"

namespace strata::offload {

LayerFetch& LayerFetch::operator+=(const LayerFetch& o) {
  windows += o.windows;
  skipped_windows += o.skipped_windows;
  gathers += o.gathers;
  gather_nbytes += o.gather_nbytes;
  reads += o.reads;
  read_nbytes += o.read_nbytes;
  stalled_windows += o.stalled_windows;
  stall_seconds += o.stall_seconds;
  return *this;
}

std::vector<LayerCounterNames> layer_counter_names(int32_t slots) {
  std::vector<LayerCounterNames> names;
  for (int32_t slot = 0; slot < slots; ++slot) {
    const std::string layer = slot == 0 ? std::string("no layer") : fmt::format("layer {}", slot - 1);
    names.push_back({"param bytes read: " + layer, "param bytes gathered: " + layer, "param stall us: " + layer});
  }
  return names;
}

LayerTally::LayerTally(std::vector<int32_t> op_layer, size_t param_count, const ParamsOf& params_of)
    : op_layer_(std::move(op_layer)) {
  // A parameter counts for the layer all its operators share; kUnset until
  // the first one lists it, -1 when two of different layers do.
  constexpr int32_t kUnset = -2;
  param_layer_.assign(param_count, kUnset);
  for (size_t op = 0; op < op_layer_.size(); ++op) {
    const int32_t layer = std::max<int32_t>(op_layer_[op], -1);
    op_layer_[op] = layer;
    slots_ = std::max(slots_, layer + 2);
    for (ParamId id : params_of(static_cast<OpId>(op))) {
      int32_t& p = param_layer_[static_cast<size_t>(id)];
      p = p == kUnset || p == layer ? layer : -1;
    }
  }
  for (int32_t& p : param_layer_) p = std::max(p, int32_t{-1});  // listed by no operator: no layer
  names_ = std::make_shared<const std::vector<LayerCounterNames>>(layer_counter_names(slots_));
}

LayerFetch& LayerTally::at(std::vector<LayerFetch>& counts, int32_t layer) const {
  if (counts.size() < static_cast<size_t>(slots_)) {
    const size_t from = counts.size();
    counts.resize(static_cast<size_t>(slots_));
    for (size_t slot = from; slot < counts.size(); ++slot) counts[slot].layer = static_cast<int32_t>(slot) - 1;
  }
  return counts[static_cast<size_t>(layer + 1)];
}

void LayerTally::trace_bytes(const LayerFetch& entry) const {
  if (!trace::enabled()) return;
  const LayerCounterNames& names = (*names_)[static_cast<size_t>(entry.layer + 1)];
  trace::counter(names.read, static_cast<int64_t>(entry.read_nbytes));
  trace::counter(names.gathered, static_cast<int64_t>(entry.gather_nbytes));
}

void LayerTally::trace_reset() const {
  if (!trace::enabled()) return;
  for (const LayerCounterNames& names : *names_) {
    trace::counter(names.read, 0);
    trace::counter(names.gathered, 0);
  }
}

}  // namespace strata::offload
