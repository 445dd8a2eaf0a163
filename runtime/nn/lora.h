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

// The projections an adapter may target, in PEFT's module names.
inline constexpr const char* kLoraProjections[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"};
// PEFT's prefix of every tensor name in adapter_model.safetensors.
inline constexpr std::string_view kPeftPrefix = "base_model.model.";

struct LoraSpec {
  int64_t rank = 0;     // r; 0: no adapters
  double alpha = 0;     // lora_alpha
  bool rslora = false;  // scale alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r
  std::vector<std::string> targets;  // projection names from kLoraProjections
  double dropout = 0;                // lora_dropout: the probability of dropping an input element

  bool enabled() const { return rank > 0; }
  // s: alpha / r, or alpha / sqrt(r) with rslora.
  double scaling() const;
  // Whether the projection named `name` ("...self_attn.q_proj") carries an adapter.
  bool targets_module(std::string_view name) const;
  // Error unless rank > 0, alpha > 0 and finite, 0 <= dropout < 1, and
  // targets is a non-empty list of known projections without repeats.
  void validate() const;
};

// --lora-targets: comma-separated projection names, or "all-linear" (PEFT's
// shorthand: every projection of the decoder layers, never lm_head).
std::vector<std::string> parse_lora_targets(std::string_view list);

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
