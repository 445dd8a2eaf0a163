// The ZeRO partition layout (DESIGN.md §5): where each element of a parameter
// group lives once every parameter is split across all data-parallel ranks.
// A pure function of (parameter shapes and dtypes, world size, alignment).
//
// Layout. Parameter p with numel n_p is cut into world_size slices of equal
// length slice_numel_p = round_up(ceil(n_p / world_size), alignment in elements);
// rank r owns elements [r * slice_numel_p, (r + 1) * slice_numel_p) of it, the
// part past n_p being padding (zeros). A rank's shard is the concatenation of
// its slices of every parameter, so all shards have the same length and every
// slice starts at a multiple of `alignment_nbytes` (O_DIRECT and SIMD). An
// allgather of one parameter's slices yields the parameter contiguously,
// followed by padding.
//
// Thread-safety: PartitionLayout is immutable after construction.
// Throws: strata::Error(kBadArgument) for an invalid spec (world size < 1,
// alignment not a power of two or not a multiple of an element size, ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace strata::partition {

// 4 KiB: the O_DIRECT block size of NVMe devices and a multiple of every SIMD width.
inline constexpr size_t kDefaultAlignmentNbytes = 4096;

struct ParamSpec {
  std::string name;
  Shape shape;
  DType dtype = DType::kBF16;
};

// One parameter's place in the layout.
struct ParamSlot {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t numel = 0;                // elements of the parameter
  int64_t slice_numel = 0;          // elements each rank owns (padding included)
  size_t shard_offset_nbytes = 0;   // where this rank's slice starts in its shard
  int64_t shard_offset_numel = 0;   // the same in elements (for buffers of another dtype, e.g. fp32 gradients)

  size_t slice_nbytes() const { return static_cast<size_t>(slice_numel) * dtype_nbytes(dtype); }
  // Elements of the parameter owned by `rank` that are real, not padding.
  int64_t owned_numel(int rank) const;
  // Element index in the parameter of the first element owned by `rank`.
  int64_t owned_begin(int rank) const { return slice_numel * rank; }
};

// A contiguous run of one parameter's slice inside a sub-group.
struct SubGroupSegment {
  size_t param_index = 0;
  int64_t slice_begin_numel = 0;  // offset inside the parameter's slice
  int64_t numel = 0;
};

// What the optimizer processes at once: at most sub_group_numel elements of a
// shard (padding included), split at alignment boundaries.
struct SubGroup {
  std::vector<SubGroupSegment> segments;
  int64_t numel = 0;
};

struct LayoutOptions {
  int world_size = 1;
  size_t alignment_nbytes = kDefaultAlignmentNbytes;
  // Elements per optimizer sub-group (DeepSpeed's sub_group_size); rounded up
  // to the alignment in elements.
  int64_t sub_group_numel = 1'000'000'000;
};

class PartitionLayout {
 public:
  PartitionLayout(std::vector<ParamSpec> params, const LayoutOptions& options);

  int world_size() const { return world_size_; }
  size_t alignment_nbytes() const { return alignment_nbytes_; }
  const std::vector<ParamSlot>& params() const { return slots_; }
  const ParamSlot& param(size_t index) const { return slots_.at(index); }
  // Bytes of each rank's shard (equal for every rank, a multiple of the alignment).
  size_t shard_nbytes() const { return shard_nbytes_; }
  // Elements of each rank's shard, padding included.
  int64_t shard_numel() const { return shard_numel_; }
  // Sum of the parameters' numel, without padding.
  int64_t total_numel() const { return total_numel_; }
  // Sub-groups covering every slice of a shard, in shard order (the same for every rank).
  const std::vector<SubGroup>& sub_groups() const { return sub_groups_; }

  // Copies rank `rank`'s slice of parameter p from the whole parameter `param`
  // (numel elements) into `shard` (shard_nbytes bytes); padding becomes zeros.
  void shard_param(size_t p, const void* param, int rank, void* shard) const;
  // Copies every parameter's slice from the world_size shards back into the
  // whole parameter `param` (numel elements). shards[r] is rank r's shard.
  void gather_param(size_t p, const std::vector<const void*>& shards, void* param) const;

 private:
  int world_size_;
  size_t alignment_nbytes_;
  std::vector<ParamSlot> slots_;
  size_t shard_nbytes_ = 0;
  int64_t shard_numel_ = 0;
  int64_t total_numel_ = 0;
  std::vector<SubGroup> sub_groups_;
};

}  // namespace strata::partition
