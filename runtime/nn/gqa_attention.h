// Grouped-query self-attention (AttentionKind::kGqa), the attention of every
// family but DeepSeek's: q/k/v/o projections with the family's biases,
// Qwen3's per-head q/k RMSNorm, the rotary embedding with the config's
// frequencies on the whole head, causal GQA attention with the layer's
// sliding window, and gpt-oss's attention sinks ("<name>.sinks" [heads], read
// in a window of their own). With tensor parallelism each rank holds heads / tp query
// heads and their kv heads (column-parallel q, k, v; row-parallel o), or
// shares one kv head with the ranks whose query heads use it.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>

#include "runtime/nn/attention.h"

namespace strata::nn {

class GqaAttention final : public SelfAttention {
 public:
  // What it saves per layer (AttentionActs::saved): q [rows, heads, head_dim]
  // and k/v [rows, kv_heads, head_dim] after the rotary embedding (and the
  // q/k norms), attn [rows, heads * head_dim] the attention output (o_proj's
  // input), lse fp32 [batch, heads, seq]; with q/k norms (qwen3) also q_pre,
  // k_pre (the projections before the norms, shaped as q, k) and rstd_q fp32
  // [rows * heads], rstd_k fp32 [rows * kv_heads], absent otherwise; with
  // attention sinks (gpt-oss) sinks fp32 [heads], the sinks as the kernels
  // read them (cast from the parameter in its window, forward and backward).
  enum Saved : size_t { kQ, kK, kV, kAttn, kLse, kQPre, kKPre, kRstdQ, kRstdK, kSinks, kSavedSlots };
  // Its backward scratch (AttentionGrads::scratch): dq, dk, dv, dattn shaped
  // as q, k, v, attn (with q/k norms dattn also holds the gradients before
  // the norms once o_proj's backward has used it); with q/k norms and tensor
  // parallelism dnorm fp32 [2, head_dim], the norms' weight-gradient scratch
  // (RMSNorm::backward's tp_dw); with fewer kv heads than tp ranks dkv fp32
  // [num_key_value_heads x head_dim x (hidden + 1 with q/k/v biases)], the
  // shared k/v projections' gradient scratch (Linear::backward_shared).
  enum Scratch : size_t { kDq, kDk, kDv, kDattn, kDnorm, kDkv, kScratchSlots };
  // The arena those take (attention_arena's kGqa case).
  static AttentionArena arena(const DecoderConfig& config, int tensor_parallel, int64_t batch, int64_t seq,
                              DType dtype);

  // Layer `layer` of `config` (its sliding window); `lora`: adapters on the
  // projections it targets.
  GqaAttention(engine::Engine& engine, std::string name, const DecoderConfig& config, int64_t layer,
               DType dtype = DType::kF32, const LoraSpec* lora = nullptr);
  void forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq, const AttentionActs& acts,
               const TensorView& y, Phase phase = Phase::kForward) override;
  void backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
                const AttentionActs& acts, const AttentionGrads& grads, const TensorView& dx,
                bool accumulate_dx) override;

 private:
  // A projection's per-head rows [rows, heads, head_dim] as [rows * heads, head_dim].
  static TensorView per_head(const TensorView& t);
  // k_proj's or v_proj's backward, dx accumulated: through backward_shared
  // when the rank shares its kv head with others (fewer kv heads than tp).
  void kv_backward(Linear& proj, const TensorView& dy, const TensorView& x, const AttentionGrads& g,
                   const TensorView& dx, const AttentionActs& a);

  // The mask with the sinks (cast into the saved slot) when the layer has them.
  ops::AttentionMask sink_mask(const ops::AttentionMask& mask, const AttentionActs& a);

  int64_t hidden_, heads_, kv_heads_, head_dim_;
  ParamId sinks_ = -1;  // gpt-oss's attention sinks; -1: none
  OpId sinks_op_ = -1;
  ops::Rope rope_;
  ops::AttentionMask mask_;
  std::unique_ptr<Linear> q_proj_, k_proj_, v_proj_, o_proj_;
  std::unique_ptr<RMSNorm> q_norm_, k_norm_;  // null without q/k norms
};

}  // namespace strata::nn
