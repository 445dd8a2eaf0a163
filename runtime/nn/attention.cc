// Attention and Mlp modules: projections through Linear children, the rest
// through the CPU attention, rotary and SwiGLU kernels.
#include "runtime/nn/attention.h"

#include "kernels/nn_ops.h"
#include "runtime/core/error.h"

namespace strata::nn {

Attention::Attention(Engine& engine, std::string name, const LlamaConfig& c, DType dtype)
    : Module(engine, std::move(name)),
      hidden_(c.hidden_size),
      heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      rope_theta_(c.rope_theta) {
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  q_proj_ =
      std::make_unique<Linear>(engine, child_name("q_proj"), hidden_, q, c.attention_bias, dtype);
  k_proj_ =
      std::make_unique<Linear>(engine, child_name("k_proj"), hidden_, kv, c.attention_bias, dtype);
  v_proj_ =
      std::make_unique<Linear>(engine, child_name("v_proj"), hidden_, kv, c.attention_bias, dtype);
  o_proj_ =
      std::make_unique<Linear>(engine, child_name("o_proj"), q, hidden_, c.attention_bias, dtype);
  for (Linear* l : {q_proj_.get(), k_proj_.get(), v_proj_.get(), o_proj_.get()}) add_child(*l);
}

Activations Attention::forward(const Activations& x, int64_t batch, int64_t seq) {
  const int64_t rows = batch * seq;
  check_numel(name_, "input", x.size(), static_cast<size_t>(rows * hidden_));
  batch_ = batch;
  seq_ = seq;
  positions_.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) positions_[r] = static_cast<int32_t>(r % seq);
  q_ = q_proj_->forward(x, rows);
  k_ = k_proj_->forward(x, rows);
  v_ = v_proj_->forward(x, rows);
  cpu::rope_forward(q_.data(), positions_.data(), rows, heads_, head_dim_, rope_theta_);
  cpu::rope_forward(k_.data(), positions_.data(), rows, kv_heads_, head_dim_, rope_theta_);
  cpu::AttentionShape s{batch, seq, heads_, kv_heads_, head_dim_};
  out_.resize(q_.size());
  lse_.resize(static_cast<size_t>(batch * heads_ * seq));
  cpu::attention_forward(q_.data(), k_.data(), v_.data(), s, out_.data(), lse_.data());
  return o_proj_->forward(out_, rows);
}

Activations Attention::backward(const Activations& dy) {
  const int64_t rows = batch_ * seq_;
  const Activations dout = o_proj_->backward(dy);
  Activations dq(q_.size()), dk(k_.size()), dv(v_.size());
  cpu::AttentionShape s{batch_, seq_, heads_, kv_heads_, head_dim_};
  cpu::attention_backward(dout.data(), q_.data(), k_.data(), v_.data(), out_.data(), lse_.data(), s,
                          dq.data(), dk.data(), dv.data());
  cpu::rope_backward(dq.data(), positions_.data(), rows, heads_, head_dim_, rope_theta_);
  cpu::rope_backward(dk.data(), positions_.data(), rows, kv_heads_, head_dim_, rope_theta_);
  Activations dx = q_proj_->backward(dq);
  const Activations dxk = k_proj_->backward(dk);
  const Activations dxv = v_proj_->backward(dv);
  const auto n = static_cast<int64_t>(dx.size());
  cpu::add(dx.data(), dxk.data(), n, dx.data());
  cpu::add(dx.data(), dxv.data(), n, dx.data());
  return dx;
}

Mlp::Mlp(Engine& engine, std::string name, const LlamaConfig& c, DType dtype, MlpTiling tiling)
    : Module(engine, std::move(name)) {
  auto make = [&](const char* local, int64_t in, int64_t out) -> std::unique_ptr<LinearBase> {
    if (tiling.in_splits == 1 && tiling.out_splits == 1) {
      return std::make_unique<Linear>(engine, child_name(local), in, out, c.mlp_bias, dtype);
    }
    return std::make_unique<TiledLinear>(engine, child_name(local), in, out, tiling.in_splits,
                                         tiling.out_splits, c.mlp_bias, dtype);
  };
  gate_proj_ = make("gate_proj", c.hidden_size, c.intermediate_size);
  up_proj_ = make("up_proj", c.hidden_size, c.intermediate_size);
  down_proj_ = make("down_proj", c.intermediate_size, c.hidden_size);
  for (LinearBase* l : {gate_proj_.get(), up_proj_.get(), down_proj_.get()}) add_child(*l);
}

Activations Mlp::forward(const Activations& x, int64_t rows) {
  gate_ = gate_proj_->forward(x, rows);
  up_ = up_proj_->forward(x, rows);
  Activations h(gate_.size());
  cpu::swiglu_forward(gate_.data(), up_.data(), static_cast<int64_t>(h.size()), h.data());
  return down_proj_->forward(h, rows);
}

Activations Mlp::backward(const Activations& dy) {
  const Activations dh = down_proj_->backward(dy);
  Activations dgate(gate_.size()), dup(up_.size());
  cpu::swiglu_backward(dh.data(), gate_.data(), up_.data(), static_cast<int64_t>(dh.size()),
                       dgate.data(), dup.data());
  Activations dx = gate_proj_->backward(dgate);
  const Activations dxu = up_proj_->backward(dup);
  cpu::add(dx.data(), dxu.data(), static_cast<int64_t>(dx.size()), dx.data());
  return dx;
}

}  // namespace strata::nn
