// Expert parallelism (issue 27 item 4; docs/DESIGN.md §4.2): with
// moe.expert_parallel_size P, each ep member holds E / P experts of every
// layer and their optimizer state, tokens go to the experts' members and back
// in an all_to_all, and the experts are partitioned over the expert-dp group
// only. The same losses and parameters as ONE resident rank on the combined
// batch, to rounding (the sums run in another order), across ZeRO stages,
// offload tiers, P = world and P < world, with checkpointed activations
// (the recompute exchanges again), and with the routed-fetch skipping.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
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

TEST_CASE("DeepSeek's auxiliary-loss-free balancing: 2 ranks (ep 2 or dp 2) update the correction biases bit for bit "
          "like one resident rank on the combined batch",
          "[engine][zero][moe][ep][deepseek]") {
  // The sigmoid router (glm4_moe's: DeepSeek's router behind grouped-query
  // attention) in mixtral()'s shape. The counts are whole numbers every rank
  // agrees on, so the biases are the same bits whenever the routing is; the
  // rate is large against the init's scores, so the moved biases change the
  // routing of the next steps.
  ops::set_cpu_threads(1);
  nn::DecoderConfig c = mixtral();
  c.model_type = "glm4_moe";
  c.sigmoid_router = true;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  c.rope.rotary_dim = c.head_dim;  // glm4_moe's partial rotary, here the whole head
  constexpr float kRate = 1e-2f;
  ResidentSpec resident;
  resident.config = c;
  resident.adam = options_for(3).adam;
  resident.adam.eps = 1.0f;
  resident.router_bias_update_rate = kRate;
  const TrainResult ref = train_resident(resident);
  std::vector<size_t> biases;
  for (size_t p = 0; p < ref.names.size(); ++p) {
    if (ref.names[p].ends_with(".e_score_correction_bias")) biases.push_back(p);
  }
  REQUIRE(biases.size() == 2);
  for (size_t p : biases) {
    // Moved, by whole steps of the rate (3 steps: each entry within 3 rates of 0).
    CAPTURE(ref.names[p]);
    CHECK(std::any_of(ref.params[p].begin(), ref.params[p].end(), [](float b) { return b != 0.0f; }));
    for (float b : ref.params[p]) CHECK(std::fabs(b) <= 3 * kRate * 1.0001f);
  }
  // ZeRO-3 (the bias's gathered copies released when written) and stage 1
  // (the full copies gathered again), with and without expert parallelism.
  for (const std::pair<int, int>& shape : {std::pair{2, 3}, std::pair{1, 3}, std::pair{2, 1}}) {
    const int ep = shape.first, stage = shape.second;
    INFO("ep " << ep << " (dp 2), stage " << stage);
    TrainSpec spec;
    spec.config = c;
    spec.world = 2;
    spec.options = options_for(stage);
    spec.options.adam.eps = 1.0f;
    spec.options.expert_parallel_size = ep;
    spec.router_bias_update_rate = kRate;
    const TrainResult r = train_zero(spec);
    for (size_t p : biases) {
      CAPTURE(ref.names[p]);
      CHECK(std::memcmp(r.params[p].data(), ref.params[p].data(), ref.params[p].size() * sizeof(float)) == 0);
    }
    const Diff d = compare(r, ref);
    INFO("max |2 ranks - 1 resident rank| = " << d.max_abs);
    CHECK(d.max_abs <= 2e-6);
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
