// Attention and Mlp modules: projections through Linear children, q/k norms
// through RMSNorm children, the rest (rotary embedding, attention, SwiGLU)
// through Ops.
#include "runtime/nn/attention.h"

#include "core/error.h"

namespace strata::nn {

TensorView reshaped(const TensorView& t, Shape shape) {
  STRATA_CHECK(shape_numel(shape) == t.numel(), kBadArgument, "cannot view {} as {}",
               shape_string(t.desc.shape), shape_string(shape));
  TensorView v = t;
  v.desc.shape = std::move(shape);
  return v;
}

namespace {
// The adapter scratch an Acts points to; an empty one without adapters.
const LoraScratch& scratch_of(const LoraScratch* lora) {
  static const LoraScratch kNone;
  return lora != nullptr ? *lora : kNone;
}

// A [rows, ...] tensor as a rows x (everything else) matrix: q [rows, heads,
// head_dim] is the [rows, heads * head_dim] output of q_proj.
MatView mat(const TensorView& t) {
  const int64_t rows = t.desc.shape.empty() ? 1 : t.desc.shape[0];
  const int64_t cols = rows == 0 ? 0 : t.numel() / rows;
  return MatView{t.data, t.desc.dtype, rows, cols, cols};
}
}  // namespace

Attention::Attention(engine::Engine& engine, std::string name, const DecoderConfig& c, int64_t layer,
                     DType dtype, const LoraSpec* lora)
    : Module(engine, std::move(name)),
      hidden_(c.hidden_size),
      heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      rope_(c.rope),
      mask_(c.attention_mask(layer)) {
  // Tensor parallelism: each tp rank holds heads / tp query heads and their
  // kv heads (column-parallel q, k, v; row-parallel o).
  const int tp = engine.tensor_group().size;
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  const DecoderConfig share = tensor_parallel_share(c, tp);  // refuses what does not split
  const bool qkv_bias = c.attention_qkv_bias;
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
    q_norm_ = std::make_unique<RMSNorm>(engine, child_name("q_norm"), head_dim_, c.rms_norm_eps, dtype);
    k_norm_ = std::make_unique<RMSNorm>(engine, child_name("k_norm"), head_dim_, c.rms_norm_eps, dtype);
    add_child(*q_norm_);
    add_child(*k_norm_);
  }
  heads_ = share.num_attention_heads;
  kv_heads_ = share.num_key_value_heads;
}

TensorView Attention::per_head(const TensorView& t) {
  return reshaped(t, {t.desc.shape[0] * t.desc.shape[1], t.desc.shape[2]});
}

ops::AttentionMask Attention::mask_of(const TokenPlaces& places, int64_t seq) const {
  ops::AttentionMask mask = mask_;
  if (places.packed()) {
    mask.segment_start = places.segment_start.as<int32_t>();
    mask.segment_end = places.segment_end.as<int32_t>();
    mask.seq = seq;
  }
  return mask;
}

void Attention::forward(const TensorView& x, const TokenPlaces& places, int64_t batch,
                        int64_t seq, const AttentionActs& a, const TensorView& y, Phase phase) {
  const int64_t rows = batch * seq;
  check_shape(name_, "input", x, {rows, hidden_});
  check_shape(name_, "q", a.q, {rows, heads_, head_dim_});
  check_shape(name_, "k", a.k, {rows, kv_heads_, head_dim_});
  check_shape(name_, "v", a.v, {rows, kv_heads_, head_dim_});
  if (q_norm_) {
    check_shape(name_, "q before its norm", a.q_pre, {rows, heads_, head_dim_});
    check_shape(name_, "k before its norm", a.k_pre, {rows, kv_heads_, head_dim_});
  }
  if (q_norm_) {
    // Qwen3: q = q_norm(q_proj(x)) per head, then RoPE; the projections stay for the norms' backward.
    q_proj_->forward(mat(x), mat(a.q_pre), phase, scratch_of(a.lora));
    k_proj_->forward(mat(x), mat(a.k_pre), phase, scratch_of(a.lora));
    q_norm_->forward(per_head(a.q_pre), per_head(a.q), a.rstd_q, phase);
    k_norm_->forward(per_head(a.k_pre), per_head(a.k), a.rstd_k, phase);
  } else {
    q_proj_->forward(mat(x), mat(a.q), phase, scratch_of(a.lora));
    k_proj_->forward(mat(x), mat(a.k), phase, scratch_of(a.lora));
  }
  v_proj_->forward(mat(x), mat(a.v), phase, scratch_of(a.lora));
  ops().rope_forward(ctx(), a.q, places.positions, rope_);
  ops().rope_forward(ctx(), a.k, places.positions, rope_);
  ops().attention_forward(ctx(), reshaped(a.q, {batch, seq, heads_, head_dim_}),
                          reshaped(a.k, {batch, seq, kv_heads_, head_dim_}),
                          reshaped(a.v, {batch, seq, kv_heads_, head_dim_}),
                          reshaped(a.attn, {batch, seq, heads_, head_dim_}), a.lse, mask_of(places, seq));
  o_proj_->forward(mat(a.attn), mat(y), phase, scratch_of(a.lora));  // with tp, this rank's heads' share
}

void Attention::backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places,
                         int64_t batch, int64_t seq, const AttentionActs& a,
                         const AttentionGrads& g, const TensorView& dx, bool accumulate_dx) {
  const bool tp = engine_.tensor_group().size > 1;
  STRATA_CHECK(!tp || !accumulate_dx, kInternal, "{}: with tensor parallelism dx is a partial sum, so it cannot accumulate",
               name_);
  o_proj_->backward(mat(dy), mat(a.attn), mat(g.dattn), false, scratch_of(a.lora));
  ops().attention_backward(ctx(), reshaped(g.dattn, {batch, seq, heads_, head_dim_}),
                           reshaped(a.q, {batch, seq, heads_, head_dim_}),
                           reshaped(a.k, {batch, seq, kv_heads_, head_dim_}),
                           reshaped(a.v, {batch, seq, kv_heads_, head_dim_}),
                           reshaped(a.attn, {batch, seq, heads_, head_dim_}), a.lse,
                           reshaped(g.dq, {batch, seq, heads_, head_dim_}),
                           reshaped(g.dk, {batch, seq, kv_heads_, head_dim_}),
                           reshaped(g.dv, {batch, seq, kv_heads_, head_dim_}), mask_of(places, seq));
  ops().rope_backward(ctx(), g.dq, places.positions, rope_);
  ops().rope_backward(ctx(), g.dk, places.positions, rope_);
  if (q_norm_) {
    // Through the norms into dattn (free since o_proj's backward, and as
    // large as dq), then each projection before the next norm reuses it.
    const TensorView dq_pre = reshaped(g.dattn, a.q_pre.desc.shape);
    // With tensor parallelism each norm saw this rank's heads only: its
    // weight gradient is summed over tp (row 0 of dnorm for q, 1 for k).
    TensorView dw_q, dw_k;
    if (tp) {
      check_shape(name_, "norm gradient scratch", g.dnorm, {2, head_dim_});
      const TensorDesc row{DType::kF32, {head_dim_}, g.dnorm.desc.tier};
      dw_q = TensorView{row, g.dnorm.data};
      dw_k = TensorView{row, static_cast<char*>(g.dnorm.data) + row.nbytes()};
    }
    q_norm_->backward(per_head(g.dq), per_head(a.q_pre), a.rstd_q, per_head(dq_pre), false, dw_q);
    q_proj_->backward(mat(dq_pre), mat(x), mat(dx), accumulate_dx, scratch_of(a.lora));
    TensorView dk_pre = g.dattn;
    dk_pre.desc.shape = a.k_pre.desc.shape;  // the first rows * kv_heads * head_dim elements
    k_norm_->backward(per_head(g.dk), per_head(a.k_pre), a.rstd_k, per_head(dk_pre), false, dw_k);
    kv_backward(*k_proj_, dk_pre, x, g, dx, a);
  } else {
    q_proj_->backward(mat(g.dq), mat(x), mat(dx), accumulate_dx, scratch_of(a.lora));
    kv_backward(*k_proj_, g.dk, x, g, dx, a);
  }
  kv_backward(*v_proj_, g.dv, x, g, dx, a);  // with tp, this rank's heads' share of the input gradient
}

void Attention::kv_backward(Linear& proj, const TensorView& dy, const TensorView& x, const AttentionGrads& g,
                            const TensorView& dx, const AttentionActs& a) {
  if (proj.shared()) {
    proj.backward_shared(mat(dy), mat(x), mat(dx), true, g.dkv);
  } else {
    proj.backward(mat(dy), mat(x), mat(dx), true, scratch_of(a.lora));
  }
}

Mlp::Mlp(engine::Engine& engine, std::string name, const DecoderConfig& c, DType dtype,
         MlpTiling tiling, const LoraSpec* lora, int64_t intermediate)
    : Module(engine, std::move(name)) {
  const int64_t width = intermediate > 0 ? intermediate : c.intermediate_size;
  // Tensor parallelism: column-parallel gate and up, row-parallel down, each
  // rank width / tp of the intermediate features.
  const int tp = engine.tensor_group().size;
  const bool untiled = tiling.in_splits == 1 && tiling.out_splits == 1;
  if (tp > 1) {
    STRATA_CHECK(width % tp == 0, kBadArgument,
                 "tensor parallelism {} does not divide the MLP's intermediate size {}", tp, width);
    STRATA_CHECK(untiled, kBadArgument, "MLP tiling is not implemented with tensor parallelism yet");
  }
  auto make = [&](const char* local, int64_t in, int64_t out, TensorSplit split) -> std::unique_ptr<LinearBase> {
    if (untiled) {
      return std::make_unique<Linear>(engine, child_name(local), in, out, c.mlp_bias, dtype, lora, split);
    }
    STRATA_CHECK(lora == nullptr || !lora->targets_module(local), kBadArgument,
                 "a LoRA adapter on {} needs the projection untiled: leave it out of --lora-targets "
                 "or turn MLP tiling off",
                 local);
    return std::make_unique<TiledLinear>(engine, child_name(local), in, out, tiling.in_splits,
                                         tiling.out_splits, c.mlp_bias, dtype);
  };
  gate_proj_ = make("gate_proj", c.hidden_size, width, TensorSplit::kColumn);
  up_proj_ = make("up_proj", c.hidden_size, width, TensorSplit::kColumn);
  down_proj_ = make("down_proj", width, c.hidden_size, TensorSplit::kRow);
  for (LinearBase* l : {gate_proj_.get(), up_proj_.get(), down_proj_.get()}) add_child(*l);
}

void Mlp::forward(const TensorView& x, const MlpActs& a, const TensorView& y, Phase phase) {
  gate_proj_->forward(mat(x), mat(a.gate), phase, scratch_of(a.lora));
  up_proj_->forward(mat(x), mat(a.up), phase, scratch_of(a.lora));
  ops().swiglu_forward(ctx(), a.gate, a.up, a.act);
  down_proj_->forward(mat(a.act), mat(y), phase, scratch_of(a.lora));  // with tp, this rank's features' share
}

void Mlp::backward(const TensorView& dy, const TensorView& x, const MlpActs& a, const MlpGrads& g,
                   const TensorView& dx, bool accumulate_dx) {
  const bool tp = engine_.tensor_group().size > 1;
  STRATA_CHECK(!tp || !accumulate_dx, kInternal, "{}: with tensor parallelism dx is a partial sum, so it cannot accumulate",
               name_);
  down_proj_->backward(mat(dy), mat(a.act), mat(g.dact), false, scratch_of(a.lora));
  ops().swiglu_backward(ctx(), g.dact, a.gate, a.up, g.dgate, g.dup);
  gate_proj_->backward(mat(g.dgate), mat(x), mat(dx), accumulate_dx, scratch_of(a.lora));
  up_proj_->backward(mat(g.dup), mat(x), mat(dx), true, scratch_of(a.lora));  // with tp, a partial sum
}

}  // namespace strata::nn
