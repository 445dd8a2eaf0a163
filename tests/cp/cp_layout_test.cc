// The context-parallel dimension of ParallelLayout (partition/process_groups.h):
// world = pp × dp × cp × tp in Megatron's order (tp fastest, then cp, then dp,
// then pp), every rank in one group of each kind, and the refusals by name.
#include <catch2/catch.hpp>

#include <set>
#include <vector>

#include "partition/process_groups.h"

using namespace strata;
using namespace strata::partition;
using Ranks = std::vector<int>;

namespace {
std::vector<Ranks> ranks_of(const ParallelLayout& layout, GroupKind kind) {
  std::vector<Ranks> out;
  for (const ProcessGroup& group : layout.groups(kind)) out.push_back(group.ranks);
  return out;
}
}  // namespace

TEST_CASE("process groups: pp x dp x cp x tp in Megatron's order, tp fastest, then cp, then dp, then pp", "[cp]") {
  const ParallelLayout layout(16, 2, 1, 2, 2);  // 2 stages of dp 2 x cp 2 x tp 2
  REQUIRE((layout.dp_size() == 2 && layout.cp_size() == 2 && layout.pp_size() == 2));
  REQUIRE(ranks_of(layout, GroupKind::kTensor) ==
          std::vector<Ranks>{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  REQUIRE(ranks_of(layout, GroupKind::kContext) ==
          std::vector<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  REQUIRE(ranks_of(layout, GroupKind::kData) ==
          std::vector<Ranks>{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
  REQUIRE(ranks_of(layout, GroupKind::kPipeline) ==
          std::vector<Ranks>{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
  REQUIRE(layout.group_of(GroupKind::kContext, 6).name() == "cp group 2 (ranks 4,6)");
  // ZeRO's ranks with cp: a stage's ranks of one tp rank, dp x cp of them.
  REQUIRE(ranks_of(layout, GroupKind::kDataContext) ==
          std::vector<Ranks>{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
  REQUIRE(layout.group_of(GroupKind::kDataContext, 13).name() == "dp-cp group 3 (ranks 9,11,13,15)");
  REQUIRE((layout.pp_rank(13) == 1 && layout.dp_rank(13) == 1 && layout.cp_rank(13) == 0 && layout.tp_rank(13) == 1));
  // cp alone: one cp group of every rank.
  const ParallelLayout alone(4, 1, 1, 1, 4);
  REQUIRE(ranks_of(alone, GroupKind::kContext) == std::vector<Ranks>{{0, 1, 2, 3}});
  REQUIRE(ranks_of(alone, GroupKind::kData) == std::vector<Ranks>{{0}, {1}, {2}, {3}});
  // Without cp every rank is its own cp group and the layout is what it was.
  const ParallelLayout none(8, 2, 1, 2);
  REQUIRE(ranks_of(none, GroupKind::kData) == std::vector<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  REQUIRE(ranks_of(none, GroupKind::kContext).size() == 8);
}

TEST_CASE("process groups: with cp, every rank is in one group of each kind, the groups crossing in it only",
          "[cp]") {
  for (int world : {1, 2, 4, 6, 8, 12, 16}) {
    for (int pp = 1; pp <= world; ++pp) {
      for (int cp = 1; pp * cp <= world; ++cp) {
        for (int tp = 1; pp * cp * tp <= world; ++tp) {
          if (world % (pp * cp * tp) != 0) continue;
          const int dp = world / (pp * cp * tp);
          INFO("world " << world << " pp " << pp << " cp " << cp << " tp " << tp);
          const ParallelLayout layout(world, tp, 1, pp, cp);
          const std::pair<GroupKind, int> sizes[] = {
              {GroupKind::kTensor, tp}, {GroupKind::kContext, cp}, {GroupKind::kData, dp}, {GroupKind::kPipeline, pp},
              {GroupKind::kDataContext, dp * cp}};
          for (const auto& [kind, size] : sizes) {
            std::multiset<int> seen;
            for (const ProcessGroup& group : layout.groups(kind)) {
              REQUIRE(static_cast<int>(group.ranks.size()) == size);
              seen.insert(group.ranks.begin(), group.ranks.end());
            }
            REQUIRE(static_cast<int>(seen.size()) == world);
            for (int r = 0; r < world; ++r) REQUIRE(seen.count(r) == 1);
          }
          for (int r = 0; r < world; ++r) {
            REQUIRE(r == ((layout.pp_rank(r) * dp + layout.dp_rank(r)) * cp + layout.cp_rank(r)) * tp +
                             layout.tp_rank(r));
            // Each group varies its own coordinate only.
            for (int q : layout.group_of(GroupKind::kContext, r).ranks) {
              REQUIRE((layout.pp_rank(q) == layout.pp_rank(r) && layout.dp_rank(q) == layout.dp_rank(r) &&
                       layout.tp_rank(q) == layout.tp_rank(r)));
            }
            for (int q : layout.group_of(GroupKind::kData, r).ranks) {
              REQUIRE((layout.pp_rank(q) == layout.pp_rank(r) && layout.cp_rank(q) == layout.cp_rank(r) &&
                       layout.tp_rank(q) == layout.tp_rank(r)));
            }
            for (int q : layout.group_of(GroupKind::kPipeline, r).ranks) {
              REQUIRE((layout.dp_rank(q) == layout.dp_rank(r) && layout.cp_rank(q) == layout.cp_rank(r) &&
                       layout.tp_rank(q) == layout.tp_rank(r)));
            }
            for (int q : layout.group_of(GroupKind::kDataContext, r).ranks) {
              REQUIRE((layout.pp_rank(q) == layout.pp_rank(r) && layout.tp_rank(q) == layout.tp_rank(r)));
            }
            REQUIRE(layout.group_of(GroupKind::kDataContext, r).member(r) ==
                    layout.dp_rank(r) * cp + layout.cp_rank(r));
            REQUIRE(layout.group_of(GroupKind::kContext, r).member(r) == layout.cp_rank(r));
            REQUIRE(layout.group_of(GroupKind::kData, r).member(r) == layout.dp_rank(r));
            REQUIRE(layout.group_of(GroupKind::kPipeline, r).member(r) == layout.pp_rank(r));
          }
        }
      }
    }
  }
  REQUIRE_THROWS_WITH(ParallelLayout(6, 1, 1, 1, 4),
                      Catch::Contains("a world of 6 ranks is not divisible by the context-parallel size 4"));
  REQUIRE_THROWS_WITH(ParallelLayout(4, 1, 1, 1, 0), Catch::Contains("context-parallel size 0: at least 1 is needed"));
}
