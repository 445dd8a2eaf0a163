// The ZeRO sizes a config leaves out: sub_group_size (the optimizer's unit of
// work over this rank's shard) and reduce_bucket_size (elements of full
// gradients per reduce-scatter), chosen from the model's decoder layers.
//
// Why: DeepSpeed's defaults (1e9 and 5e8 elements) give any model under a
// billion parameters one sub-group and one bucket, so the gradient reduction
// and the optimizer cannot start before backward ends, and overlapping them
// with backward (ZeroEngineOptions::overlap_optimizer) hides nothing. Here a
// sub-group is one decoder layer's share of this rank's shard and a bucket one
// layer's full gradients (plus room for a norm, so that a bucket closes where
// a layer's gradients end and the next layer's begin): backward finishes a
// layer, its bucket is reduced, and its sub-group can be updated while the
// layers below it are still in backward. Each is bounded by memory: a layer
// larger than kMaxChosenSubGroupNbytes of optimizer record, or
// kMaxChosenBucketNbytes of fp32 gradients, is split into equal pieces.
//
// A decoder layer is the parameters sharing a name up to the first
// all-digit component ("model.layers.3.mlp.up_proj.weight" is in
// "model.layers.3"): Hugging Face's naming for every family strata builds
// (nn::hf_tensors), and what a C API user's names follow when they name
// layers so. A model without such names is one piece: its sizes are then
// the whole trained model's (still within the memory bounds), as said in
// describe().
//
// An explicit size (> 0) is kept as given (DeepSpeed's meaning); only a size
// of kChooseFromModel is chosen. Every user of the sizes calls this one
// function: the ZeroEngine at finalize (so strata finetune, strata-train and
// the C API), and `strata plan` (runtime/plan) from the same tensor list.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace strata::engine {

// A size left to choose (ZeroEngineOptions::sub_group_numel / reduce_bucket_numel).
inline constexpr int64_t kChooseFromModel = 0;
// Memory bounds of a chosen size: one pinned optimizer record (fp32 master and
// two moments, 12 bytes per element; offload_optimizer.buffer_count of them),
// and one fp32 gradient bucket (three live at once: the open one and two in flight).
inline constexpr int64_t kMaxChosenSubGroupNbytes = int64_t{256} << 20;
inline constexpr int64_t kMaxChosenBucketNbytes = int64_t{256} << 20;
inline constexpr int64_t kOptimizerRecordBytesPerElement = 12;
// And a bound on their number: every group's layout keeps a record per
// sub-group, so a chosen sub_group_size is at least 1/kMaxChosenSubGroups of
// this rank's whole shard (trained and frozen parameters: every layout is cut
// by it). It binds only where one layer is a sliver of the model (a
// vocabulary of billions, a frozen base far larger than its adapters), and
// wins over the bound above: host memory of the bookkeeping is not counted
// anywhere else, pinned buffers are (allocated with a message naming the key).
inline constexpr int64_t kMaxChosenSubGroups = int64_t{1} << 16;

// A parameter as the choice sees it: its name (for its layer), its size and
// storage dtype (for the shard's padding), and whether it is trained (a frozen
// one has no gradient and no optimizer state).
struct SizedParam {
  std::string name;
  int64_t numel = 0;
  DType dtype = DType::kF32;
  bool trained = true;
};

// The decoder layer `name` belongs to: its prefix up to and including the
// first all-digit component ("model.layers.3"), or "" when it has none.
std::string layer_of(std::string_view name);
// Its index: the number that component holds ("model.layers.3.mlp.experts.5.w1"
// -> 3), or -1 when `name` has none (or it does not fit an int32). What the
// engine gives the parameter coordinator per operator for its per-layer
// accounting (offload::CoordinatedOp::layer).
int32_t layer_index_of(std::string_view name);

struct ZeroSizes {
  int64_t sub_group_numel = 0;      // elements of this rank's shard per optimizer sub-group
  int64_t reduce_bucket_numel = 0;  // full gradient elements per reduce-scatter bucket
  bool sub_group_chosen = false;    // false: as the config gave it
  bool reduce_bucket_chosen = false;
  // What the choice was made from.
  int64_t layers = 0;             // decoder layers with trained parameters
  int64_t layer_numel = 0;        // the largest one's trained elements (full, padded to the shard alignment)
  int64_t layer_shard_numel = 0;  // its share of one rank's shard
  int64_t sub_group_pieces = 1;   // sub-groups per layer (more than 1: split by the memory bound)
  int64_t bucket_pieces = 1;      // buckets per layer
  bool sub_group_count_bound = false;  // raised to 1/kMaxChosenSubGroups of the shard
  int world_size = 1;

  // One line naming both sizes and why: "sub_group_size 425984 (one decoder
  // layer's share of this rank's shard: 4 layers of 851968 elements over 2
  // ranks), reduce_bucket_size 856064 (one layer's gradients + a norm's) ...".
  std::string describe() const;
  // {"sub_group_size": n, "reduce_bucket_size": n, "sub_group_size_chosen": b,
  //  "reduce_bucket_size_chosen": b, "why": describe()} — run.json's "zero_sizes".
  nlohmann::json to_json() const;
};

// The sizes for `params` (in declaration order: the shard's order) over
// `world_size` ranks with shard slices aligned to `alignment_nbytes`
// (partition::LayoutOptions). `sub_group_numel` / `reduce_bucket_numel`:
// > 0 kept, kChooseFromModel chosen. Throws Error(kBadArgument) for a
// negative size or world size < 1.
ZeroSizes choose_zero_sizes(const std::vector<SizedParam>& params, int world_size, int64_t sub_group_numel,
                            int64_t reduce_bucket_numel, size_t alignment_nbytes);

}  // namespace strata::engine
