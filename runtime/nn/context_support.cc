#include "runtime/nn/context_support.h"

#include <fmt/format.h>

#include "core/error.h"

namespace strata::nn {

bool context_parallel_supports(CpFeature feature) {
  switch (feature) {
    case CpFeature::kLora: return true;  // adapters are parameters like the others: summed over dp x cp
    case CpFeature::kPipeline: return true;  // each stage's cp group splits its sequences; its rows pass between stages
    case CpFeature::kLayerMajor:
    case CpFeature::kExperts:
    case CpFeature::kLatentAttention: return false;
  }
  return false;
}

std::vector<CpUse> context_parallel_uses(const DecoderConfig& config, bool lora, int pipeline_stages) {
  return {{CpFeature::kPipeline, pipeline_stages > 1, fmt::format("pipeline parallelism (--pp {})", pipeline_stages)},
          {CpFeature::kLora, lora, "LoRA (--lora-rank)"},
          {CpFeature::kExperts, config.moe(), fmt::format("a mixture-of-experts model (model_type {})", config.model_type)},
          {CpFeature::kLatentAttention, config.attention != AttentionKind::kGqa,
           fmt::format("multi-head latent attention (model_type {})", config.model_type)}};
}

std::vector<std::string> unsupported_with_context_parallel(const std::string& who, const std::vector<CpUse>& uses) {
  std::vector<std::string> out;
  for (const CpUse& u : uses) {
    if (u.used && !context_parallel_supports(u.feature)) {
      out.push_back(fmt::format("{} with {}: context parallelism with it is not implemented yet", who, u.what));
    }
  }
  return out;
}

void refuse_unsupported_with_context_parallel(const std::string& who, const std::vector<CpUse>& uses) {
  const std::vector<std::string> problems = unsupported_with_context_parallel(who, uses);
  if (!problems.empty()) raise(ErrorCategory::kBadArgument, "{}", problems.front());
}

}  // namespace strata::nn
