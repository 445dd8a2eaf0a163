// DeepSeek-V3, Kimi K2 and GLM-4.5 (scripts/make-golden-deepseek): multi-head latent
// attention with q_lora and with q_proj, YaRN's mscale^2, the interleaved
// rope, the sigmoid group-limited router with its correction bias, the
// shared experts and the dense first layer; GLM-4.5's GQA with q/k/v biases,
// q/k norms and partial rotary embedding; against transformers' loss and
// every gradient.
#include <iostream>

#include "tests/nn/golden_checks.h"
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

