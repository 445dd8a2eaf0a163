// LoraSpec's rules and the --lora-targets list.
#include "runtime/nn/lora.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "core/error.h"
#include "runtime/nn/decoder_config.h"

namespace strata::nn {
namespace {

bool known_projection(std::string_view name) {
  return std::find(std::begin(kLoraProjections), std::end(kLoraProjections), name) !=
         std::end(kLoraProjections);
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& p : names) s += (s.empty() ? "" : ",") + p;
  return s;
}

std::string known_list() { return joined({std::begin(kLoraProjections), std::end(kLoraProjections)}); }

bool is_mlp(std::string_view name) { return name == "gate_proj" || name == "up_proj" || name == "down_proj"; }

// The mixture-of-experts families whose experts transformers 5 fuses into
// stacked parameters and whose LoRA configs PEFT 0.21 converts
// (peft/utils/transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING:
// the families with a checkpoint conversion mapping; Kimi K2 loads as
// DeepseekV3ForCausalLM). On all of them all-linear reaches the experts and
// the router; on those following qwen2_moe's pattern the names gate_proj,
// up_proj and down_proj become the experts' fused parameters wherever they
// were meant (mixtral's experts are w1/w2/w3, and it has no other MLP).
bool peft_maps_mlp_names_to_experts(const DecoderConfig& c) {
  const std::string& t = c.model_type;
  return c.moe() && (t == "qwen2_moe" || t == "qwen3_moe" || t == "deepseek_v3" || t == "kimi_k2" || t == "glm4_moe");
}

bool peft_all_linear_reaches_experts(const DecoderConfig& c) {
  return peft_maps_mlp_names_to_experts(c) || (c.moe() && c.model_type == "mixtral");
}

std::vector<std::string> attention_projections(const DecoderConfig& c) {
  if (c.attention == AttentionKind::kMla) {
    if (c.q_lora_rank > 0) return {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
    return {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
  }
  return {"q_proj", "k_proj", "v_proj", "o_proj"};
}

}  // namespace

double LoraSpec::scaling() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool LoraSpec::targets_module(std::string_view name) const {
  const size_t dot = name.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
  return enabled() && std::find(targets.begin(), targets.end(), last) != targets.end();
}

void LoraSpec::validate() const {
  STRATA_CHECK(rank > 0, kBadArgument, "--lora-rank must be a positive whole number, got {}", rank);
  STRATA_CHECK(std::isfinite(alpha) && alpha > 0, kBadArgument,
               "--lora-alpha must be a positive number, got {}", alpha);
  STRATA_CHECK(dropout >= 0 && dropout < 1, kBadArgument, "--lora-dropout must be in [0, 1), got {}", dropout);
  STRATA_CHECK(!targets.empty(), kBadArgument, "--lora-targets names no projection (known: {})",
               known_list());
  if (targets.size() == 1 && targets.front() == kAllLinear) return;
  for (size_t i = 0; i < targets.size(); ++i) {
    STRATA_CHECK(known_projection(targets[i]), kBadArgument,
                 "--lora-targets: '{}' is not a projection of the model (known: {}, or all-linear)",
                 targets[i], known_list());
    STRATA_CHECK(std::find(targets.begin(), targets.begin() + static_cast<std::ptrdiff_t>(i),
                           targets[i]) == targets.begin() + static_cast<std::ptrdiff_t>(i),
                 kBadArgument, "--lora-targets names '{}' twice", targets[i]);
  }
}

std::vector<std::string> parse_lora_targets(std::string_view list) {
  if (list == kAllLinear) return {std::string(kAllLinear)};
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string_view item = list.substr(start, comma - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    STRATA_CHECK(!item.empty(), kBadArgument,
                 "--lora-targets '{}' has an empty name (a comma-separated list such as q_proj,v_proj)",
                 list);
    out.emplace_back(item);
    start = comma + 1;
  }
  return out;
}

std::vector<std::string> lora_projections(const DecoderConfig& c) {
  std::vector<std::string> out = attention_projections(c);
  if (c.any_dense_layer() && !peft_maps_mlp_names_to_experts(c)) {
    for (const char* p : {"gate_proj", "up_proj", "down_proj"}) out.emplace_back(p);
  }
  return out;
}

void resolve_lora_targets(LoraSpec& lora, const DecoderConfig& c) {
  if (!lora.enabled()) return;
  if (c.multimodal) {
    // PEFT 0.21 matches target names on the whole Gemma3ForConditionalGeneration:
    // q_proj, k_proj and v_proj are also the SigLIP vision tower's attention,
    // and all-linear reaches its out_proj and fc1/fc2 too; strata trains the
    // text model only, so what PEFT would place would not be what strata trains.
    for (const std::string& t : lora.targets) {
      STRATA_CHECK(t != "q_proj" && t != "k_proj" && t != "v_proj" && t != kAllLinear, kBadArgument,
                   "--lora-targets {} on a gemma3 checkpoint (Gemma3ForConditionalGeneration): PEFT puts '{}' on the "
                   "vision tower's {} too, which strata does not train (it trains the text model): target o_proj, "
                   "gate_proj, up_proj and down_proj, which only the text model has{}",
                   t, t, t == kAllLinear ? "linear layers" : "attention projection of that name",
                   t == "q_proj" || t == "v_proj" ? " (q_proj,v_proj is --lora-targets' default)" : "");
    }
  }
  const std::vector<std::string> projections = lora_projections(c);
  const std::string attention = joined(attention_projections(c));
  if (lora.targets.size() == 1 && lora.targets.front() == kAllLinear) {
    STRATA_CHECK(!peft_all_linear_reaches_experts(c), kBadArgument,
                 "--lora-targets all-linear on model_type {}: PEFT (on transformers 5, which fuses the experts) makes "
                 "all-linear reach the routed experts' fused gate_up_proj and down_proj and the router (mlp.gate) as "
                 "target_parameters, and LoRA on the experts and routers is not implemented: name the projections "
                 "instead ({})",
                 c.model_type, attention);
    lora.targets = projections;
    return;
  }
  for (const std::string& t : lora.targets) {
    if (std::find(projections.begin(), projections.end(), t) != projections.end()) continue;
    STRATA_CHECK(t != kAllLinear, kBadArgument,
                 "--lora-targets: all-linear stands alone, not in a list with projection names");
    STRATA_CHECK(!(is_mlp(t) && peft_maps_mlp_names_to_experts(c)), kBadArgument,
                 "--lora-targets {} on model_type {}: PEFT (on transformers 5, which fuses the experts) applies "
                 "gate_proj, up_proj and down_proj to the routed experts' fused gate_up_proj and down_proj "
                 "(target_parameters), never to {}; LoRA on the routed experts is not implemented: target the "
                 "attention ({})",
                 t, c.model_type,
                 c.shared_expert() || c.any_dense_layer() ? "the dense layers' MLPs or the shared experts"
                                                          : "another module",
                 attention);
    STRATA_CHECK(!(is_mlp(t) && c.moe() && !c.any_dense_layer()), kBadArgument,
                 "--lora-targets {} on model_type {}: every MLP of the model is the routed experts', stored as fused "
                 "parameters that PEFT's target_modules does not reach (its target_parameters, LoRA on the experts, "
                 "is not implemented): target the attention ({})",
                 t, c.model_type, attention);
    raise(ErrorCategory::kBadArgument, "--lora-targets: '{}' is not a projection of model_type {} (its projections: {}{})",
          t, c.model_type, joined(projections), peft_all_linear_reaches_experts(c) ? "" : ", or all-linear");
  }
}

bool is_lora_parameter(std::string_view name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

}  // namespace strata::nn
