// Self-attention (q/k/v/o projections with the family's biases, Qwen3's
// per-head q/k RMSNorm, rotary embedding with the config's frequencies,
// causal GQA attention with the layer's sliding window) and the SwiGLU MLP
// (gate/up/down projections), as modules whose children carry the Hugging
// Face names ("<name>.q_proj.weight", "<name>.q_norm.weight", ...).
// What a forward saves for its backward lives in the caller's activation arena
// and is passed in as the *Acts structs; backward scratch as *Grads.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>

#include "runtime/nn/layers.h"
#include "runtime/nn/linear.h"
#include "runtime/nn/decoder_config.h"

namespace strata::nn {

// A view of the same memory with another shape (same numel).
TensorView reshaped(const TensorView& t, Shape shape);

// Saved by Attention::forward for backward. q [rows, heads, head_dim] and k/v
// [rows, kv_heads, head_dim] hold the projections after the rotary embedding
// (and the q/k norms); attn [rows, heads * head_dim] the attention output
// (o_proj's input); lse fp32 [batch, heads, seq]. With q/k norms (qwen3) also
// q_pre, k_pre (the projections before the norms, shaped as q, k) and
// rstd_q fp32 [rows * heads], rstd_k fp32 [rows * kv_heads]; empty otherwise.
struct AttentionActs {
  TensorView q, k, v, attn, lse;
  TensorView q_pre, k_pre, rstd_q, rstd_k;
  // The model's one adapter scratch (shared by every layer, not saved); null without adapters.
  const LoraScratch* lora = nullptr;
};
// Backward scratch, same shapes as q, k, v, attn. With q/k norms, dattn also
// holds the gradients before the norms once o_proj's backward has used it.
struct AttentionGrads {
  TensorView dq, dk, dv, dattn;
  // With q/k norms and tensor parallelism: fp32 [2, head_dim], the norms'
  // weight-gradient scratch (RMSNorm::backward's tp_dw); empty otherwise.
  TensorView dnorm;
  // With fewer kv heads than tp ranks: fp32 [num_key_value_heads x head_dim
  // x (hidden + 1 with q/k/v biases)], the shared k/v projections' gradient
  // scratch (Linear::backward_shared); empty otherwise.
  TensorView dkv;
};

// Where each token is in its row: positions int32 [rows] (the rotary
// embedding's), and with packed documents the first position of each token's
// document and one past its last (int32 [rows] each, kernels/attention_mask.h);
// segment views without data: one document per row.
struct TokenPlaces {
  TensorView positions, segment_start, segment_end;
  bool packed() const { return segment_start.data != nullptr; }
};

class Attention : public Module {
 public:
  // Layer `layer` of `config` (its sliding window); `lora`: adapters on the
  // projections it targets.
  Attention(engine::Engine& engine, std::string name, const DecoderConfig& config, int64_t layer,
            DType dtype = DType::kF32, const LoraSpec* lora = nullptr);
  // x, y [batch * seq, hidden]. With tensor parallelism y is this rank's
  // heads' partial sum, and backward's dx likewise: the caller sums them over
  // the tp group (Megatron's g and f; DecoderLayer).
  void forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
               const AttentionActs& acts, const TensorView& y, Phase phase = Phase::kForward);
  // dx [rows, hidden] = input gradient (+= when accumulate_dx; not with tp).
  void backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places,
                int64_t batch, int64_t seq, const AttentionActs& acts,
                const AttentionGrads& grads, const TensorView& dx, bool accumulate_dx);

  Linear& q_proj() { return *q_proj_; }
  Linear& o_proj() { return *o_proj_; }
  int64_t q_width() const { return heads_ * head_dim_; }
  int64_t kv_width() const { return kv_heads_ * head_dim_; }

 private:
  // A projection's per-head rows [rows, heads, head_dim] as [rows * heads, head_dim].
  static TensorView per_head(const TensorView& t);
  // k_proj's or v_proj's backward, dx accumulated: through backward_shared
  // when the rank shares its kv head with others (fewer kv heads than tp).
  void kv_backward(Linear& proj, const TensorView& dy, const TensorView& x, const AttentionGrads& g,
                   const TensorView& dx, const AttentionActs& a);
  // The layer's mask with the batch's documents.
  ops::AttentionMask mask_of(const TokenPlaces& places, int64_t seq) const;

  int64_t hidden_, heads_, kv_heads_, head_dim_;
  ops::Rope rope_;
  ops::AttentionMask mask_;
  std::unique_ptr<Linear> q_proj_, k_proj_, v_proj_, o_proj_;
  std::unique_ptr<RMSNorm> q_norm_, k_norm_;  // null without q/k norms
};

// How the MLP projections are tiled (TiledLinear); 1 x 1 means plain Linear.
struct MlpTiling {
  int64_t in_splits = 1, out_splits = 1;
};

// Saved by Mlp::forward: gate, up and silu(gate) * up, each [rows, intermediate].
struct MlpActs {
  TensorView gate, up, act;
  const LoraScratch* lora = nullptr;  // as AttentionActs::lora
};
// Backward scratch, each [rows, intermediate].
struct MlpGrads {
  TensorView dact, dgate, dup;
};

class Mlp : public Module {
 public:
  // Adapters (`lora`) need untiled projections: a target with tiling is refused.
  // intermediate: the width (0: config.intermediate_size; qwen2_moe's shared
  // expert passes shared_expert_intermediate_size).
  Mlp(engine::Engine& engine, std::string name, const DecoderConfig& config,
      DType dtype = DType::kF32, MlpTiling tiling = {}, const LoraSpec* lora = nullptr,
      int64_t intermediate = 0);
  // As Attention's: with tensor parallelism y and dx are this rank's
  // features' partial sums, completed by the caller.
  void forward(const TensorView& x, const MlpActs& acts, const TensorView& y,
               Phase phase = Phase::kForward);
  void backward(const TensorView& dy, const TensorView& x, const MlpActs& acts,
                const MlpGrads& grads, const TensorView& dx, bool accumulate_dx);

 private:
  std::unique_ptr<LinearBase> gate_proj_, up_proj_, down_proj_;
};

}  // namespace strata::nn
