// Builds the ZeRO partition layout and copies parameters to and from shards.
#include "partition/layout.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace strata::partition {
namespace {
int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }
}  // namespace

int64_t ParamSlot::owned_numel(int rank) const {
  int64_t begin = owned_begin(rank);
  return std::clamp<int64_t>(numel - begin, 0, slice_numel);
}

PartitionLayout::PartitionLayout(std::vector<ParamSpec> params, const LayoutOptions& options)
    : world_size_(options.world_size), alignment_nbytes_(options.alignment_nbytes) {
  STRATA_CHECK(world_size_ >= 1, kBadArgument, "world size must be >= 1, got {}", world_size_);
  STRATA_CHECK(alignment_nbytes_ >= 4 && (alignment_nbytes_ & (alignment_nbytes_ - 1)) == 0,
               kBadArgument, "alignment must be a power of two >= 4 bytes, got {}", alignment_nbytes_);
  STRATA_CHECK(options.sub_group_numel >= 1, kBadArgument, "sub_group_numel must be >= 1, got {}",
               options.sub_group_numel);
  slots_.reserve(params.size());
  for (auto& spec : params) {
    int64_t numel = shape_numel(spec.shape);
    STRATA_CHECK(numel >= 0, kBadArgument, "parameter '{}' has a negative shape {}", spec.name,
                 shape_string(spec.shape));
    int64_t align_numel = static_cast<int64_t>(alignment_nbytes_ / dtype_nbytes(spec.dtype));
    ParamSlot slot;
    slot.name = std::move(spec.name);
    slot.dtype = spec.dtype;
    slot.numel = numel;
    // Even an empty parameter gets one aligned slice, so every parameter has a
    // place in every shard and offsets stay aligned.
    slot.slice_numel = round_up(std::max<int64_t>(1, (numel + world_size_ - 1) / world_size_), align_numel);
    slot.shard_offset_nbytes = shard_nbytes_;
    slot.shard_offset_numel = shard_numel_;
    shard_nbytes_ += slot.slice_nbytes();
    shard_numel_ += slot.slice_numel;
    total_numel_ += numel;
    slots_.push_back(std::move(slot));
  }

  // Sub-groups: walk the shard, cutting it into pieces of at most
  // sub_group_numel elements at alignment boundaries.
  SubGroup current;
  for (size_t p = 0; p < slots_.size(); ++p) {
    const ParamSlot& slot = slots_[p];
    int64_t align_numel = static_cast<int64_t>(alignment_nbytes_ / dtype_nbytes(slot.dtype));
    int64_t limit = round_up(options.sub_group_numel, align_numel);
    int64_t begin = 0;
    while (begin < slot.slice_numel) {
      // Cut only at this dtype's alignment; an empty sub-group always has room
      // for one aligned unit because the limit is rounded up to it.
      int64_t room = std::max<int64_t>(0, limit - current.numel) / align_numel * align_numel;
      int64_t take = std::min(slot.slice_numel - begin, room);
      if (take == 0) {
        sub_groups_.push_back(std::move(current));
        current = SubGroup{};
        continue;
      }
      current.segments.push_back({p, begin, take});
      current.numel += take;
      begin += take;
    }
  }
  if (current.numel > 0) sub_groups_.push_back(std::move(current));
}

void PartitionLayout::shard_param(size_t p, const void* param, int rank, void* shard) const {
  STRATA_CHECK(rank >= 0 && rank < world_size_, kBadArgument, "rank {} outside world size {}", rank,
               world_size_);
  const ParamSlot& slot = slots_.at(p);
  size_t element_nbytes = dtype_nbytes(slot.dtype);
  auto* dst = static_cast<char*>(shard) + slot.shard_offset_nbytes;
  size_t owned_nbytes = static_cast<size_t>(slot.owned_numel(rank)) * element_nbytes;
  if (owned_nbytes > 0) {
    std::memcpy(dst, static_cast<const char*>(param) + slot.owned_begin(rank) * element_nbytes,
                owned_nbytes);
  }
  std::memset(dst + owned_nbytes, 0, slot.slice_nbytes() - owned_nbytes);
}

void PartitionLayout::gather_param(size_t p, const std::vector<const void*>& shards, void* param) const {
  STRATA_CHECK(shards.size() == static_cast<size_t>(world_size_), kBadArgument,
               "gather_param needs {} shards, got {}", world_size_, shards.size());
  const ParamSlot& slot = slots_.at(p);
  size_t element_nbytes = dtype_nbytes(slot.dtype);
  for (int rank = 0; rank < world_size_; ++rank) {
    size_t owned_nbytes = static_cast<size_t>(slot.owned_numel(rank)) * element_nbytes;
    if (owned_nbytes == 0) continue;
    std::memcpy(static_cast<char*>(param) + slot.owned_begin(rank) * element_nbytes,
                static_cast<const char*>(shards[rank]) + slot.shard_offset_nbytes, owned_nbytes);
  }
}

}  // namespace strata::partition
