// Expert parallelism (issue 27 item 4; docs/DESIGN.md §4.2): with
// moe.expert_parallel_size P, each ep member holds E / P experts of every
// layer and their optimizer state, tokens go to the experts' members and back
// in an all_to_all, and the experts are partitioned over the expert-dp group
// only. The same losses and parameters as ONE resident rank on the combined
// batch, to rounding (the sums run in another order), across ZeRO stages,
// offload tiers, P = world and P < world, with checkpointed activations
// (the recompute exchanges again), and with the routed-fetch skipping.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "runtime/plan/runtime_memory.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;

namespace {

// 16 experts of width 16, top 2. Without the load-balancing loss: each
// rank's micro-batches add their own auxiliary gradient (DESIGN §4.2), so N
// ranks equal one rank only on the language-model loss.
nn::DecoderConfig mixtral() { return mixtral_config(16, 16, /*aux=*/false); }

// One resident rank on the combined batch: random tokens (every expert
// routed), or one token per sequence (most experts skipped: routed fetch).
const TrainResult& reference(bool repeated) {
  static const TrainResult random_tokens = [] {
    ResidentSpec resident;
    resident.config = mixtral();
    resident.adam = options_for(3).adam;
    resident.adam.eps = 1.0f;  // rounding-size differences stay rounding-size
    return train_resident(resident);
  }();
  static const TrainResult repeated_batches = [] {
    ResidentSpec resident;
    resident.config = mixtral();
    resident.adam = options_for(3).adam;
    resident.adam.eps = 1.0f;
    resident.batches = repeated_tokens;
    return train_resident(resident);
  }();
  return repeated ? repeated_batches : random_tokens;
}

struct Case {
  int world, ep, stage;
  Tier param, optimizer;
  bool checkpoint = false;
  int micro_steps = 1;
  bool repeated = false;  // repeated_tokens: experts skipped
};

TrainResult run(const Case& c, const std::filesystem::path& swap) {
  TrainSpec spec;
  spec.config = mixtral();
  spec.world = c.world;
  spec.micro_steps = c.micro_steps;
  spec.checkpoint_activations = c.checkpoint;
  spec.options = options_on(c.stage, c.param, c.optimizer, swap);
  spec.options.expert_parallel_size = c.ep;
  if (c.repeated) spec.batches = repeated_tokens;
  return train_zero(spec);
}

}  // namespace

TEST_CASE("expert parallelism equals one resident rank on the combined batch", "[engine][zero][moe][ep]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-ep");
  const std::vector<Case> cases = {
      {2, 2, 1, Tier::kDevice, Tier::kCpu},
      {2, 2, 1, Tier::kDevice, Tier::kDevice},
      {4, 4, 3, Tier::kCpu, Tier::kCpu},
      {4, 2, 2, Tier::kDevice, Tier::kDevice},
      {2, 2, 2, Tier::kDevice, Tier::kCpu, false, 2},
      {2, 2, 3, Tier::kDevice, Tier::kCpu, true},
      {2, 2, 3, Tier::kNvme, Tier::kNvme},
      {2, 2, 3, Tier::kNvme, Tier::kNvme, false, 1, true},
      {4, 2, 3, Tier::kNvme, Tier::kNvme},
      {4, 4, 2, Tier::kDevice, Tier::kNvme},
  };
  for (const Case& c : cases) {
    const std::string name = "world " + std::to_string(c.world) + ", ep " + std::to_string(c.ep) + ", stage " +
                             std::to_string(c.stage) + ", params " + std::string(tier_name(c.param)) +
                             ", optimizer " + std::string(tier_name(c.optimizer)) +
                             (c.checkpoint ? ", checkpointed" : "") +
                             (c.micro_steps > 1 ? ", 2 micro-steps" : "") + (c.repeated ? ", experts skipped" : "");
    SECTION(name) {
      const TrainResult r = run(c, dir.path() / "swap");
      const TrainResult& ref = reference(c.repeated);
      const Diff d = compare(r, ref);
      INFO(name << ": max |ep - 1 resident rank| = " << d.max_abs);
      CHECK(d.max_abs <= 2e-6);
      REQUIRE(r.losses.size() == ref.losses.size());
      for (size_t i = 0; i < r.losses.size(); ++i) CHECK(r.losses[i] == Approx(ref.losses[i]).epsilon(1e-6));
      if (c.stage == 3) CHECK(r.trace_drops == 0);
      // Split for real: rank 0 holds its 16 / ep experts' 3 matrices in each of the 2 layers.
      CHECK(r.expert_group_size == c.ep);
      CHECK(r.held_expert_params == 2 * 3 * 16 / c.ep);
      // strata plan's arena is the model's, the exchange's buffers included.
      const int64_t sequences = kSequences / c.world / c.micro_steps;
      CHECK(plan::decoder_arena_nbytes(mixtral(), DType::kF32, sequences, kSeq, c.checkpoint, false, {}, c.ep) ==
            r.arena_nbytes);
    }
  }
}

TEST_CASE("expert parallelism with qwen2_moe's shared expert equals one resident rank", "[engine][zero][moe][ep]") {
  // The shared expert and its gate are dense parameters: ZeRO-partitioned over
  // every rank, run on each rank's own rows, never exchanged.
  ops::set_cpu_threads(1);
  nn::DecoderConfig c = mixtral();
  c.model_type = "qwen2_moe";
  c.norm_topk_prob = false;
  c.attention_qkv_bias = true;
  c.shared_expert_intermediate_size = 24;
  ResidentSpec resident;
  resident.config = c;
  resident.adam = options_for(3).adam;
  resident.adam.eps = 1.0f;
  const TrainResult ref = train_resident(resident);
  for (const bool checkpoint : {false, true}) {
    INFO("checkpointed " << checkpoint);
    TrainSpec spec;
    spec.config = c;
    spec.world = 2;
    spec.checkpoint_activations = checkpoint;
    spec.options = options_for(3);
    spec.options.adam.eps = 1.0f;
    spec.options.expert_parallel_size = 2;
    spec.options.param_tier = Tier::kCpu;
    spec.options.optimizer_tier = Tier::kCpu;
    const TrainResult r = train_zero(spec);
    const Diff d = compare(r, ref);
    INFO("max |ep - 1 resident rank| = " << d.max_abs);
    CHECK(d.max_abs <= 2e-6);
    REQUIRE(r.losses.size() == ref.losses.size());
    for (size_t i = 0; i < r.losses.size(); ++i) CHECK(r.losses[i] == Approx(ref.losses[i]).epsilon(1e-6));
    CHECK(r.trace_drops == 0);
    // Only the routed experts are split: the shared expert is no expert.
    CHECK(r.expert_group_size == 2);
    CHECK(r.held_expert_params == 2 * 3 * 16 / 2);
    CHECK(plan::decoder_arena_nbytes(c, DType::kF32, kSequences / 2, kSeq, checkpoint, false, {}, 2) == r.arena_nbytes);
  }
}

TEST_CASE("expert parallelism: an ep size that does not divide the experts is refused, naming both",
          "[engine][zero][moe][ep]") {
  TrainSpec spec;
  spec.config = mixtral_config(6, 16, /*aux=*/false);
  spec.world = 4;
  spec.steps = 1;
  spec.options = options_for(2);
  spec.options.expert_parallel_size = 4;
  spec.collect_errors = true;
  const TrainResult r = train_zero(spec);
  for (const std::exception_ptr& e : r.errors) {
    REQUIRE(e != nullptr);
    try {
      std::rethrow_exception(e);
    } catch (const Error& error) {
      CHECK_THAT(error.message(), Catch::Contains("moe.expert_parallel_size 4 does not divide the 6 experts"));
    }
  }
}
