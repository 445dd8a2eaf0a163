// Multi-head latent attention (AttentionKind::kMla), DeepSeek-V3's and Kimi
// K2's (transformers' DeepseekV3Attention): q = q_b_proj(q_a_layernorm(
// q_a_proj(x))) (q_proj(x) when q_lora_rank is 0), [rows, heads, nope + rope];
// kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_pe (rope)], the latent
// through kv_a_layernorm and kv_b_proj into each head's [k_nope | v]; the
// rotary embedding on q's last `rope` dims and on k_pe, the one rope key every
// head shares; causal attention over q/k heads of nope + rope dims with the
// config's scale (YaRN's mscale^2: DecoderConfig::attention_scale); o_proj
// over the heads' v_head_dim outputs. Both latent norms take eps 1e-6
// (DeepseekV3RMSNorm's default), whatever rms_norm_eps says.
//
// The attention kernels take one head width for q, k and v: v is held
// zero-padded to the q/k head (its output's padding is zero too, and is
// dropped before o_proj), so the kernels compute exactly the narrower
// head's attention; it costs the padding's share of v's memory and GEMMs.
// Not with tensor parallelism yet (tensor_parallel_share refuses it).
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>

#include "runtime/nn/attention.h"

namespace strata::nn {

class MlaAttention final : public SelfAttention {
 public:
  // What it saves per layer (AttentionActs::saved), rows = batch x seq, H
  // heads, D = nope + rope, V = v_head_dim, L = kv_lora_rank, Q = q_lora_rank:
  // qa, qa_n [rows, Q] (q_a_proj's output and its norm; absent without
  // q_lora), rstd_qa fp32 [rows]; q [rows, H, D] after RoPE; kva [rows, L + R]
  // (kv_a_proj_with_mqa's output); lat, lat_n [rows, L] (the latent and its
  // norm), rstd_kv fp32 [rows]; kv [rows, H, nope + V] (kv_b_proj's output);
  // kpe [rows, 1, R] the rope key after RoPE; k [rows, H, D]; v [rows, H, D]
  // (zero-padded); attn [rows, H, D] the attention output (padded); attn_v
  // [rows, H V] (o_proj's input); lse fp32 [batch, H, seq].
  enum Saved : size_t {
    kQa, kQaN, kRstdQa, kQ, kKva, kLat, kLatN, kRstdKv, kKv, kKpe, kK, kV, kAttn, kAttnV, kLse, kSavedSlots
  };
  // Backward scratch: dq, dk, dv, dattn [rows, H, D]; dattn_v [rows, H V];
  // dqa_n, dqa [rows, Q] (absent without q_lora); dkv [rows, H, nope + V];
  // dlat_n, dlat [rows, L]; dkva [rows, L + R]; dkpe [rows, 1, R].
  enum Scratch : size_t {
    kDq, kDk, kDv, kDattn, kDattnV, kDqaN, kDqa, kDkv, kDlatN, kDlat, kDkva, kDkpe, kScratchSlots
  };
  static AttentionArena arena(const DecoderConfig& config, int tensor_parallel, int64_t batch, int64_t seq,
                              DType dtype);

  MlaAttention(engine::Engine& engine, std::string name, const DecoderConfig& config, int64_t layer,
               DType dtype = DType::kF32, const LoraSpec* lora = nullptr);
  void forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq, const AttentionActs& acts,
               const TensorView& y, Phase phase = Phase::kForward) override;
  void backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
                const AttentionActs& acts, const AttentionGrads& grads, const TensorView& dx,
                bool accumulate_dx) override;

 private:
  int64_t hidden_, heads_, nope_, rope_dim_, v_dim_, kv_lora_, q_lora_;
  ops::Rope rope_q_, rope_k_;  // on q's rope dims; on the shared rope key alone
  ops::AttentionMask mask_;
  std::unique_ptr<Linear> q_a_proj_, q_b_proj_, q_proj_, kv_a_proj_, kv_b_proj_, o_proj_;
  std::unique_ptr<RMSNorm> q_a_layernorm_, kv_a_layernorm_;
};

}  // namespace strata::nn
