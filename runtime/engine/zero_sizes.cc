// choose_zero_sizes: sub_group_size and reduce_bucket_size from the model's
// decoder layers (zero_sizes.h).
#include "runtime/engine/zero_sizes.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <map>

#include "core/error.h"

namespace strata::engine {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Elements one rank holds of a parameter: its slice, padded as
// partition::PartitionLayout pads it (at least one aligned unit).
int64_t slice_numel(const SizedParam& p, int world_size, size_t alignment_nbytes) {
  const auto align = std::max<int64_t>(1, static_cast<int64_t>(alignment_nbytes / dtype_nbytes(p.dtype)));
  return ceil_div(std::max<int64_t>(1, ceil_div(p.numel, world_size)), align) * align;
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

}  // namespace

std::string layer_of(std::string_view name) {
  size_t start = 0;
  while (start <= name.size()) {
    const size_t dot = name.find('.', start);
    const size_t end = dot == std::string_view::npos ? name.size() : dot;
    if (all_digits(name.substr(start, end - start))) return std::string(name.substr(0, end));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return "";
}

int32_t layer_index_of(std::string_view name) {
  const std::string layer = layer_of(name);
  if (layer.empty()) return -1;
  const size_t dot = layer.rfind('.');
  const std::string_view digits = std::string_view(layer).substr(dot == std::string::npos ? 0 : dot + 1);
  int64_t n = 0;
  for (char c : digits) {
    n = n * 10 + (c - '0');
    if (n > std::numeric_limits<int32_t>::max()) return -1;
  }
  return static_cast<int32_t>(n);
}

ZeroSizes choose_zero_sizes(const std::vector<SizedParam>& params, int world_size, int64_t sub_group_numel,
                            int64_t reduce_bucket_numel, size_t alignment_nbytes) {
  STRATA_CHECK(world_size >= 1, kBadArgument, "world size must be >= 1, got {}", world_size);
  STRATA_CHECK(sub_group_numel >= 0, kBadArgument, "sub_group_size must be >= 1 (or left out), got {}",
               sub_group_numel);
  STRATA_CHECK(reduce_bucket_numel >= 0, kBadArgument, "reduce_bucket_size must be >= 1 (or left out), got {}",
               reduce_bucket_numel);
  ZeroSizes out;
  out.world_size = world_size;
  // Per layer, the trained parameters' full (padded) and per-rank elements.
  // A model without named layers is one piece: the whole trained model.
  struct Layer {
    int64_t full = 0, shard = 0;
  };
  std::map<std::string, Layer> layers;
  Layer whole;
  int64_t smallest_in_layer = 0;  // the smallest trained parameter of any layer (full, padded): a norm
  int64_t all_shard = 0;          // this rank's shard of every parameter, frozen ones too
  for (const SizedParam& p : params) {
    const int64_t slice = slice_numel(p, world_size, alignment_nbytes);
    all_shard += slice;
    if (!p.trained) continue;
    whole.full += slice * world_size;
    whole.shard += slice;
    const std::string layer = layer_of(p.name);
    if (layer.empty()) continue;
    Layer& l = layers[layer];
    l.full += slice * world_size;
    l.shard += slice;
    smallest_in_layer = smallest_in_layer == 0 ? slice * world_size : std::min(smallest_in_layer, slice * world_size);
  }
  out.layers = static_cast<int64_t>(layers.size());
  Layer largest = whole;
  if (!layers.empty()) {
    largest = {};
    for (const auto& [name, l] : layers) {
      if (l.full > largest.full) largest = l;
    }
  }
  out.layer_numel = largest.full;
  out.layer_shard_numel = largest.shard;

  if (sub_group_numel > 0) {
    out.sub_group_numel = sub_group_numel;
  } else {
    const int64_t cap = kMaxChosenSubGroupNbytes / kOptimizerRecordBytesPerElement;
    const int64_t shard = std::max<int64_t>(1, largest.shard);
    out.sub_group_pieces = ceil_div(shard, cap);
    out.sub_group_numel = ceil_div(shard, out.sub_group_pieces);
    out.sub_group_chosen = true;
    const int64_t fewest = ceil_div(all_shard, kMaxChosenSubGroups);
    if (out.sub_group_numel < fewest) {
      out.sub_group_numel = fewest;
      out.sub_group_pieces = 1;
      out.sub_group_count_bound = true;
    }
  }
  if (reduce_bucket_numel > 0) {
    out.reduce_bucket_numel = reduce_bucket_numel;
  } else {
    // A layer's gradients plus the smallest layer parameter (a norm's): the
    // final norm's gradient, which comes just before the last layer's in
    // backward, then shares the last layer's bucket, and every bucket closes
    // when the next layer's first (larger) gradient arrives.
    const int64_t cap = kMaxChosenBucketNbytes / static_cast<int64_t>(sizeof(float));
    const int64_t full = std::max<int64_t>(1, largest.full);
    out.bucket_pieces = ceil_div(full + smallest_in_layer, cap);
    out.reduce_bucket_numel =
        out.bucket_pieces == 1 ? full + smallest_in_layer : ceil_div(full, out.bucket_pieces);
    out.reduce_bucket_chosen = true;
  }
  return out;
}

std::string ZeroSizes::describe() const {
  const std::string basis =
      layers > 0 ? fmt::format("the largest of {} decoder layers: {} trained elements, {} per rank over {} rank(s)",
                               layers, layer_numel, layer_shard_numel, world_size)
                 : fmt::format("no decoder layers named (no parameter name has an all-digit component), so the "
                               "whole trained model: {} elements, {} per rank over {} rank(s)",
                               layer_numel, layer_shard_numel, world_size);
  const std::string unit = layers > 0 ? "one layer" : "the whole model";
  const std::string sub =
      !sub_group_chosen ? fmt::format("sub_group_size {} (as given)", sub_group_numel)
      : sub_group_count_bound
          ? fmt::format("sub_group_size {} (1/{} of this rank's shard: {}'s share would make more sub-groups than "
                        "that)",
                        sub_group_numel, kMaxChosenSubGroups, unit)
      : sub_group_pieces == 1
          ? fmt::format("sub_group_size {} ({}'s share of this rank's shard)", sub_group_numel, unit)
          : fmt::format("sub_group_size {} ({}'s share of this rank's shard in {} pieces, each at most {} MiB "
                        "of optimizer state)",
                        sub_group_numel, unit, sub_group_pieces, kMaxChosenSubGroupNbytes >> 20);
  const std::string bucket =
      !reduce_bucket_chosen ? fmt::format("reduce_bucket_size {} (as given)", reduce_bucket_numel)
      : bucket_pieces == 1
          ? fmt::format("reduce_bucket_size {} ({})", reduce_bucket_numel,
                        layers > 0 ? "one layer's gradients and a norm's" : "the whole model's gradients")
          : fmt::format("reduce_bucket_size {} ({}'s gradients in {} pieces, each at most {} MiB)",
                        reduce_bucket_numel, unit, bucket_pieces, kMaxChosenBucketNbytes >> 20);
  if (!sub_group_chosen && !reduce_bucket_chosen) return fmt::format("{}, {}", sub, bucket);
  if (layers == 0) return fmt::format("{}, {}: chosen from the model ({})", sub, bucket, basis);
  return fmt::format("{}, {}: chosen from the model ({}) so that each layer's gradients are reduced and its "
                     "optimizer sub-group updated while backward goes on",
                     sub, bucket, basis);
}

nlohmann::json ZeroSizes::to_json() const {
  return {{"sub_group_size", sub_group_numel},
          {"reduce_bucket_size", reduce_bucket_numel},
          {"sub_group_size_chosen", sub_group_chosen},
          {"reduce_bucket_size_chosen", reduce_bucket_chosen},
          {"why", describe()}};
}

}  // namespace strata::engine
