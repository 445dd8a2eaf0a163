// strata's loss and every gradient against Hugging Face transformers on the
// cpu accelerator (fixtures from scripts/make-golden; tolerances justified in
// tests/support/tolerances.h, section 3).
#include <iostream>

#include "tests/nn/golden_checks.h"
#include "tests/support/tolerances.h"

using namespace strata;
using namespace strata::test;

TEST_CASE("golden: fp32 Llama (GQA, untied and tied) matches transformers", "[nn][golden]") {
  for (const char* name : {"llama_untied_f32", "llama_tied_f32"}) {
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
  }
}

TEST_CASE("golden: bf16 storage matches transformers on the same 16-bit weights",
          "[nn][golden]") {
  for (const char* name : {"llama_untied_bf16", "llama_tied_bf16"}) {
    // fp32 arithmetic on bf16 weights: what the cpu ops compute, exactly.
    check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    // Against transformers computing in bf16 throughout.
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    // bf16 activations on the cpu, against transformers in bf16.
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16,
                 DType::kBF16);
  }
}

namespace {

// The families' cases (scripts/make-golden: FAMILIES): fp32 untied, bf16 tied.
// llama_yarn and qwen2_yarn: YaRN RoPE (frequencies and attention factor),
// their loss_without_feature the same model with default RoPE.
const char* const kFamilyCases[] = {"llama3", "mistral", "qwen2", "qwen3", "llama_yarn", "qwen2_yarn"};

}  // namespace

TEST_CASE("golden: Llama 3.1 RoPE, Mistral's sliding window, Qwen2's biases and windowed layers, "
          "Qwen3's q/k norms, YaRN on Llama and Qwen2 match transformers in fp32",
          "[nn][golden][families]") {
  for (const char* family : kFamilyCases) {
    const std::string name = std::string(family) + "_untied_f32";
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
    // The fixture can tell: the same weights computed as a plain Llama (the
    // family's piece missing) give a loss far outside the tolerance.
    const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
    const double loss = expected.at("loss").get<double>(), plain = expected.at("loss_without_feature").get<double>();
    INFO(name << ": loss " << loss << ", without the family's piece " << plain);
    CHECK(std::abs(plain - loss) > 100 * kGoldenF32.loss_rel * loss);
  }
}

TEST_CASE("golden: the families with tied embeddings in bf16 match transformers", "[nn][golden][families]") {
  for (const char* family : kFamilyCases) {
    const std::string name = std::string(family) + "_tied_bf16";
    if (std::string(family).ends_with("_yarn")) {
      // The fixture can tell YaRN in bf16 too: without it the loss moves beyond bf16's tolerance.
      const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
      const double loss = expected.at("loss").get<double>(), plain = expected.at("loss_without_feature").get<double>();
      INFO(name << ": loss " << loss << ", without YaRN " << plain);
      CHECK(std::abs(plain - loss) > kGoldenBf16VsTorchBf16.loss_rel * loss);
    }
    check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
  }
}

TEST_CASE("golden: the families with activation checkpointing in host memory", "[nn][golden][families]") {
  for (const char* family : kFamilyCases) {
    check_golden(Backend::kCpu, std::string(family) + "_untied_f32", "loss", "grads.safetensors", kGoldenF32,
                 std::nullopt, /*checkpoint_activations=*/true, /*cpu_checkpointing=*/true);
  }
}

TEST_CASE("golden: a packed batch equals transformers fed its documents one by one", "[nn][golden][packed]") {
  // Rows of several documents (positions restarting, padding after), GQA, and
  // Mistral's sliding window inside the documents; with and without activation
  // checkpointing (the recompute must see the same document boundaries).
  for (const char* name : {"llama_untied_f32_packed", "mistral_untied_f32_packed"}) {
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32, std::nullopt,
                 /*checkpoint_activations=*/true);
  }
  // The fixture can tell: the same rows as single sequences (attention across
  // documents, positions 0..seq-1) give another loss.
  const std::string dir = golden_dir("llama_untied_f32_packed");
  const nlohmann::json inputs = read_json(dir + "/inputs.json");
  Rig rig(Backend::kCpu);
  nn::DecoderModel model(*rig.engine, nn::load_decoder_config(dir + "/config.json"));
  rig.engine->finalize();
  nn::load_parameters(*rig.engine, model.parameters(), dir + "/model.safetensors");
  nn::ForwardOptions evaluation;
  evaluation.backward = false;
  model.forward(inputs.at("ids").get<std::vector<int32_t>>(), inputs.at("targets").get<std::vector<int32_t>>(),
                inputs.at("batch").get<int64_t>(), inputs.at("seq").get<int64_t>(), evaluation);
  const double unpacked = model.loss(), want = read_json(dir + "/expected.json").at("loss").get<double>();
  INFO("packed loss " << want << ", the rows as single sequences " << unpacked);
  CHECK(std::abs(unpacked - want) > 100 * kGoldenF32.loss_rel * want);
}

// scripts/make-golden-lora: PEFT adapters (random A and B, so every term of
// the adapter path moves the loss) on frozen bases; on the mixtures of
// experts the attention's projections (multi-head latent attention's five on
// DeepSeek-V3), the experts, shared experts and routers frozen, the
// load-balancing term in the loss where the config asks for it.
const char* const kLoraF32Cases[] = {"lora_llama_f32_all",       "lora_llama_f32_qv_rslora", "lora_qwen2_f32_attn",
                                     "lora_gemma3_f32_all",      "lora_qwen3_moe_f32_attn",  "lora_deepseek_v3_f32_mla",
                                     "lora_glm4_moe_f32_attn",   "lora_gpt_oss_f32_attn",    "lora_gemma3mm_f32_o_mlp"};

TEST_CASE("golden: LoRA adapters match PEFT (all projections, q/v with rsLoRA, qwen2's biased q/k/v, Gemma 3, and the "
          "attention of Qwen3-MoE, DeepSeek-V3's latent attention, GLM-4.5 with rsLoRA, gpt-oss, and o_proj and the MLP "
          "of a Gemma 3 checkpoint's text model, beside its vision tower)",
          "[nn][golden][lora]") {
  for (const char* name : kLoraF32Cases) {
    check_lora_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
    // The fixture can tell: the base alone is far outside the tolerance.
    const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
    const double loss = expected.at("loss").get<double>(), base = expected.at("base_loss").get<double>();
    INFO(name << ": loss " << loss << ", base alone " << base);
    CHECK(std::abs(base - loss) > 100 * kGoldenF32.loss_rel * loss);
  }
}

TEST_CASE("golden: LoRA on a bf16 base (fp32 adapters, as PEFT keeps them) matches PEFT, Llama and GLM-4.5",
          "[nn][golden][lora]") {
  for (const char* name : {"lora_llama_bf16_all", "lora_glm4_moe_bf16_attn"}) {
    check_lora_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    check_lora_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_lora_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
  }
}

TEST_CASE("golden: LoRA with activation checkpointing recomputes the adapters' path exactly",
          "[nn][golden][lora]") {
  GoldenRun run;
  run.lora = true;
  run.checkpoint_activations = true;
  check_golden_run(Backend::kCpu, "lora_llama_f32_all", "loss", "grads.safetensors", kGoldenF32, run);
  // And through the recomputed routing and latent attention of a mixture of experts.
  check_golden_run(Backend::kCpu, "lora_deepseek_v3_f32_mla", "loss", "grads.safetensors", kGoldenF32, run);
}

namespace {

// scripts/make-golden-moe: E = 8 experts, top 2, GQA, 2 layers, with
// output_router_logits (the loss includes router_aux_loss_coef * the
// load-balancing loss); each case has an expert no token chose. qwen2_moe
// adds the shared expert and its gate, Qwen2's q/k/v biases and (fp32) a
// sliding-window layer.
const char* const kMoeF32Cases[] = {"mixtral_untied_f32", "qwen3_moe_untied_f32", "qwen3_moe_nonorm_f32",
                                    "qwen2_moe_untied_f32"};
const char* const kMoeBf16Cases[] = {"mixtral_untied_bf16", "qwen3_moe_tied_bf16", "qwen2_moe_tied_bf16"};

}  // namespace

TEST_CASE("golden: Mixtral, Qwen3-MoE and Qwen2-MoE in fp32 match transformers, with and without the auxiliary loss",
          "[nn][golden][moe]") {
  for (const char* name : kMoeF32Cases) {
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32, std::nullopt,
                 /*checkpoint_activations=*/true);
    GoldenRun off;
    off.router_logits_off = true;
    check_golden_run(Backend::kCpu, name, "loss_without_aux", "", kGoldenF32, off);
    // The fixture can tell: the auxiliary term and the expert choice are visible in the loss.
    const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
    const double loss = expected.at("loss").get<double>(), lm = expected.at("loss_without_aux").get<double>();
    INFO(name << ": loss " << loss << ", without the auxiliary term " << lm);
    CHECK(std::abs(loss - lm) > 100 * kGoldenF32.loss_rel * loss);
    CHECK(!expected.at("unrouted_experts").empty());
  }
}

TEST_CASE("golden: Qwen2-MoE's shared expert is visible in its fixtures' loss", "[nn][golden][moe]") {
  // The same weights without the shared expert (scripts/make-golden-moe:
  // loss_without_feature) give a loss far outside the tolerance, so the
  // golden checks above would catch a missing or mis-gated shared expert.
  for (const char* name : {"qwen2_moe_untied_f32", "qwen2_moe_tied_bf16"}) {
    const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
    const double loss = expected.at("loss").get<double>(), plain = expected.at("loss_without_feature").get<double>();
    INFO(name << ": loss " << loss << ", without the shared expert " << plain);
    CHECK(std::abs(plain - loss) > 100 * kGoldenF32.loss_rel * loss);
    CHECK(std::abs(plain - loss) > kGoldenBf16VsTorchBf16.loss_rel * loss);  // even bf16's tolerance: >= 0.3%
  }
}

TEST_CASE("golden: Mixtral, Qwen3-MoE and Qwen2-MoE with bf16 weights match transformers", "[nn][golden][moe]") {
  for (const char* name : kMoeBf16Cases) {
    check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
    GoldenRun off;
    off.router_logits_off = true;
    check_golden_run(Backend::kCpu, name, "loss_without_aux_f32", "", kGoldenF32, off);
  }
}

namespace {

// scripts/make-golden-gemma: Gemma 2 (soft caps on the scores and the
// logits, a sliding layer and a full one) and Gemma 3 (q/k norms, two
// sliding layers and a full one, each kind with its own RoPE); both with
// GeGLU, (1 + w) norms, the scaled embedding, sandwich norms and
// query_pre_attn_scalar.
const char* const kGemmaCases[] = {"gemma2", "gemma3"};

}  // namespace

TEST_CASE("golden: Gemma 2 and Gemma 3 in fp32 match transformers, every piece of their math visible in the loss",
          "[nn][golden][gemma]") {
  for (const char* family : kGemmaCases) {
    const std::string name = std::string(family) + "_untied_f32";
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32, std::nullopt,
                 /*checkpoint_activations=*/true, /*cpu_checkpointing=*/true);
    // The fixture can tell: each piece taken out alone (transformers with
    // that piece disabled) moves the loss far outside the tolerance.
    const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
    const double loss = expected.at("loss").get<double>();
    const nlohmann::json& without = expected.at("loss_without_feature");
    CHECK(without.size() == 8);
    for (auto it = without.begin(); it != without.end(); ++it) {
      const double plain = it.value().get<double>();
      INFO(name << ": loss " << loss << ", without " << it.key() << " " << plain);
      CHECK(std::abs(plain - loss) > 100 * kGoldenF32.loss_rel * loss);
    }
  }
}

TEST_CASE("golden: Gemma 2 and Gemma 3 with tied bf16 weights match transformers", "[nn][golden][gemma]") {
  for (const char* family : kGemmaCases) {
    const std::string name = std::string(family) + "_tied_bf16";
    check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
    check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
  }
}

// scripts/make-golden-gemma's gemma3mm cases: the text model of a
// Gemma3ForConditionalGeneration saved by transformers (its layout, the
// vision tower beside it), which the script checks computes exactly
// Gemma3ForCausalLM's loss and gradients on text.
TEST_CASE("golden: the text model of a Gemma 3 checkpoint with its vision tower matches transformers, fp32 and bf16",
          "[nn][golden][gemma]") {
  check_golden(Backend::kCpu, "gemma3mm_tied_f32", "loss", "grads.safetensors", kGoldenF32);
  const nlohmann::json expected = read_json(golden_dir("gemma3mm_tied_f32") + "/expected.json");
  const double loss = expected.at("loss").get<double>();
  CHECK(expected.at("causal_lm_loss").get<double>() == loss);
  for (const auto& [piece, plain] : expected.at("loss_without_feature").items()) {
    INFO("loss " << loss << ", without " << piece << " " << plain);
    CHECK(std::abs(plain.get<double>() - loss) > 100 * kGoldenF32.loss_rel * loss);
  }
  check_golden(Backend::kCpu, "gemma3mm_tied_bf16", "loss_f32", "grads_f32.safetensors", kGoldenF32);
  check_golden(Backend::kCpu, "gemma3mm_tied_bf16", "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
  check_golden(Backend::kCpu, "gemma3mm_tied_bf16", "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
}

// scripts/make-golden-gptoss: gpt-oss (attention sinks, q/k/v/o biases, a
// sliding layer and a full one, YaRN; 8 stacked experts with biases and the
// clamped SwiGLU, gate and up interleaved, behind a biased router whose
// softmax runs over the top 2; the load-balancing loss), fp32 and bf16 weights.
TEST_CASE("golden: gpt-oss in fp32 matches transformers, every piece of its math visible in the loss",
          "[nn][golden][gpt_oss]") {
  const std::string name = "gpt_oss_untied_f32";
  check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32);
  std::cout << name << ": max gradient difference " << last_golden_grad_rel() << " of the gradient's max\n";
  check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenF32, std::nullopt,
               /*checkpoint_activations=*/true);
  GoldenRun off;
  off.router_logits_off = true;
  check_golden_run(Backend::kCpu, name, "loss_without_aux", "", kGoldenF32, off);
  // The fixture can tell: each piece taken out alone (transformers with that
  // piece disabled) moves the loss far outside the tolerance.
  const nlohmann::json expected = read_json(golden_dir(name) + "/expected.json");
  const double loss = expected.at("loss").get<double>();
  const nlohmann::json& without = expected.at("loss_without_feature");
  CHECK(without.size() == 10);
  for (auto it = without.begin(); it != without.end(); ++it) {
    const double plain = it.value().get<double>();
    INFO(name << ": loss " << loss << ", without " << it.key() << " " << plain);
    CHECK(std::abs(plain - loss) > 100 * kGoldenF32.loss_rel * loss);
  }
  CHECK(!expected.at("unrouted_experts").empty());
}

TEST_CASE("golden: gpt-oss with bf16 weights matches transformers", "[nn][golden][gpt_oss]") {
  const std::string name = "gpt_oss_untied_bf16";
  check_golden(Backend::kCpu, name, "loss_f32", "grads_f32.safetensors", kGoldenF32);
  std::cout << name << " (the bf16 weights in fp32): max gradient difference " << last_golden_grad_rel() << "\n";
  check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16);
  std::cout << name << " (fp32 activations vs torch bf16): max gradient difference " << last_golden_grad_rel() << "\n";
  check_golden(Backend::kCpu, name, "loss", "grads.safetensors", kGoldenBf16VsTorchBf16, DType::kBF16);
  std::cout << name << " (bf16 activations vs torch bf16): max gradient difference " << last_golden_grad_rel() << "\n";
  GoldenRun off;
  off.router_logits_off = true;
  check_golden_run(Backend::kCpu, name, "loss_without_aux_f32", "", kGoldenF32, off);
}
