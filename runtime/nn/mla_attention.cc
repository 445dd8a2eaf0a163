// MlaAttention: projections through Linear children, the latent norms
// through RMSNorm children, the splits and joins of heads through
// Ops::copy on strided views, RoPE and attention through Ops.
#include "runtime/nn/mla_attention.h"

#include "core/error.h"

namespace strata::nn {
namespace {

// [rows, heads, width] as a (rows x heads) x width matrix, columns [c0, c1).
MatView head_columns(const TensorView& t, int64_t width, int64_t c0, int64_t c1) {
  const int64_t n = t.numel() / width;
  return MatView{t.data, t.desc.dtype, n, width, width}.columns(c0, c1);
}

// Columns [c0, c1) of a [rows, cols] tensor.
MatView columns(const TensorView& t, int64_t c0, int64_t c1) { return as_matrix(t).columns(c0, c1); }

}  // namespace

AttentionArena MlaAttention::arena(const DecoderConfig& c, int tensor_parallel, int64_t batch, int64_t seq,
                                   DType t) {
  tensor_parallel_share(c, tensor_parallel);  // refuses tensor parallelism
  const int64_t rows = batch * seq, h = c.num_attention_heads, d = c.head_dim, v = c.v_head_dim,
                nope = c.qk_nope_head_dim, r = c.qk_rope_head_dim, l = c.kv_lora_rank, q = c.q_lora_rank;
  const DType f32 = DType::kF32;
  AttentionArena a;
  a.saved_slots = kSavedSlots;
  a.scratch_slots = kScratchSlots;
  if (q > 0) {
    a.saved.push_back({kQa, t, {rows, q}});
    a.saved.push_back({kQaN, t, {rows, q}});
    a.saved.push_back({kRstdQa, f32, {rows}});
  }
  for (ArenaTensor x : std::vector<ArenaTensor>{{kQ, t, {rows, h, d}},
                                                {kKva, t, {rows, l + r}},
                                                {kLat, t, {rows, l}},
                                                {kLatN, t, {rows, l}},
                                                {kRstdKv, f32, {rows}},
                                                {kKv, t, {rows, h, nope + v}},
                                                {kKpe, t, {rows, 1, r}},
                                                {kK, t, {rows, h, d}},
                                                {kV, t, {rows, h, d}},
                                                {kAttn, t, {rows, h, d}},
                                                {kAttnV, t, {rows, h * v}},
                                                {kLse, f32, {batch, h, seq}}}) {
    a.saved.push_back(x);
  }
  a.scratch = {{kDq, t, {rows, h, d}},        {kDk, t, {rows, h, d}},       {kDv, t, {rows, h, d}},
               {kDattn, t, {rows, h, d}},     {kDattnV, t, {rows, h * v}},  {kDkv, t, {rows, h, nope + v}},
               {kDlatN, t, {rows, l}},        {kDlat, t, {rows, l}},        {kDkva, t, {rows, l + r}},
               {kDkpe, t, {rows, 1, r}}};
  if (q > 0) {
    a.scratch.push_back({kDqaN, t, {rows, q}});
    a.scratch.push_back({kDqa, t, {rows, q}});
  }
  return a;
}

MlaAttention::MlaAttention(engine::Engine& engine, std::string name, const DecoderConfig& c, int64_t layer,
                           DType dtype, const LoraSpec* lora)
    : SelfAttention(engine, std::move(name)),
      hidden_(c.hidden_size),
      heads_(c.num_attention_heads),
      nope_(c.qk_nope_head_dim),
      rope_dim_(c.qk_rope_head_dim),
      v_dim_(c.v_head_dim),
      kv_lora_(c.kv_lora_rank),
      q_lora_(c.q_lora_rank),
      rope_q_(c.rope),
      rope_k_(c.rope),
      mask_(c.attention_mask(layer)) {
  tensor_parallel_share(c, engine.tensor_group().size);  // refuses tensor parallelism
  rope_q_.rotary_offset = nope_;
  rope_q_.rotary_dim = rope_dim_;
  rope_k_.rotary_offset = 0;
  rope_k_.rotary_dim = rope_dim_;
  constexpr double kLatentEps = 1e-6;  // DeepseekV3RMSNorm's default: the latent norms are built without eps
  const int64_t d = nope_ + rope_dim_;
  const bool bias = c.attention_qkv_bias;
  // Declared in hf_tensors' order.
  if (q_lora_ > 0) {
    q_a_proj_ = std::make_unique<Linear>(engine, child_name("q_a_proj"), hidden_, q_lora_, bias, dtype, lora);
    q_a_layernorm_ = std::make_unique<RMSNorm>(engine, child_name("q_a_layernorm"), q_lora_, kLatentEps, dtype);
    q_b_proj_ = std::make_unique<Linear>(engine, child_name("q_b_proj"), q_lora_, heads_ * d, false, dtype, lora);
    add_child(*q_a_proj_);
    add_child(*q_a_layernorm_);
    add_child(*q_b_proj_);
  } else {
    q_proj_ = std::make_unique<Linear>(engine, child_name("q_proj"), hidden_, heads_ * d, false, dtype, lora);
    add_child(*q_proj_);
  }
  kv_a_proj_ = std::make_unique<Linear>(engine, child_name("kv_a_proj_with_mqa"), hidden_, kv_lora_ + rope_dim_,
                                        bias, dtype, lora);
  kv_a_layernorm_ = std::make_unique<RMSNorm>(engine, child_name("kv_a_layernorm"), kv_lora_, kLatentEps, dtype);
  kv_b_proj_ = std::make_unique<Linear>(engine, child_name("kv_b_proj"), kv_lora_, heads_ * (nope_ + v_dim_), false,
                                        dtype, lora);
  o_proj_ = std::make_unique<Linear>(engine, child_name("o_proj"), heads_ * v_dim_, hidden_, c.attention_o_bias,
                                     dtype, lora);
  add_child(*kv_a_proj_);
  add_child(*kv_a_layernorm_);
  add_child(*kv_b_proj_);
  add_child(*o_proj_);
}

void MlaAttention::forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
                           const AttentionActs& a, const TensorView& y, Phase phase) {
  const int64_t rows = batch * seq, d = nope_ + rope_dim_;
  check_shape(name_, "input", x, {rows, hidden_});
  STRATA_CHECK(a.saved.size() == kSavedSlots, kInternal, "{}: {} saved activations, expected {}", name_,
               a.saved.size(), static_cast<size_t>(kSavedSlots));
  const LoraScratch& lora = lora_scratch(a.lora);
  const TensorView &q = a.saved[kQ], &kva = a.saved[kKva], &lat = a.saved[kLat], &lat_n = a.saved[kLatN],
                   &kv = a.saved[kKv], &kpe = a.saved[kKpe], &k = a.saved[kK], &v = a.saved[kV],
                   &attn = a.saved[kAttn], &attn_v = a.saved[kAttnV];
  check_shape(name_, "q", q, {rows, heads_, d});
  // The query, RoPE on its last rope dims.
  if (q_lora_ > 0) {
    q_a_proj_->forward(as_matrix(x), as_matrix(a.saved[kQa]), phase, lora);
    q_a_layernorm_->forward(a.saved[kQa], a.saved[kQaN], a.saved[kRstdQa], phase);
    q_b_proj_->forward(as_matrix(a.saved[kQaN]), as_matrix(q), phase, lora);
  } else {
    q_proj_->forward(as_matrix(x), as_matrix(q), phase, lora);
  }
  ops().rope_forward(ctx(), q, places.positions, rope_q_);
  // The latent and the shared rope key; the latent's norm; each head's k_nope and v.
  kv_a_proj_->forward(as_matrix(x), as_matrix(kva), phase, lora);
  ops().copy(ctx(), columns(kva, 0, kv_lora_), as_matrix(lat), false);
  ops().copy(ctx(), columns(kva, kv_lora_, kv_lora_ + rope_dim_), as_matrix(kpe), false);
  ops().rope_forward(ctx(), kpe, places.positions, rope_k_);
  kv_a_layernorm_->forward(lat, lat_n, a.saved[kRstdKv], phase);
  kv_b_proj_->forward(as_matrix(lat_n), as_matrix(kv), phase, lora);
  const int64_t kv_width = nope_ + v_dim_;
  ops().copy(ctx(), head_columns(kv, kv_width, 0, nope_), head_columns(k, d, 0, nope_), false);
  for (int64_t h = 0; h < heads_; ++h) {
    ops().copy(ctx(), as_matrix(kpe), columns(k, h * d + nope_, (h + 1) * d), false);
  }
  engine_.accelerator().memset_async(v.data, 0, v.nbytes(), ctx().stream());  // the padding
  ops().copy(ctx(), head_columns(kv, kv_width, nope_, kv_width), head_columns(v, d, 0, v_dim_), false);
  ops().attention_forward(ctx(), reshaped(q, {batch, seq, heads_, d}), reshaped(k, {batch, seq, heads_, d}),
                          reshaped(v, {batch, seq, heads_, d}), reshaped(attn, {batch, seq, heads_, d}),
                          a.saved[kLse], places.mask(mask_, seq));
  ops().copy(ctx(), head_columns(attn, d, 0, v_dim_), MatView::of(reshaped(attn_v, {rows * heads_, v_dim_})),
             false);
  o_proj_->forward(as_matrix(attn_v), as_matrix(y), phase, lora);
}

void MlaAttention::backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places, int64_t batch,
                            int64_t seq, const AttentionActs& a, const AttentionGrads& g, const TensorView& dx,
                            bool accumulate_dx) {
  STRATA_CHECK(a.saved.size() == kSavedSlots && g.scratch.size() == kScratchSlots, kInternal,
               "{}: {} saved activations and {} scratch tensors, expected {} and {}", name_, a.saved.size(),
               g.scratch.size(), static_cast<size_t>(kSavedSlots), static_cast<size_t>(kScratchSlots));
  const int64_t rows = batch * seq, d = nope_ + rope_dim_, kv_width = nope_ + v_dim_;
  const LoraScratch& lora = lora_scratch(a.lora);
  const TensorView &q = a.saved[kQ], &lat = a.saved[kLat], &lat_n = a.saved[kLatN], &k = a.saved[kK],
                   &v = a.saved[kV], &attn = a.saved[kAttn], &attn_v = a.saved[kAttnV];
  const TensorView &dq = g.scratch[kDq], &dk = g.scratch[kDk], &dv = g.scratch[kDv], &dattn = g.scratch[kDattn],
                   &dattn_v = g.scratch[kDattnV], &dkv = g.scratch[kDkv], &dlat_n = g.scratch[kDlatN],
                   &dlat = g.scratch[kDlat], &dkva = g.scratch[kDkva], &dkpe = g.scratch[kDkpe];
  o_proj_->backward(as_matrix(dy), as_matrix(attn_v), as_matrix(dattn_v), false, lora);
  // The padded output's gradient: zero on the padding.
  engine_.accelerator().memset_async(dattn.data, 0, dattn.nbytes(), ctx().stream());
  ops().copy(ctx(), MatView::of(reshaped(dattn_v, {rows * heads_, v_dim_})), head_columns(dattn, d, 0, v_dim_),
             false);
  ops().attention_backward(ctx(), reshaped(dattn, {batch, seq, heads_, d}), reshaped(q, {batch, seq, heads_, d}),
                           reshaped(k, {batch, seq, heads_, d}), reshaped(v, {batch, seq, heads_, d}),
                           reshaped(attn, {batch, seq, heads_, d}), a.saved[kLse],
                           reshaped(dq, {batch, seq, heads_, d}), reshaped(dk, {batch, seq, heads_, d}),
                           reshaped(dv, {batch, seq, heads_, d}), places.mask(mask_, seq));
  // The query's path.
  ops().rope_backward(ctx(), dq, places.positions, rope_q_);
  if (q_lora_ > 0) {
    q_b_proj_->backward(as_matrix(dq), as_matrix(a.saved[kQaN]), as_matrix(g.scratch[kDqaN]), false, lora);
    q_a_layernorm_->backward(g.scratch[kDqaN], a.saved[kQa], a.saved[kRstdQa], g.scratch[kDqa], false);
    q_a_proj_->backward(as_matrix(g.scratch[kDqa]), as_matrix(x), as_matrix(dx), accumulate_dx, lora);
  } else {
    q_proj_->backward(as_matrix(dq), as_matrix(x), as_matrix(dx), accumulate_dx, lora);
  }
  // Each head's k_nope and v gradients into kv_b_proj's output, down to the latent.
  ops().copy(ctx(), head_columns(dk, d, 0, nope_), head_columns(dkv, kv_width, 0, nope_), false);
  ops().copy(ctx(), head_columns(dv, d, 0, v_dim_), head_columns(dkv, kv_width, nope_, kv_width), false);
  kv_b_proj_->backward(as_matrix(dkv), as_matrix(lat_n), as_matrix(dlat_n), false, lora);
  kv_a_layernorm_->backward(dlat_n, lat, a.saved[kRstdKv], dlat, false);
  // The shared rope key's gradient: every head's, summed, through RoPE.
  for (int64_t h = 0; h < heads_; ++h) {
    ops().copy(ctx(), columns(dk, h * d + nope_, (h + 1) * d), as_matrix(dkpe), h > 0);
  }
  ops().rope_backward(ctx(), dkpe, places.positions, rope_k_);
  ops().copy(ctx(), as_matrix(dlat), columns(dkva, 0, kv_lora_), false);
  ops().copy(ctx(), as_matrix(dkpe), columns(dkva, kv_lora_, kv_lora_ + rope_dim_), false);
  kv_a_proj_->backward(as_matrix(dkva), as_matrix(x), as_matrix(dx), true, lora);
}

}  // namespace strata::nn
