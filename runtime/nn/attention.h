// Llama self-attention (q/k/v/o projections, rotary embedding, causal GQA
// attention) and the SwiGLU MLP (gate/up/down projections), as modules whose
// Linear children carry the Hugging Face names ("<name>.q_proj.weight", ...).
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>

#include "runtime/nn/linear.h"
#include "runtime/nn/llama_config.h"

namespace strata::nn {

class Attention : public Module {
 public:
  Attention(Engine& engine, std::string name, const LlamaConfig& config, DType dtype = DType::kF32);
  // x: [batch * seq, hidden] -> [batch * seq, hidden]; positions are 0..seq-1.
  Activations forward(const Activations& x, int64_t batch, int64_t seq);
  Activations backward(const Activations& dy);

  Linear& q_proj() { return *q_proj_; }
  Linear& o_proj() { return *o_proj_; }

 private:
  int64_t hidden_, heads_, kv_heads_, head_dim_;
  double rope_theta_;
  std::unique_ptr<Linear> q_proj_, k_proj_, v_proj_, o_proj_;
  int64_t batch_ = 0, seq_ = 0;
  std::vector<int32_t> positions_;
  Activations q_, k_, v_, out_;  // q, k after rotary embedding
  std::vector<float> lse_;
};

// How the MLP projections are tiled (TiledLinear); 1 x 1 means plain Linear.
struct MlpTiling {
  int64_t in_splits = 1, out_splits = 1;
};

class Mlp : public Module {
 public:
  Mlp(Engine& engine, std::string name, const LlamaConfig& config, DType dtype = DType::kF32,
      MlpTiling tiling = {});
  Activations forward(const Activations& x, int64_t rows);
  Activations backward(const Activations& dy);

 private:
  std::unique_ptr<LinearBase> gate_proj_, up_proj_, down_proj_;
  Activations gate_, up_;
};

}  // namespace strata::nn
