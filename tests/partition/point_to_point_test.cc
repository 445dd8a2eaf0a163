// Pipeline parallelism's part of partition/ (issue 44): the pp × dp × tp
// layout in Megatron's order as a pure function, and Communicator::exchange
// on Gloo with ranks as threads (real TCP over loopback) — crossing
// transfers in one exchange, pairing across exchanges in order, every
// dtype, and the errors: two sides that disagree (both fail, naming the
// stages and both descriptions, instead of Gloo aborting the process), a
// peer that never comes (the timeout, naming it), and what one rank can
// check at submission.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "partition/process_groups.h"
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

// Every rank's communicator over its pp group (whose members errors call by their stages).
template <typename Body>
void run_pipeline_ranks(const ParallelLayout& layout, std::chrono::milliseconds timeout, Body body) {
  test::run_rank_threads(layout.world_size(), std::chrono::milliseconds(10000),
                         [&](int rank, StoreClient& store, Accelerator& accelerator) {
                           CommunicatorOptions options;
                           options.rank = rank;
                           options.world_size = layout.world_size();
                           options.timeout = timeout;
                           ProcessGroups groups = make_process_groups(accelerator, store, options, layout);
                           auto stream = accelerator.create_stream();
                           body(rank, *groups.pp, *stream);
                         });
}

float value_of(int from, int to, size_t i) { return static_cast<float>(100 * from + 10 * to + static_cast<int>(i % 7)); }

// `values` (small integers) stored as `dtype`.
std::vector<char> stored(const std::vector<float>& values, DType dtype) {
  std::vector<char> out(values.size() * dtype_nbytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF64) {
      const double v = values[i];
      std::memcpy(out.data() + i * sizeof(v), &v, sizeof(v));
    } else if (dtype == DType::kI32) {
      const auto v = static_cast<int32_t>(values[i]);
      std::memcpy(out.data() + i * sizeof(v), &v, sizeof(v));
    } else {
      convert(&values[i], DType::kF32, out.data() + i * dtype_nbytes(dtype), dtype, 1);
    }
  }
  return out;
}
}  // namespace

TEST_CASE("process groups: pp x dp x tp in Megatron's order, tp fastest, then dp, then pp") {
  const ParallelLayout layout(8, 2, 1, 2);  // 2 stages of dp 2 x tp 2
  REQUIRE(layout.dp_size() == 2);
  REQUIRE(layout.pp_size() == 2);
  REQUIRE(ranks_of(layout, GroupKind::kTensor) == std::vector<Ranks>{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  REQUIRE(ranks_of(layout, GroupKind::kData) == std::vector<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  REQUIRE(ranks_of(layout, GroupKind::kPipeline) == std::vector<Ranks>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  REQUIRE(ranks_of(layout, GroupKind::kExpertData) == std::vector<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  REQUIRE(layout.stage_ranks(1) == Ranks{4, 5, 6, 7});
  REQUIRE(layout.stage_name(1) == "pp stage 1 (ranks 4,5,6,7)");
  REQUIRE(layout.group_of(GroupKind::kPipeline, 6).name() == "pp group 2 (ranks 2,6)");
  REQUIRE(layout.group_of(GroupKind::kPipeline, 6).member_names ==
          std::vector<std::string>{"pp stage 0 (ranks 0,1,2,3)", "pp stage 1 (ranks 4,5,6,7)"});
  REQUIRE((layout.pp_rank(5) == 1 && layout.dp_rank(5) == 0 && layout.tp_rank(5) == 1));
  REQUIRE((layout.pp_rank(6) == 1 && layout.dp_rank(6) == 1 && layout.tp_rank(6) == 0));
  // Pipeline alone: one pp group of every rank, a stage per rank.
  const ParallelLayout pipeline(4, 1, 1, 4);
  REQUIRE(ranks_of(pipeline, GroupKind::kPipeline) == std::vector<Ranks>{{0, 1, 2, 3}});
  REQUIRE(ranks_of(pipeline, GroupKind::kData) == std::vector<Ranks>{{0}, {1}, {2}, {3}});
  REQUIRE(pipeline.stage_name(2) == "pp stage 2 (rank 2)");
  // pp 2 x tp 2: the brief's wording of a stage.
  REQUIRE(ParallelLayout(4, 2, 1, 2).stage_name(1) == "pp stage 1 (ranks 2,3)");
  // Expert parallelism stays inside each stage's dp groups.
  const ParallelLayout moe(8, 1, 2, 2);
  REQUIRE(ranks_of(moe, GroupKind::kExpert) == std::vector<Ranks>{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  REQUIRE(ranks_of(moe, GroupKind::kExpertData) == std::vector<Ranks>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
}

TEST_CASE("process groups: with pp, every rank is in one group of each kind, and the groups cross in it only") {
  for (int world : {1, 2, 4, 6, 8, 12, 16}) {
    for (int pp = 1; pp <= world; ++pp) {
      for (int tp = 1; pp * tp <= world; ++tp) {
        if (world % (pp * tp) != 0) continue;
        const int dp = world / (pp * tp);
        INFO("world " << world << " pp " << pp << " tp " << tp);
        const ParallelLayout layout(world, tp, 1, pp);
        const std::pair<GroupKind, int> sizes[] = {
            {GroupKind::kTensor, tp}, {GroupKind::kData, dp}, {GroupKind::kPipeline, pp}};
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
          REQUIRE(r == layout.pp_rank(r) * dp * tp + layout.dp_rank(r) * tp + layout.tp_rank(r));
          const ProcessGroup& pipe = layout.group_of(GroupKind::kPipeline, r);
          REQUIRE(pipe.member(r) == layout.pp_rank(r));
          // A pipeline's members: the same dp and tp rank, one per stage.
          for (int q : pipe.ranks) REQUIRE((layout.dp_rank(q) == layout.dp_rank(r) && layout.tp_rank(q) == layout.tp_rank(r)));
          // tp and dp groups stay inside the rank's stage.
          for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData}) {
            for (int q : layout.group_of(kind, r).ranks) REQUIRE(layout.pp_rank(q) == layout.pp_rank(r));
          }
          REQUIRE(layout.group_of(GroupKind::kData, r).member(r) == layout.dp_rank(r));
        }
      }
    }
  }
  REQUIRE_THROWS_WITH(ParallelLayout(6, 1, 1, 4),
                      Catch::Contains("a world of 6 ranks is not divisible by the pipeline-parallel size 4") &&
                          Catch::Contains("world = pp × dp × tp"));
  REQUIRE_THROWS_WITH(ParallelLayout(8, 2, 1, 3), Catch::Contains("pipeline-parallel size 3 x the tensor-parallel size 2"));
  REQUIRE_THROWS_WITH(ParallelLayout(8, 1, 4, 4), Catch::Contains("the expert-parallel size 4 does not divide the "
                                                                  "data-parallel size 2") &&
                                                      Catch::Contains("pipeline-parallel size 4"));
  REQUIRE_THROWS_WITH(ParallelLayout(4, 1, 1, 2).stage_name(2), Catch::Contains("pipeline stage 2 is outside the 2 stages"));
}

TEST_CASE("gloo exchange, 4 ranks as pp 4: crossing transfers in one call, pairing in order across calls, exact") {
  const ParallelLayout layout(4, 1, 1, 4);
  run_pipeline_ranks(layout, std::chrono::milliseconds(5000), [](int rank, Communicator& pp, Stream& stream) {
    const int world = pp.world_size(), next = (rank + 1) % world, prev = (rank + world - 1) % world;
    // One call: send to the next stage and receive from the previous (a ring,
    // every rank sending first: deadlock-free only because both are posted together).
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kI32}) {
      const size_t n = 37, element = dtype_nbytes(dtype);
      std::vector<float> values(n), expect(n);
      for (size_t i = 0; i < n; ++i) values[i] = value_of(rank, next, i), expect[i] = value_of(prev, rank, i);
      const std::vector<char> out = stored(values, dtype), want = stored(expect, dtype);
      std::vector<char> in(n * element, 0);
      const std::vector<P2POp> ops = {P2POp::send(next, out.data(), dtype, {1, 37}, 7, "ring"),
                                      P2POp::recv(prev, in.data(), dtype, {1, 37}, 7, "ring")};
      pp.exchange(ops, stream)->synchronize();
      STRATA_CHECK(in == want, kInternal, "rank {}: ring exchange in {} delivered other bytes", rank, dtype_name(dtype));
    }
    // Across calls: rank 0 sends rank 1 three messages in two calls (one of
    // them empty); rank 1 receives them in one call, in order.
    if (rank == 0) {
      std::vector<float> a(5, 1.0f), b(3, 2.0f);
      pp.exchange(std::vector<P2POp>{P2POp::send(1, a.data(), DType::kF32, {5}, 1, "a")}, stream);
      pp.exchange(std::vector<P2POp>{P2POp::send(1, nullptr, DType::kF32, {0, 4}, 2, "empty"),
                                     P2POp::send(1, b.data(), DType::kF32, {3}, 3, "b")},
                  stream)
          ->synchronize();
    } else if (rank == 1) {
      std::vector<float> a(5, 0.0f), b(3, 0.0f);
      pp.exchange(std::vector<P2POp>{P2POp::recv(0, a.data(), DType::kF32, {5}, 1, "a"),
                                     P2POp::recv(0, nullptr, DType::kF32, {0, 4}, 2, "empty"),
                                     P2POp::recv(0, b.data(), DType::kF32, {3}, 3, "b")},
                  stream)
          ->synchronize();
      STRATA_CHECK(a == std::vector<float>(5, 1.0f) && b == std::vector<float>(3, 2.0f), kInternal,
                   "messages paired out of order");
    }
    // A later collective on the same communicator still pairs (exchanges take no collective tags).
    float sum = static_cast<float>(rank);
    pp.allreduce(&sum, &sum, 1, DType::kF32, ReduceOp::kSum, stream)->synchronize();
    STRATA_CHECK(sum == 6.0f, kInternal, "rank {}: allreduce after exchanges gave {}", rank, sum);
  });
}

TEST_CASE("gloo exchange: two sides that disagree both fail, naming the stages and both descriptions") {
  const ParallelLayout layout(4, 2, 1, 2);  // stages {0,1} and {2,3}; pp groups {0,2} and {1,3}
  std::mutex mutex;
  std::vector<std::string> errors(4);
  run_pipeline_ranks(layout, std::chrono::milliseconds(3000), [&](int rank, Communicator& pp, Stream& stream) {
    std::vector<float> buffer(64, 1.0f);
    // Pipeline 0 (ranks 0, 2) disagrees on the shape; pipeline 1 (ranks 1, 3) agrees.
    const Shape shape = rank == 2 ? Shape{2, 4, 8} : Shape{2, 4, 4};
    const P2POp op = layout.pp_rank(rank) == 0
                         ? P2POp::send(1, buffer.data(), DType::kF32, shape, 0x10003, "activation of micro-batch 3")
                         : P2POp::recv(0, buffer.data(), DType::kF32, shape, 0x10003, "activation of micro-batch 3");
    try {
      pp.exchange(std::span<const P2POp>(&op, 1), stream)->synchronize();
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      errors[static_cast<size_t>(rank)] = e.message();
    }
  });
  INFO(errors[0] << "\n" << errors[2]);
  REQUIRE(errors[1].empty());
  REQUIRE(errors[3].empty());
  REQUIRE_THAT(errors[0],
               Catch::Contains("exchange #1 (send of [2, 4, 4] fp32 (tag 0x10003: activation of micro-batch 3) to pp "
                               "stage 1 (ranks 2,3)) failed on rank 0 in pp group 0 (ranks 0,2)") &&
                   Catch::Contains("this rank sends [2, 4, 4] fp32 (tag 0x10003: activation of micro-batch 3) to pp "
                                   "stage 1 (ranks 2,3), which expects [2, 4, 8] fp32"));
  REQUIRE_THAT(errors[2], Catch::Contains("failed on rank 2 in pp group 0 (ranks 0,2)") &&
                              Catch::Contains("pp stage 0 (ranks 0,1) sends [2, 4, 4] fp32 (tag 0x10003: activation "
                                              "of micro-batch 3) to this rank, which expects [2, 4, 8] fp32"));
}

TEST_CASE("gloo exchange: a peer that never posts its side is named within the timeout, and bad ops are refused") {
  const ParallelLayout layout(2, 1, 1, 2);
  std::vector<std::string> refusals;
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  run_pipeline_ranks(layout, std::chrono::milliseconds(1000), [&](int rank, Communicator& pp, Stream& stream) {
    if (rank != 0) return;  // rank 1 posts nothing: rank 0's receive waits for it and fails
    std::vector<float> buffer(8, 0.0f);
    const auto refused = [&](std::vector<P2POp> ops) {
      try {
        pp.exchange(ops, stream);
        refusals.push_back("accepted");
      } catch (const Error& e) {
        refusals.push_back(e.message());
      }
    };
    refused({P2POp::send(0, buffer.data(), DType::kF32, {8}, 1, "x")});
    refused({P2POp::recv(2, buffer.data(), DType::kF32, {8}, 1, "x")});
    refused({P2POp::recv(1, nullptr, DType::kF32, {8}, 1, "x")});
    refused({});
    try {
      pp.exchange(std::vector<P2POp>{P2POp::recv(1, buffer.data(), DType::kF32, {8}, 1, "gradient of micro-batch 0")},
                  stream)
          ->synchronize();
    } catch (const Error& e) {
      error = e.message();
    }
  });
  REQUIRE(refusals.size() == 4);
  REQUIRE_THAT(refusals[0], Catch::Contains("names peer 0, which is this rank"));
  REQUIRE_THAT(refusals[1], Catch::Contains("names peer 2, which is outside 2 ranks"));
  REQUIRE_THAT(refusals[2], Catch::Contains("has no buffer"));
  REQUIRE_THAT(refusals[3], Catch::Contains("no send or receive given"));
  INFO(error);
  REQUIRE_THAT(error, Catch::Contains("exchange #1 (receive of [8] fp32 (tag 0x1: gradient of micro-batch 0) from pp "
                                      "stage 1 (rank 1)) failed on rank 0 in pp group 0 (ranks 0,1)") &&
                          Catch::Contains("(timeout 1000 ms)"));
  REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(8));
}
