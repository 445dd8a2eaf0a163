// Routed fetch (issue 27): an expert no rank routed a token to has its windows
// skipped (Engine::skip_op), so ZeRO-3 never gathers it, and the operator
// trace is unchanged by routing.
//  - OperatorTrace on its own: a skipped window is an entry like any other,
//    remembered as the next step's prediction; a plan covers one micro-batch
//    of an operator (through its backward, not the next forward).
//  - A Mixtral under the engines: one rank at every stage equals the resident
//    engine bit for bit (both skip); two ZeRO-3 ranks with parameters and
//    optimizer state on NVMe equal one resident rank to rounding, skip windows
//    every step without ever dropping the trace, and read and gather fewer
//    bytes than the same model on a batch that routes to every expert.
#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "offload/operator_trace.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;
using engine::Phase;
using offload::OperatorTrace;

namespace {

// 16 experts of width 64 (the experts hold most bytes), top 2.
nn::DecoderConfig mixtral(bool aux) { return mixtral_config(16, 64, aux); }

}  // namespace

TEST_CASE("operator trace: a skipped window is an entry, its last run is the prediction, a plan covers one micro-batch",
          "[engine][zero][moe]") {
  const std::vector<std::vector<engine::ParamId>> params{{0}, {1}, {2}};
  OperatorTrace trace([&](engine::OpId op) -> const std::vector<engine::ParamId>& { return params[op]; },
                      [](engine::ParamId) { return int64_t{10}; });
  // Two micro-batches: op 0 (the router), op 1 (an expert) in forward and backward.
  const std::vector<OperatorTrace::Entry> step{{0, Phase::kForward}, {1, Phase::kForward},  {1, Phase::kBackward},
                                               {0, Phase::kBackward}, {0, Phase::kForward}, {1, Phase::kForward},
                                               {1, Phase::kBackward}, {0, Phase::kBackward}};
  const std::vector<bool> first_skips{false, true, true, false, false, false, false, false};
  for (size_t i = 0; i < step.size(); ++i) trace.advance(step[i].op, step[i].phase, first_skips[i]);
  trace.plan_skip(1, true);  // not following yet: no effect
  CHECK_FALSE(trace.end_step());
  REQUIRE(trace.following());
  for (size_t i = 0; i < step.size(); ++i) CHECK(trace.skipped(i) == first_skips[i]);

  // The next step: a skipped window matches its entry (no divergence).
  CHECK(trace.advance(0, Phase::kForward).position == 0);
  // The plan for micro-batch 1 covers op 1's forward and backward, not micro-batch 2's.
  trace.plan_skip(1, false);
  CHECK_FALSE(trace.skipped(1));
  CHECK_FALSE(trace.skipped(2));
  trace.plan_skip(1, true);
  CHECK(trace.skipped(1));
  CHECK(trace.skipped(2));
  CHECK_FALSE(trace.skipped(5));
  CHECK_FALSE(trace.skipped(6));
  CHECK(trace.advance(1, Phase::kForward, true).position == 1);
  // After its forward ran, a plan still covers the rest of this micro-batch.
  trace.plan_skip(1, false);
  CHECK_FALSE(trace.skipped(2));
  CHECK_FALSE(trace.skipped(5));
  CHECK(trace.advance(1, Phase::kBackward, false).position == 2);
  for (size_t i = 3; i < step.size(); ++i) {
    const bool skip = i == 5;  // micro-batch 2's forward of op 1 this time
    CHECK_FALSE(trace.advance(step[i].op, step[i].phase, skip).dropped);
  }
  CHECK_FALSE(trace.end_step());
  REQUIRE(trace.following());
  // What ran is the prediction for the next step.
  const std::vector<bool> second_skips{false, true, false, false, false, true, false, false};
  for (size_t i = 0; i < step.size(); ++i) CHECK(trace.skipped(i) == second_skips[i]);
  CHECK(trace.drops() == 0);
}

TEST_CASE("MoE, one rank at every stage: skipping the experts no token chose equals the resident engine bit for bit",
          "[engine][zero][moe]") {
  ops::set_cpu_threads(1);
  ResidentSpec resident;
  resident.config = mixtral(/*aux=*/true);
  resident.adam = options_for(3).adam;
  resident.batches = repeated_tokens;
  const TrainResult reference = train_resident(resident);
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    TrainSpec spec;
    spec.config = mixtral(/*aux=*/true);
    spec.options = options_for(stage);
    spec.batches = repeated_tokens;
    const TrainResult zero = train_zero(spec);
    CHECK(compare(zero, reference).identical);
    if (stage == 3) {
      for (const auto& s : zero.prefetch) CHECK(s.skipped_windows > 0);
    }
  }
}

TEST_CASE("MoE, two ZeRO-3 ranks on NVMe: only routed experts are gathered, the trace holds, one resident rank's result",
          "[engine][zero][moe][nvme]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-routed");
  ResidentSpec resident;
  resident.config = mixtral(/*aux=*/false);
  resident.adam = options_for(3).adam;
  resident.adam.eps = 1.0f;  // rounding-size differences stay rounding-size (see the frozen two-rank test)
  resident.batches = repeated_tokens;
  resident.steps = 4;
  const TrainResult reference = train_resident(resident);

  TrainSpec spec;
  spec.config = mixtral(/*aux=*/false);
  spec.world = 2;
  spec.steps = 4;
  spec.options = options_for(3);
  spec.options.adam.eps = 1.0f;
  spec.options.param_tier = Tier::kNvme;
  spec.options.optimizer_tier = Tier::kNvme;
  spec.options.nvme_path = dir.path() / "swap";
  spec.batches = repeated_tokens;
  const TrainResult routed = train_zero(spec);
  const Diff d = compare(routed, reference);
  INFO("max |2 ranks - 1 resident rank| = " << d.max_abs);
  CHECK(d.max_abs <= 2e-6);
  CHECK(routed.trace_drops == 0);

  // The same model on random tokens: (nearly) every expert is routed every step.
  spec.batches = {};
  spec.options.nvme_path = dir.path() / "swap-all";
  const TrainResult all = train_zero(spec);
  // With the default budgets every parameter that runs is gathered once a
  // step (kept from its forward to its backward), and an expert no rank
  // routed to skips 6 windows (3 projections, forward and backward): so a
  // step's gathers are exactly the parameters less one per 2 skipped windows.
  const auto params = static_cast<int64_t>(routed.names.size());
  for (size_t s = 1; s < routed.prefetch.size(); ++s) {
    CAPTURE(s);
    const auto& r = routed.prefetch[s];
    const auto& a = all.prefetch[s];
    INFO("routed: " << r.skipped_windows << " windows skipped, " << r.gathers << " gathers, " << r.read_nbytes
                    << " bytes read; all experts: " << a.skipped_windows << " skipped, " << a.gathers << " gathers, "
                    << a.read_nbytes << " read");
    CHECK(r.trace_followed);
    CHECK(r.skipped_windows > a.skipped_windows);
    CHECK(r.gathers == params - r.skipped_windows / 2);
    CHECK(a.gathers == params - a.skipped_windows / 2);
    CHECK(r.read_nbytes < a.read_nbytes * 3 / 4);
    // The plan is exact: routed experts are gathered ahead, not on demand.
    CHECK(r.on_demand == a.on_demand);
  }
}

TEST_CASE("MoE: the routers' load imbalance is the busiest expert's tokens over the mean, the worst layer's",
          "[engine][moe]") {
  ops::set_cpu_threads(1);
  auto accelerator = make_cpu_accelerator();
  engine::ResidentEngine eng(*accelerator);
  nn::DecoderModel model(eng, mixtral(/*aux=*/false), nn::model_options(DType::kF32, 16));
  eng.finalize();
  nn::initialize_parameters(eng, model.parameters(), 7);
  CHECK(model.router_load_imbalance() == 0);  // no forward yet
  // One token repeated: every token goes to the same 2 of the 16 experts.
  const std::vector<int32_t> same(static_cast<size_t>(kSeq), 5);
  model.forward(same, same, 1, kSeq);
  model.loss_stats();
  CHECK(model.router_load_imbalance() == Approx(8.0));
  model.reset_router_load();
  CHECK(model.router_load_imbalance() == 0);
  const Batch random = corpus(0, 40);
  model.forward(random.ids, random.targets, kSequences, kSeq);
  model.loss_stats();
  CHECK(model.router_load_imbalance() >= 1.0);
  CHECK(model.router_load_imbalance() < 8.0);
}
