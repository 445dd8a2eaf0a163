// Property tests of the partition layout over random shapes and world sizes 1-16.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <set>

#include "partition/layout.h"
#include "core/error.h"

using namespace strata;
using namespace strata::partition;

namespace {
std::vector<ParamSpec> random_params(std::mt19937& rng) {
  std::uniform_int_distribution<int> count(1, 8), rank(0, 3), dim(0, 300), dtype(0, 2);
  std::vector<ParamSpec> params;
  int n = count(rng);
  for (int p = 0; p < n; ++p) {
    Shape shape;
    int dims = rank(rng);
    for (int d = 0; d < dims; ++d) shape.push_back(dim(rng) % (d == 0 ? 300 : 40));
    params.push_back({"p" + std::to_string(p), shape, static_cast<DType>(dtype(rng))});
  }
  return params;
}
}  // namespace

TEST_CASE("layout: every element is owned by exactly one rank, shards are equal and aligned, gather inverts shard") {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    auto specs = random_params(rng);
    LayoutOptions options;
    options.world_size = 1 + trial % 16;
    options.alignment_nbytes = trial % 3 == 0 ? 64 : kDefaultAlignmentNbytes;
    options.sub_group_numel = 1 + static_cast<int64_t>(rng() % 5000);
    PartitionLayout layout(specs, options);
    INFO("trial " << trial << " world " << options.world_size << " params " << specs.size());
    REQUIRE(layout.params().size() == specs.size());
    REQUIRE(layout.shard_nbytes() % options.alignment_nbytes == 0);

    // Whole parameters filled with distinct bytes, sharded per rank, gathered back.
    std::vector<std::vector<char>> shards(static_cast<size_t>(options.world_size),
                                          std::vector<char>(layout.shard_nbytes(), 0x55));
    std::vector<std::vector<char>> originals;
    for (size_t p = 0; p < specs.size(); ++p) {
      const ParamSlot& slot = layout.param(p);
      REQUIRE(slot.numel == shape_numel(specs[p].shape));
      REQUIRE(slot.shard_offset_nbytes % options.alignment_nbytes == 0);
      REQUIRE(slot.slice_nbytes() % options.alignment_nbytes == 0);
      // Exactly-once ownership: owned ranges tile [0, numel) without overlap.
      int64_t covered = 0;
      for (int r = 0; r < options.world_size; ++r) {
        int64_t owned = slot.owned_numel(r);
        REQUIRE(owned >= 0);
        REQUIRE(owned <= slot.slice_numel);
        if (owned > 0) REQUIRE(slot.owned_begin(r) == covered);
        covered += owned;
      }
      REQUIRE(covered == slot.numel);
      // No slice wider than needed by more than one alignment unit.
      int64_t align_numel = static_cast<int64_t>(options.alignment_nbytes / dtype_nbytes(slot.dtype));
      REQUIRE(slot.slice_numel < (slot.numel + options.world_size - 1) / options.world_size + align_numel + 1);

      std::vector<char> param(static_cast<size_t>(slot.numel) * dtype_nbytes(slot.dtype));
      for (size_t i = 0; i < param.size(); ++i) param[i] = static_cast<char>(rng());
      for (int r = 0; r < options.world_size; ++r) layout.shard_param(p, param.data(), r, shards[r].data());
      originals.push_back(std::move(param));
    }
    // Padding is zero and slices do not overlap: the byte count matches.
    for (size_t p = 0; p < specs.size(); ++p) {
      const ParamSlot& slot = layout.param(p);
      std::vector<const void*> views;
      for (auto& shard : shards) views.push_back(shard.data());
      std::vector<char> gathered(originals[p].size(), 0x33);
      layout.gather_param(p, views, gathered.data());
      REQUIRE(gathered == originals[p]);
      for (int r = 0; r < options.world_size; ++r) {
        size_t owned_nbytes = static_cast<size_t>(slot.owned_numel(r)) * dtype_nbytes(slot.dtype);
        size_t nonzero_padding = 0;
        for (size_t b = owned_nbytes; b < slot.slice_nbytes(); ++b) {
          nonzero_padding += shards[r][slot.shard_offset_nbytes + b] != 0;
        }
        REQUIRE(nonzero_padding == 0);
      }
    }
    // Sub-groups cover each slice exactly once, in order, within the size limit.
    std::vector<int64_t> next(specs.size(), 0);
    int64_t sub_group_total = 0;
    for (const SubGroup& group : layout.sub_groups()) {
      int64_t sum = 0;
      for (const SubGroupSegment& segment : group.segments) {
        REQUIRE(segment.slice_begin_numel == next[segment.param_index]);
        next[segment.param_index] += segment.numel;
        sum += segment.numel;
        const ParamSlot& slot = layout.param(segment.param_index);
        int64_t align_numel = static_cast<int64_t>(options.alignment_nbytes / dtype_nbytes(slot.dtype));
        REQUIRE(segment.slice_begin_numel % align_numel == 0);
      }
      REQUIRE(sum == group.numel);
      REQUIRE(group.numel > 0);
      sub_group_total += sum;
    }
    for (size_t p = 0; p < specs.size(); ++p) REQUIRE(next[p] == layout.param(p).slice_numel);
    REQUIRE(sub_group_total == layout.shard_numel());
  }
}

TEST_CASE("layout: a known small case") {
  PartitionLayout layout({{"w", {10, 3}, DType::kF32}, {"b", {3}, DType::kBF16}}, {4, 64, 1000});
  REQUIRE(layout.param(0).slice_numel == 16);  // ceil(30 / 4) = 8, rounded to 64 B of fp32
  REQUIRE(layout.param(0).owned_numel(0) == 16);
  REQUIRE(layout.param(0).owned_numel(1) == 14);
  REQUIRE(layout.param(0).owned_numel(2) == 0);
  REQUIRE(layout.param(1).slice_numel == 32);  // 64 B of bf16
  REQUIRE(layout.param(1).shard_offset_nbytes == 64);
  REQUIRE(layout.shard_nbytes() == 128);
}

TEST_CASE("layout: invalid options are rejected with the reason") {
  REQUIRE_THROWS_WITH(PartitionLayout({{"w", {4}, DType::kF32}}, {0, 4096, 10}),
                      Catch::Contains("world size must be >= 1"));
  REQUIRE_THROWS_WITH(PartitionLayout({{"w", {4}, DType::kF32}}, {2, 3000, 10}),
                      Catch::Contains("power of two"));
}
