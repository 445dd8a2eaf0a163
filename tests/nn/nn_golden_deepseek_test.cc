// DeepSeek-V3, Kimi K2 and GLM-4.5 (scripts/make-golden-deepseek): multi-head latent
// attention with q_lora and with q_proj, YaRN's mscale^2, the interleaved
// rope, the sigmoid group-limited router with its correction bias, the
// shared experts and the dense first layer; GLM-4.5's GQA with q/k/v biases,
// q/k norms and partial rotary embedding; against transformers' loss and
// every gradient; DeepSeek's auxiliary-loss-free update of the correction bias.
#include <fmt/format.h>

#include <cstring>
#include <iostream>
#include <vector>

#include "tests/nn/golden_checks.h"
#include "tests/nn/test_models.h"
#include "tests/support/tolerances.h"

using namespace strata;
using namespace strata::test;

namespace {

const char* const kF32Cases[] = {"deepseek_v3_qlora_f32", "deepseek_v3_qproj_f32", "kimi_k2_f32", "glm4_moe_f32"};

void report(const std::string& what) {
  std::cout << what << ": max gradient difference " << last_golden_grad_rel() << " of the gradient's max\n";
}

}  // namespace

TEST_CASE("golden: DeepSeek-V3 (q_lora, q_proj), Kimi K2 and GLM-4.5 in fp32 match transformers",
          "[nn][golden][deepseek]") {
  for (const char* name : kF32Cases) {
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
    report(name);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32, std::nullopt,
                 /*checkpoint_activations=*/true);
  }
}

TEST_CASE("golden: each DeepSeek piece moves the fixtures' loss far outside the tolerance",
          "[nn][golden][deepseek]") {
  // The same weights with one piece left out (the shared experts, the
  // correction bias, the routed scaling, YaRN's mscale^2, the interleaved
  // rope, the latent norms; GLM's partial rotary and q/k norms): a fixture that would not see a missing piece
  // proves nothing.
  for (const char* name : kF32Cases) {
    const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
    const double loss = expected.at("loss").get<double>();
    const nlohmann::json& without = expected.at("loss_without_feature");
    CHECK(without.size() >= 5);  // deepseek 6 pieces, glm4_moe 5
    for (auto it = without.begin(); it != without.end(); ++it) {
      const double plain = it.value().get<double>();
      INFO(name << ": loss " << loss << ", without " << it.key() << " " << plain);
      CHECK(std::abs(plain - loss) > 100 * kGoldenF32.loss_rel * loss);
      std::cout << name << ": loss " << loss << ", without " << it.key() << " " << plain << "\n";
    }
  }
}

TEST_CASE("golden: DeepSeek-V3 and GLM-4.5 with bf16 weights match transformers", "[nn][golden][deepseek]") {
  for (const char* name : {"deepseek_v3_qlora_bf16", "glm4_moe_bf16"}) {
    check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    report(std::string(name) + " (the bf16 weights in fp32)");
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    report(std::string(name) + " (fp32 activations vs torch bf16)");
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
    report(std::string(name) + " (bf16 activations vs torch bf16)");
  }
}


TEST_CASE("DeepSeek's auxiliary-loss-free balancing: each correction bias moves by the rate towards the mean load",
          "[nn][moe][deepseek]") {
  // By hand: 4 experts, 8 assignments, mean 2: the busy expert down, the idle
  // one up, the two at the mean (sign(0) = 0) unchanged.
  const float r = 0.125f;
  CHECK(nn::correction_bias_steps({3, 1, 2, 2}, r) == std::vector<float>{-r, r, 0.0f, 0.0f});
  // A mean between counts (3 / 2 = 1.5): no expert at it.
  CHECK(nn::correction_bias_steps({1, 2}, r) == std::vector<float>{r, -r});
  CHECK(nn::correction_bias_steps({0, 0, 0}, r) == std::vector<float>{0.0f, 0.0f, 0.0f});
  // Counts past 2^24 (one token more than the mean must still count, so no fp32 average).
  CHECK(nn::correction_bias_steps({16777217, 16777215}, r) == std::vector<float>{-r, r});

  // A sigmoid-router model on a resident engine: after a forward, every MoE
  // layer's bias is its old value plus the step of that layer's counts, and a
  // model without a correction bias is refused by name.
  nn::DecoderConfig c = nn::tiny_llama(48, 32, 40, 3, 4, 2);
  c.model_type = "glm4_moe";
  c.max_position_embeddings = 32;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 16;
  c.norm_topk_prob = true;
  c.sigmoid_router = true;
  c.n_group = 2;
  c.topk_group = 1;
  c.first_k_dense_replace = 1;
  c.rope.rotary_dim = c.head_dim;  // glm4_moe's partial rotary, here the whole head
  Rig rig;
  nn::DecoderModel model(*rig.engine, c, nn::model_options(DType::kF32, 16));
  rig.engine->finalize();
  nn::initialize_parameters(*rig.engine, model.parameters(), 3, 0.2);
  const std::vector<float> start{0.5f, -0.25f, 0.0f, 1.0f, -0.0f, 0.75f, 2.0f, -1.0f};
  std::vector<engine::ParamId> biases;
  for (int layer : {1, 2}) {
    biases.push_back(rig.engine->find_parameter(fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", layer)));
    rig.set_param(biases.back(), start);
  }
  std::vector<int32_t> ids(2 * 12), targets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 7 + 3) % 48);
    targets[i] = static_cast<int32_t>((i * 5 + 1) % 48);
  }
  nn::ForwardOptions eval;
  eval.backward = false;
  model.forward(ids, targets, 2, 12, eval);
  model.loss_stats();
  const std::vector<std::vector<double>> loads = model.router_loads();
  REQUIRE(loads.size() == 2);
  const float rate = 1.0f / 64;
  model.update_correction_biases(rate);
  for (size_t l = 0; l < 2; ++l) {
    const std::vector<double>& load = loads[l];
    REQUIRE(load.size() == 8);
    double total = 0;
    for (double n : load) total += n;
    CHECK(total == 2 * 12 * 2);  // every token routed to top-k 2
    const std::vector<float> got = rig.param_values(biases[l]);
    for (size_t e = 0; e < 8; ++e) {
      CAPTURE(l, e, load[e]);
      const double mean = total / 8;
      const float expected = load[e] < mean ? start[e] + rate : load[e] > mean ? start[e] - rate : start[e];
      CHECK(std::memcmp(&got[e], &expected, sizeof(float)) == 0);
    }
  }
  // The next forward starts counting afresh after reset_router_load(); no forward since: unchanged.
  model.reset_router_load();
  const std::vector<float> before = rig.param_values(biases[0]);
  model.update_correction_biases(rate);
  CHECK(rig.param_values(biases[0]) == before);

  nn::DecoderConfig mixtral = c;
  mixtral.model_type = "mixtral";
  mixtral.sigmoid_router = false;
  mixtral.n_group = mixtral.topk_group = 1;
  mixtral.first_k_dense_replace = 0;
  mixtral.rope.rotary_dim = 0;
  Rig other;
  nn::DecoderModel plain(*other.engine, mixtral, nn::model_options(DType::kF32, 16));
  other.engine->finalize();
  CHECK_THROWS_WITH(plain.update_correction_biases(rate),
                    Catch::Contains("model_type mixtral has no e_score_correction_bias"));
}
