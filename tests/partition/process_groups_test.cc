// Process groups: the tp × dp (× ep) layout as a pure function, and group
// communicators on Gloo with ranks as threads of one process (real TCP over
// loopback): per-group results, and errors that name the group.
#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "partition/process_groups.h"
#include "tests/partition/all_to_all_checks.h"
#include "tests/partition/collective_checks.h"
#include "tests/support/rank_threads.h"

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

TEST_CASE("process groups: 2 x 2 has consecutive tp groups and strided dp groups, named as users read them") {
  const ParallelLayout layout(4, 2);
  REQUIRE(layout.dp_size() == 2);
  REQUIRE(ranks_of(layout, GroupKind::kTensor) == std::vector<Ranks>{{0, 1}, {2, 3}});
  REQUIRE(ranks_of(layout, GroupKind::kData) == std::vector<Ranks>{{0, 2}, {1, 3}});
  REQUIRE(ranks_of(layout, GroupKind::kExpert) == std::vector<Ranks>{{0}, {1}, {2}, {3}});  // ep = 1
  REQUIRE(ranks_of(layout, GroupKind::kExpertData) == std::vector<Ranks>{{0, 2}, {1, 3}});
  REQUIRE(layout.group_of(GroupKind::kTensor, 3).name() == "tp group 1 (ranks 2,3)");
  REQUIRE(layout.group_of(GroupKind::kData, 2).name() == "dp group 0 (ranks 0,2)");
  REQUIRE(layout.group_of(GroupKind::kExpert, 2).name() == "ep group 2 (rank 2)");
  REQUIRE(layout.group_of(GroupKind::kExpertData, 1).name() == "expert-dp group 1 (ranks 1,3)");
  REQUIRE(layout.tp_rank(3) == 1);
  REQUIRE(layout.dp_rank(3) == 1);
}

TEST_CASE("process groups: expert parallelism splits each dp group into consecutive ep groups") {
  const ParallelLayout layout(8, 2, 2);  // dp groups {0,2,4,6} and {1,3,5,7}
  REQUIRE(ranks_of(layout, GroupKind::kData) == std::vector<Ranks>{{0, 2, 4, 6}, {1, 3, 5, 7}});
  REQUIRE(ranks_of(layout, GroupKind::kExpert) == std::vector<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  REQUIRE(ranks_of(layout, GroupKind::kExpertData) == std::vector<Ranks>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // No tensor parallelism, ep = dp (issue 27's default): one ep group, experts not replicated.
  const ParallelLayout moe(4, 1, 4);
  REQUIRE(ranks_of(moe, GroupKind::kExpert) == std::vector<Ranks>{{0, 1, 2, 3}});
  REQUIRE(ranks_of(moe, GroupKind::kExpertData) == std::vector<Ranks>{{0}, {1}, {2}, {3}});
  REQUIRE(ranks_of(moe, GroupKind::kTensor) == std::vector<Ranks>{{0}, {1}, {2}, {3}});
}

TEST_CASE("process groups: every rank is in one group of each kind, of the right size, for many shapes") {
  for (int world : {1, 2, 3, 4, 6, 8, 12, 16}) {
    for (int tp = 1; tp <= world; ++tp) {
      if (world % tp != 0) continue;
      const int dp = world / tp;
      for (int ep = 1; ep <= dp; ++ep) {
        if (dp % ep != 0) continue;
        INFO("world " << world << " tp " << tp << " ep " << ep);
        const ParallelLayout layout(world, tp, ep);
        const std::pair<GroupKind, int> sizes[] = {
            {GroupKind::kTensor, tp}, {GroupKind::kData, dp}, {GroupKind::kExpert, ep}, {GroupKind::kExpertData, dp / ep}};
        for (const auto& [kind, size] : sizes) {
          std::multiset<int> seen;
          int lowest = -1;
          for (size_t i = 0; i < layout.groups(kind).size(); ++i) {
            const ProcessGroup& group = layout.groups(kind)[i];
            REQUIRE(group.index == static_cast<int>(i));
            REQUIRE(static_cast<int>(group.ranks.size()) == size);
            REQUIRE(group.ranks.front() > lowest);  // numbered by lowest rank
            lowest = group.ranks.front();
            seen.insert(group.ranks.begin(), group.ranks.end());
          }
          REQUIRE(static_cast<int>(seen.size()) == world);
          for (int r = 0; r < world; ++r) REQUIRE(seen.count(r) == 1);
        }
        for (int r = 0; r < world; ++r) {
          const ProcessGroup& tp_group = layout.group_of(GroupKind::kTensor, r);
          const ProcessGroup& dp_group = layout.group_of(GroupKind::kData, r);
          REQUIRE(tp_group.member(r) == layout.tp_rank(r));
          REQUIRE(dp_group.member(r) == layout.dp_rank(r));
          REQUIRE(tp_group.ranks.back() - tp_group.ranks.front() == tp - 1);  // consecutive
          for (size_t k = 1; k < dp_group.ranks.size(); ++k) REQUIRE(dp_group.ranks[k] - dp_group.ranks[k - 1] == tp);
          // ep and expert-dp groups lie inside the rank's dp group and cross in this rank only.
          const ProcessGroup& ep_group = layout.group_of(GroupKind::kExpert, r);
          const ProcessGroup& edp_group = layout.group_of(GroupKind::kExpertData, r);
          for (int q : ep_group.ranks) REQUIRE(dp_group.member(q) >= 0);
          for (int q : edp_group.ranks) REQUIRE(dp_group.member(q) >= 0);
          for (int q : ep_group.ranks) REQUIRE((q == r) == (edp_group.member(q) >= 0));
        }
      }
    }
  }
}

TEST_CASE("process groups: sizes that do not divide are refused, naming them") {
  REQUIRE_THROWS_WITH(ParallelLayout(6, 4),
                      Catch::Contains("a world of 6 ranks is not divisible by the tensor-parallel size 4") &&
                          Catch::Contains("world = tp × dp"));
  REQUIRE_THROWS_WITH(ParallelLayout(8, 2, 3),
                      Catch::Contains("the expert-parallel size 3 does not divide the data-parallel size 4"));
  REQUIRE_THROWS_WITH(ParallelLayout(4, 0), Catch::Contains("tensor-parallel size 0"));
  REQUIRE_THROWS_WITH(ParallelLayout(4, 2).group_of(GroupKind::kData, 4),
                      Catch::Contains("rank 4 is outside a world of 4 ranks"));
  const ParallelLayout wide(16, 1);
  REQUIRE(wide.groups(GroupKind::kData)[0].name() == "dp group 0 (16 ranks: 0,1,2,...,15)");
}

TEST_CASE("process groups: a rank cannot make the communicator of a group it is not in") {
  StoreServer server("127.0.0.1", 0);
  StoreClient store("127.0.0.1", server.port(), 0, std::chrono::milliseconds(500));
  auto accelerator = make_cpu_accelerator();
  CommunicatorOptions options;
  options.world_size = 4;
  const ParallelLayout layout(4, 2);
  REQUIRE_THROWS_WITH(make_group_communicator(*accelerator, store, options, layout.groups(GroupKind::kTensor)[1]),
                      Catch::Contains("rank 0 is not in tp group 1 (ranks 2,3)"));
  REQUIRE_THROWS_WITH(make_process_groups(*accelerator, store, options, ParallelLayout(8, 2)),
                      Catch::Contains("laid out for a world of 8 ranks, but this job has 4"));
}

TEST_CASE("gloo process groups, 4 ranks as 2 x 2: collectives in tp, dp and ep groups give per-group results") {
  constexpr auto kTimeout = std::chrono::milliseconds(5000);
  const ParallelLayout layout(4, 2, 2);  // ep groups = dp groups {0,2}, {1,3}
  test::run_rank_threads(4, kTimeout, [&](int rank, StoreClient& store, Accelerator& accelerator) {
    CommunicatorOptions options;
    options.rank = rank;
    options.world_size = 4;
    options.timeout = kTimeout;
    // The job's own communicator on the same store and prefix: no key of a group may collide with it.
    auto world = make_gloo_communicator(accelerator, store, options);
    ProcessGroups groups = make_process_groups(accelerator, store, options, layout);
    auto stream = accelerator.create_stream();
    STRATA_CHECK(groups.tp->world_size() == 2 && groups.tp->rank() == rank % 2, kInternal, "tp rank");
    STRATA_CHECK(groups.dp->world_size() == 2 && groups.dp->rank() == rank / 2, kInternal, "dp rank");
    STRATA_CHECK(groups.expert_dp->world_size() == 1, kInternal, "expert-dp size");
    auto sum_in = [&](Communicator& comm) {
      float value = static_cast<float>(rank + 1);
      comm.allreduce(&value, &value, 1, DType::kF32, ReduceOp::kSum, *stream)->synchronize();
      return value;
    };
    // tp groups {0,1} and {2,3}: 1+2 and 3+4; dp groups {0,2} and {1,3}: 1+3 and 2+4; the world: 10.
    const float tp_sum = sum_in(*groups.tp), dp_sum = sum_in(groups.of(GroupKind::kData)), world_sum = sum_in(*world);
    STRATA_CHECK(tp_sum == (rank < 2 ? 3.0f : 7.0f), kInternal, "rank {}: tp sum {}", rank, tp_sum);
    STRATA_CHECK(dp_sum == (rank % 2 == 0 ? 4.0f : 6.0f), kInternal, "rank {}: dp sum {}", rank, dp_sum);
    STRATA_CHECK(world_sum == 10.0f, kInternal, "rank {}: world sum {}", rank, world_sum);
    STRATA_CHECK(sum_in(*groups.expert_dp) == static_cast<float>(rank + 1), kInternal, "expert-dp of one");
    test::run_collective_checks(*groups.tp, *stream, 33);
    test::run_collective_checks(*groups.dp, *stream, 33);
    test::check_all_to_all_case(*groups.ep, *stream, DType::kBF16, test::uneven_count, true, "ep group");
  });
}

TEST_CASE("gloo process groups: a member that does not take part is named by its job rank, with its group") {
  constexpr auto kTimeout = std::chrono::milliseconds(1000);
  const ParallelLayout layout(4, 2);
  std::promise<std::string> rank2_error;
  std::shared_future<std::string> reported = rank2_error.get_future().share();
  test::run_rank_threads(4, std::chrono::milliseconds(5000), [&](int rank, StoreClient& store, Accelerator& accelerator) {
    CommunicatorOptions options;
    options.rank = rank;
    options.world_size = 4;
    options.timeout = kTimeout;
    ProcessGroups groups = make_process_groups(accelerator, store, options, layout);
    auto stream = accelerator.create_stream();
    if (rank == 2) {
      float value = 1.0f;
      try {
        groups.tp->allreduce(&value, &value, 1, DType::kF32, ReduceOp::kSum, *stream)->synchronize();
        rank2_error.set_value("");
      } catch (const Error& e) {
        rank2_error.set_value(e.message());
      }
    } else {
      reported.wait();  // rank 3 stays out of its tp group's allreduce until rank 2 has failed
    }
  });
  const std::string message = reported.get();
  INFO(message);
  REQUIRE_THAT(message, Catch::Contains("allreduce #1 (1 x fp32) failed on rank 2 in tp group 1 (ranks 2,3)") &&
                            Catch::Contains("(timeout 1000 ms)") &&
                            Catch::Contains("rank 3 did not report this failure"));
}
