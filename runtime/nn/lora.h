// LoRA adapters (low-rank adaptation) on the decoder's projections, computed
// as PEFT computes them: a frozen projection y = x W^T (+ b) gains
//   y += s * (x A^T) B^T,   A [r, in], B [out, r], s = alpha / r
// (alpha / sqrt(r) with rsLoRA), where only A and B train. W + s * B A is
// never formed: two thin GEMMs of rank r run beside the base one, the scale
// inside the second (Ops::linear_forward's scale). Backward recomputes
// h = x A^T from the projection's saved input instead of keeping it, so an
// adapter adds no saved activation, only two [rows, r] scratch buffers shared
// by every adapted projection. With dropout (PEFT's lora_dropout, on the
// adapter's input only, in training forwards) the mask is a function of a
// seed per forward and per projection (Ops::dropout), regenerated in backward,
// and two [rows, in] scratch buffers more hold the dropped input and its
// gradient.
//
// Adapter parameters are named "<projection>.lora_A.weight" and
// "<projection>.lora_B.weight" ("model.layers.0.self_attn.q_proj.lora_A.weight"),
// PEFT's names without its "base_model.model." prefix (kPeftPrefix), and are
// fp32 whatever the base's dtype (PEFT's autocast_adapter_dtype).
// Errors: Error(kBadArgument) naming the flag (--lora-*) and the bad value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace strata::nn {

struct DecoderConfig;

// The projections an adapter may target, in PEFT's module names: grouped-query
// attention's q/k/v/o, multi-head latent attention's (DeepSeek-V3, Kimi K2:
// q_a_proj and q_b_proj, or q_proj; kv_a_proj_with_mqa, kv_b_proj, o_proj) and
// the dense MLP's. Which of them a model has: lora_projections.
inline constexpr const char* kLoraProjections[] = {
    "q_proj",   "k_proj",   "v_proj",   "o_proj",             "gate_proj", "up_proj",
    "down_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"};
// PEFT's shorthand for every linear layer of the model but the output head;
// a LoraSpec holds it as its one target until resolve_lora_targets.
inline constexpr std::string_view kAllLinear = "all-linear";
// PEFT's prefix of every tensor name in adapter_model.safetensors.
inline constexpr std::string_view kPeftPrefix = "base_model.model.";

struct LoraSpec {
  int64_t rank = 0;     // r; 0: no adapters
  double alpha = 0;     // lora_alpha
  bool rslora = false;  // scale alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r
  // Projection names from kLoraProjections, or {kAllLinear} before resolve_lora_targets.
  std::vector<std::string> targets;
  double dropout = 0;                // lora_dropout: the probability of dropping an input element

  bool enabled() const { return rank > 0; }
  // s: alpha / r, or alpha / sqrt(r) with rslora.
  double scaling() const;
  // Whether the projection named `name` ("...self_attn.q_proj") carries an adapter.
  bool targets_module(std::string_view name) const;
  // Error unless rank > 0, alpha > 0 and finite, 0 <= dropout < 1, and
  // targets is a non-empty list of known projections without repeats (or {kAllLinear}).
  void validate() const;
};

// --lora-targets: comma-separated projection names, or "all-linear" (kept as
// {kAllLinear}: what it names depends on the model).
std::vector<std::string> parse_lora_targets(std::string_view list);

// The projections of `config`'s layers that PEFT (0.21, on transformers 5)
// reaches by name as nn.Linear modules: the attention's (by its kind) and,
// when some layer is dense, the MLP's -- except on the mixture-of-experts
// families whose experts transformers 5 fuses (mixtral, qwen2_moe, qwen3_moe,
// deepseek_v3/kimi_k2, glm4_moe), where PEFT's conversion turns gate_proj,
// up_proj and down_proj into the routed experts' fused parameters
// (target_parameters) whichever module the name was meant for, so the dense
// layers' MLPs and the shared experts cannot be targeted. The routed experts
// and the routers are never among them.
std::vector<std::string> lora_projections(const DecoderConfig& config);

// Resolves `lora.targets` against the model, as PEFT would: {kAllLinear}
// becomes lora_projections(config); a named target must be one of them.
// Refused by name (Error kBadArgument, in the flag's terms): a target the
// model does not have; an MLP name or all-linear on a family where PEFT
// applies it to the routed experts (or the router), whose LoRA strata does
// not compute. A no-op without adapters.
void resolve_lora_targets(LoraSpec& lora, const DecoderConfig& config);

// Whether a parameter name is an adapter's ("...lora_A.weight" / "...lora_B.weight").
bool is_lora_parameter(std::string_view name);

// Scratch of the adapter path, shared by every adapted projection and not
// kept between them, in the activation dtype; and this forward's dropout.
struct LoraScratch {
  TensorView h;   // [rows, r]: x A^T (forward, and again in backward)
  TensorView dh;  // [rows, r]: the gradient at h
  // With dropout: [rows * in] for the largest in-features of a target: the
  // dropped input, and the gradient at it. Empty without dropout.
  TensorView xd, dxd;
  float dropout = 0;  // this forward's p (0 in evaluation)
  uint64_t seed = 0;  // this forward's mask seed (each projection mixes in its name)
};

}  // namespace strata::nn
