// GqaAttention: projections through Linear children, q/k norms through
// RMSNorm children, the rest (rotary embedding, attention) through Ops.
#include "runtime/nn/gqa_attention.h"

#include "core/error.h"
#include "runtime/nn/context_attention.h"

namespace strata::nn {

AttentionArena GqaAttention::arena(const DecoderConfig& whole, int tensor_parallel, int64_t batch, int64_t seq,
                                   DType t) {
  // This rank's share of the heads (all of them without tensor parallelism).
  const DecoderConfig c = tensor_parallel_share(whole, tensor_parallel);
  const int64_t rows = batch * seq, heads = c.num_attention_heads, kv_heads = c.num_key_value_heads,
                hd = c.head_dim;
  const DType f32 = DType::kF32;
  AttentionArena a;
  a.saved_slots = kSavedSlots;
  a.scratch_slots = kScratchSlots;
  a.saved = {{kQ, t, {rows, heads, hd}},
             {kK, t, {rows, kv_heads, hd}},
             {kV, t, {rows, kv_heads, hd}},
             {kAttn, t, {rows, heads * hd}},
             {kLse, f32, {batch, heads, seq}}};
  if (c.qk_norm) {
    a.saved.push_back({kQPre, t, {rows, heads, hd}});
    a.saved.push_back({kKPre, t, {rows, kv_heads, hd}});
    a.saved.push_back({kRstdQ, f32, {rows * heads}});
    a.saved.push_back({kRstdK, f32, {rows * kv_heads}});
  }
  if (c.attention_sinks) a.saved.push_back({kSinks, f32, {heads}});
  a.scratch = {{kDq, t, {rows, heads, hd}},
               {kDk, t, {rows, kv_heads, hd}},
               {kDv, t, {rows, kv_heads, hd}},
               {kDattn, t, {rows, heads * hd}}};
  if (c.qk_norm && tensor_parallel > 1) a.scratch.push_back({kDnorm, f32, {2, hd}});
  if (tensor_parallel > whole.num_key_value_heads) {  // shared kv heads: Linear::backward_shared
    a.scratch.push_back(
        {kDkv, f32, {whole.num_key_value_heads * hd * (c.hidden_size + (c.attention_qkv_bias ? 1 : 0))}});
  }
  return a;
}

GqaAttention::GqaAttention(engine::Engine& engine, std::string name, const DecoderConfig& c, int64_t layer,
                           DType dtype, const LoraSpec* lora)
    : SelfAttention(engine, std::move(name)),
      hidden_(c.hidden_size),
      heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      rope_(c.rope_of(layer)),
      mask_(c.attention_mask(layer)) {
  // Tensor parallelism: each tp rank holds heads / tp query heads and their
  // kv heads (column-parallel q, k, v; row-parallel o).
  const int tp = engine.tensor_group().size;
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  const DecoderConfig share = tensor_parallel_share(c, tp);  // refuses what does not split
  const bool qkv_bias = c.attention_qkv_bias;
  if (c.attention_sinks) {
    // Declared first: this module's own parameter precedes its children's (Module::parameters).
    STRATA_CHECK(tp == 1, kBadArgument, "{}: attention sinks are not implemented with tensor parallelism yet", name_);
    sinks_ = add_parameter("sinks", dtype, {heads_});
    sinks_op_ = add_operator({sinks_}, "sinks");
  }
  const TensorSplit column = TensorSplit::kColumn, row = TensorSplit::kRow;
  // Fewer kv heads than ranks: this rank's query heads use kv head
  // rank / (tp / KV), which it shares with the other ranks whose heads do.
  TpBlock kv_block;
  if (tp > kv_heads_) {
    const int copies = tp / static_cast<int>(kv_heads_);
    kv_block = TpBlock{kv_heads_, engine.tensor_group().rank / copies, copies};
  }
  q_proj_ = std::make_unique<Linear>(engine, child_name("q_proj"), hidden_, q, qkv_bias, dtype, lora, column);
  k_proj_ = std::make_unique<Linear>(engine, child_name("k_proj"), hidden_, kv, qkv_bias, dtype, lora, column,
                                     kv_block);
  v_proj_ = std::make_unique<Linear>(engine, child_name("v_proj"), hidden_, kv, qkv_bias, dtype, lora, column,
                                     kv_block);
  o_proj_ = std::make_unique<Linear>(engine, child_name("o_proj"), q, hidden_, c.attention_o_bias, dtype, lora, row);
  for (Linear* l : {q_proj_.get(), k_proj_.get(), v_proj_.get(), o_proj_.get()}) add_child(*l);
  if (c.qk_norm) {
    q_norm_ = std::make_unique<RMSNorm>(engine, child_name("q_norm"), head_dim_, c.rms_norm_eps, dtype,
                                        c.norm_weight_offset);
    k_norm_ = std::make_unique<RMSNorm>(engine, child_name("k_norm"), head_dim_, c.rms_norm_eps, dtype,
                                        c.norm_weight_offset);
    add_child(*q_norm_);
    add_child(*k_norm_);
  }
  heads_ = share.num_attention_heads;
  kv_heads_ = share.num_key_value_heads;
}

ops::AttentionMask GqaAttention::sink_mask(const ops::AttentionMask& mask, const AttentionActs& a) {
  const TensorView& sinks = a.saved[kSinks];
  check_shape(name_, "sinks", sinks, {heads_});
  ops().cast(ctx(), param(sinks_), sinks);
  ops::AttentionMask m = mask;
  m.sinks = sinks.as<const float>();
  return m;
}

TensorView GqaAttention::per_head(const TensorView& t) {
  return reshaped(t, {t.desc.shape[0] * t.desc.shape[1], t.desc.shape[2]});
}

void GqaAttention::forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
                           const AttentionActs& a, const TensorView& y, Phase phase) {
  const int64_t rows = batch * seq;
  check_shape(name_, "input", x, {rows, hidden_});
  STRATA_CHECK(a.saved.size() == kSavedSlots, kInternal, "{}: {} saved activations, expected {}", name_,
               a.saved.size(), static_cast<size_t>(kSavedSlots));
  const TensorView &q = a.saved[kQ], &k = a.saved[kK], &v = a.saved[kV], &attn = a.saved[kAttn];
  const LoraScratch& lora = lora_scratch(a.lora);
  check_shape(name_, "q", q, {rows, heads_, head_dim_});
  check_shape(name_, "k", k, {rows, kv_heads_, head_dim_});
  check_shape(name_, "v", v, {rows, kv_heads_, head_dim_});
  if (q_norm_) {
    const TensorView &q_pre = a.saved[kQPre], &k_pre = a.saved[kKPre];
    check_shape(name_, "q before its norm", q_pre, {rows, heads_, head_dim_});
    check_shape(name_, "k before its norm", k_pre, {rows, kv_heads_, head_dim_});
    // Qwen3: q = q_norm(q_proj(x)) per head, then RoPE; the projections stay for the norms' backward.
    q_proj_->forward(as_matrix(x), as_matrix(q_pre), phase, lora);
    k_proj_->forward(as_matrix(x), as_matrix(k_pre), phase, lora);
    q_norm_->forward(per_head(q_pre), per_head(q), a.saved[kRstdQ], phase);
    k_norm_->forward(per_head(k_pre), per_head(k), a.saved[kRstdK], phase);
  } else {
    q_proj_->forward(as_matrix(x), as_matrix(q), phase, lora);
    k_proj_->forward(as_matrix(x), as_matrix(k), phase, lora);
  }
  v_proj_->forward(as_matrix(x), as_matrix(v), phase, lora);
  ops().rope_forward(ctx(), q, places.positions, rope_);
  ops().rope_forward(ctx(), k, places.positions, rope_);
  ops::AttentionMask mask = places.mask(mask_, seq);
  if (sinks_ >= 0) run(sinks_op_, phase, [&] { mask = sink_mask(mask, a); });
  if (places.context != nullptr) {  // this rank's two chunks of each sequence, with the cp group
    places.context->forward(q, k, v, attn, a.saved[kLse], batch, mask);
  } else {
    ops().attention_forward(ctx(), reshaped(q, {batch, seq, heads_, head_dim_}),
                            reshaped(k, {batch, seq, kv_heads_, head_dim_}),
                            reshaped(v, {batch, seq, kv_heads_, head_dim_}),
                            reshaped(attn, {batch, seq, heads_, head_dim_}), a.saved[kLse], mask);
  }
  o_proj_->forward(as_matrix(attn), as_matrix(y), phase, lora);  // with tp, this rank's heads' share
}

void GqaAttention::backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places, int64_t batch,
                            int64_t seq, const AttentionActs& a, const AttentionGrads& g, const TensorView& dx,
                            bool accumulate_dx) {
  const bool tp = engine_.tensor_group().size > 1;
  STRATA_CHECK(!tp || !accumulate_dx, kInternal, "{}: with tensor parallelism dx is a partial sum, so it cannot accumulate",
               name_);
  STRATA_CHECK(a.saved.size() == kSavedSlots && g.scratch.size() == kScratchSlots, kInternal,
               "{}: {} saved activations and {} scratch tensors, expected {} and {}", name_, a.saved.size(),
               g.scratch.size(), static_cast<size_t>(kSavedSlots), static_cast<size_t>(kScratchSlots));
  const TensorView &q = a.saved[kQ], &k = a.saved[kK], &v = a.saved[kV], &attn = a.saved[kAttn];
  const TensorView &dq = g.scratch[kDq], &dk = g.scratch[kDk], &dv = g.scratch[kDv], &dattn = g.scratch[kDattn];
  const LoraScratch& lora = lora_scratch(a.lora);
  o_proj_->backward(as_matrix(dy), as_matrix(attn), as_matrix(dattn), false, lora);
  const auto attention = [&](const ops::AttentionMask& mask) {
    if (places.context != nullptr) {  // sinks with cp's key blocks: refused by the ops
      places.context->backward(dattn, q, k, v, attn, a.saved[kLse], dq, dk, dv, batch, mask);
      return;
    }
    ops().attention_backward(ctx(), reshaped(dattn, {batch, seq, heads_, head_dim_}),
                             reshaped(q, {batch, seq, heads_, head_dim_}),
                             reshaped(k, {batch, seq, kv_heads_, head_dim_}),
                             reshaped(v, {batch, seq, kv_heads_, head_dim_}),
                             reshaped(attn, {batch, seq, heads_, head_dim_}), a.saved[kLse],
                             reshaped(dq, {batch, seq, heads_, head_dim_}),
                             reshaped(dk, {batch, seq, kv_heads_, head_dim_}),
                             reshaped(dv, {batch, seq, kv_heads_, head_dim_}), mask);
  };
  if (sinks_ >= 0) {
    // The sinks again as the kernels read them (with activation checkpointing
    // the layers share the saved slots), and their gradient unless frozen.
    run(sinks_op_, Phase::kBackward, [&] {
      const ops::AttentionMask mask = sink_mask(places.mask(mask_, seq), a);
      attention(mask);
      const TensorView dsinks = grad(sinks_);
      if (dsinks.data != nullptr) {
        ops().attention_sinks_backward(ctx(), reshaped(dattn, {batch, seq, heads_, head_dim_}),
                                       reshaped(attn, {batch, seq, heads_, head_dim_}), a.saved[kLse], mask, dsinks);
      }
    });
  } else {
    attention(places.mask(mask_, seq));
  }
  ops().rope_backward(ctx(), dq, places.positions, rope_);
  ops().rope_backward(ctx(), dk, places.positions, rope_);
  if (q_norm_) {
    const TensorView &q_pre = a.saved[kQPre], &k_pre = a.saved[kKPre];
    // Through the norms into dattn (free since o_proj's backward, and as
    // large as dq), then each projection before the next norm reuses it.
    const TensorView dq_pre = reshaped(dattn, q_pre.desc.shape);
    // With tensor parallelism each norm saw this rank's heads only: its
    // weight gradient is summed over tp (row 0 of dnorm for q, 1 for k).
    TensorView dw_q, dw_k;
    if (tp) {
      const TensorView& dnorm = g.scratch[kDnorm];
      check_shape(name_, "norm gradient scratch", dnorm, {2, head_dim_});
      const TensorDesc row{DType::kF32, {head_dim_}, dnorm.desc.tier};
      dw_q = TensorView{row, dnorm.data};
      dw_k = TensorView{row, static_cast<char*>(dnorm.data) + row.nbytes()};
    }
    q_norm_->backward(per_head(dq), per_head(q_pre), a.saved[kRstdQ], per_head(dq_pre), false, dw_q);
    q_proj_->backward(as_matrix(dq_pre), as_matrix(x), as_matrix(dx), accumulate_dx, lora);
    TensorView dk_pre = dattn;
    dk_pre.desc.shape = k_pre.desc.shape;  // the first rows * kv_heads * head_dim elements
    k_norm_->backward(per_head(dk), per_head(k_pre), a.saved[kRstdK], per_head(dk_pre), false, dw_k);
    kv_backward(*k_proj_, dk_pre, x, g, dx, a);
  } else {
    q_proj_->backward(as_matrix(dq), as_matrix(x), as_matrix(dx), accumulate_dx, lora);
    kv_backward(*k_proj_, dk, x, g, dx, a);
  }
  kv_backward(*v_proj_, dv, x, g, dx, a);  // with tp, this rank's heads' share of the input gradient
}

void GqaAttention::kv_backward(Linear& proj, const TensorView& dy, const TensorView& x, const AttentionGrads& g,
                               const TensorView& dx, const AttentionActs& a) {
  if (proj.shared()) {
    proj.backward_shared(as_matrix(dy), as_matrix(x), as_matrix(dx), true, g.scratch[kDkv]);
  } else {
    proj.backward(as_matrix(dy), as_matrix(x), as_matrix(dx), true, lora_scratch(a.lora));
  }
}

}  // namespace strata::nn
