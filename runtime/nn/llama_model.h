// A Llama-style decoder (Hugging Face LlamaForCausalLM layout): embedding,
// decoder layers (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP ->
// residual), final RMSNorm, and the output projection fused with a chunked
// cross-entropy loss. Parameter names are Hugging Face's, so weights load from
// and save to HF safetensors unchanged (runtime/nn/llama_weights.h).
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>

#include "runtime/nn/attention.h"
#include "runtime/nn/layers.h"

namespace strata::nn {

class DecoderLayer : public Module {
 public:
  DecoderLayer(Engine& engine, std::string name, const LlamaConfig& config, DType dtype,
               MlpTiling mlp_tiling = {});
  Activations forward(const Activations& x, int64_t batch, int64_t seq);
  Activations backward(const Activations& dy);

 private:
  int64_t rows_ = 0;
  std::unique_ptr<RMSNorm> input_layernorm_, post_attention_layernorm_;
  std::unique_ptr<Attention> self_attn_;
  std::unique_ptr<Mlp> mlp_;
};

struct LlamaModelOptions {
  DType dtype = DType::kF32;      // parameter storage
  int64_t loss_chunk_rows = 256;  // rows of logits formed at a time by the loss
  MlpTiling mlp_tiling;           // memory-centric tiling of the MLP projections
};

class LlamaModel : public Module {
 public:
  LlamaModel(Engine& engine, const LlamaConfig& config, LlamaModelOptions options = {});

  // Mean cross-entropy of predicting targets[t] from ids[0..t] within each
  // sequence. ids, targets: [batch * seq]; targets may hold kIgnoreIndex (-100).
  double forward(const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                 int64_t batch, int64_t seq);
  // Adds the gradient of the last forward's mean loss into every parameter's gradient.
  void backward();

  const LlamaConfig& config() const { return config_; }

 private:
  LlamaConfig config_;
  LlamaModelOptions options_;
  std::unique_ptr<Embedding> embed_tokens_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  std::unique_ptr<RMSNorm> norm_;
  std::unique_ptr<Module> lm_head_;  // holds lm_head.weight unless tied
  Parameter* lm_head_param_ = nullptr;
  int64_t batch_ = 0, seq_ = 0, counted_ = 0;
  std::vector<int32_t> targets_;
  Activations final_hidden_;
  std::vector<float> lse_, scratch_;
};

// Deterministic initialisation keyed by (parameter name, element index), so the
// result does not depend on registration order or on how a tensor is sharded:
// normal(0, std) for matrices, 1 for norm weights, 0 for biases. Writes through
// engine.data() in each parameter's storage dtype.
void initialize_parameters(Engine& engine, const std::vector<Parameter*>& params, uint64_t seed,
                           double std = 0.02);

}  // namespace strata::nn
