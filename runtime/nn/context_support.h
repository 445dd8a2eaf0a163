// What context parallelism (issue 46) is implemented with: the one table that
// strata finetune, the config's rules, strata plan, the memory planner and
// DecoderModel ask before step 1, each naming what it refuses in its own
// terms (a key, a flag, a model_type). Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/nn/decoder_config.h"

namespace strata::nn {

// What a run may combine context parallelism with.
enum class CpFeature : uint8_t {
  kPipeline,         // pipeline stages (a model split into parts)
  kLayerMajor,       // layer-major micro-batches (the same split)
  kExperts,          // mixture-of-experts layers, expert parallelism
  kLatentAttention,  // multi-head latent attention (DeepSeek-V3, Kimi K2)
  kLora,             // LoRA adapters: parameters summed over cp as over dp
};

// Whether context parallelism is implemented with `feature`.
bool context_parallel_supports(CpFeature feature);

// One thing a run uses, as its caller names it.
struct CpUse {
  CpFeature feature;
  bool used = false;
  std::string what;  // e.g. "LoRA (--lora-rank)", "moe.expert_parallel_size 2"
};

// What a run of `config` with LoRA or pipeline stages uses, in strata
// finetune's terms (--pp, --lora-rank, the model_type): what finetune, strata
// plan and the memory planner ask about.
std::vector<CpUse> context_parallel_uses(const DecoderConfig& config, bool lora, int pipeline_stages);

// Each of `uses` that is used and not supported, as "<who> with <what>:
// context parallelism with it is not implemented yet" (who: "--cp 2",
// "context_parallel.size 2", ...), in order; empty when all is.
std::vector<std::string> unsupported_with_context_parallel(const std::string& who, const std::vector<CpUse>& uses);
// Throws kBadArgument with the first of those, if any.
void refuse_unsupported_with_context_parallel(const std::string& who, const std::vector<CpUse>& uses);

}  // namespace strata::nn
