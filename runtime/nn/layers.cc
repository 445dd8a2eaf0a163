// Embedding and RMSNorm modules over Ops.
#include "runtime/nn/layers.h"

namespace strata::nn {

Embedding::Embedding(engine::Engine& engine, std::string name, int64_t vocab, int64_t dim,
                     DType dtype, int64_t padding_idx, double scale)
    : Module(engine, std::move(name)), vocab_(vocab), dim_(dim), padding_idx_(padding_idx) {
  if (scale != 1.0) {
    const auto exact = static_cast<float>(scale);
    uint16_t half = 0;
    if (dtype == DType::kF32) {
      scale_ = exact;
    } else {
      convert(&exact, DType::kF32, &half, dtype, 1);
      convert(&half, dtype, &scale_, DType::kF32, 1);
    }
  }
  const engine::Engine::TensorGroup& tp = engine.tensor_group();
  split_ = tp.size > 1;
  if (split_) {
    weight_ = add_tp_shard("weight", dtype, {vocab, dim}, 0);
    first_id_ = vocab / tp.size * tp.rank;
  } else {
    weight_ = add_parameter("weight", dtype, {vocab, dim});
  }
  op_ = add_operator({weight_});
}

void Embedding::forward(const TensorView& ids, const TensorView& out, Phase phase) {
  check_shape(name_, "output", out, {ids.numel(), dim_});
  run(op_, phase,
      [&] { ops().embedding_forward(ctx(), param(weight_), ids, out, first_id_, split_ ? vocab_ : 0, scale_); });
}

void Embedding::backward(const TensorView& ids, const TensorView& dout) {
  check_shape(name_, "output gradient", dout, {ids.numel(), dim_});
  // A frozen table has no gradient, and its lookup's backward needs nothing
  // else: no window, so ZeRO-3 does not gather the table for nothing.
  if (engine_.param_info(weight_).frozen) return;
  run(op_, Phase::kBackward,
      [&] {
        ops().embedding_backward(ctx(), dout, ids, grad(weight_), padding_idx_, first_id_, split_ ? vocab_ : 0,
                                 scale_);
      });
}

RMSNorm::RMSNorm(engine::Engine& engine, std::string name, int64_t dim, double eps, DType dtype,
                 float weight_offset)
    : Module(engine, std::move(name)), dim_(dim), eps_(eps), weight_offset_(weight_offset) {
  weight_ = add_parameter("weight", dtype, {dim});
  op_ = add_operator({weight_});
}

void RMSNorm::forward(const TensorView& x, const TensorView& y, const TensorView& rstd,
                      Phase phase) {
  run(op_, phase, [&] { ops().rmsnorm_forward(ctx(), x, param(weight_), eps_, y, rstd, weight_offset_); });
}

void RMSNorm::backward(const TensorView& dy, const TensorView& x, const TensorView& rstd,
                       const TensorView& dx, bool accumulate_dx, const TensorView& tp_dw) {
  run(op_, Phase::kBackward, [&] {
    const TensorView dw = grad(weight_);
    if (tp_dw.data == nullptr || dw.data == nullptr) {
      ops().rmsnorm_backward(ctx(), dy, x, param(weight_), rstd, dx, accumulate_dx, dw, weight_offset_);
      return;
    }
    check_shape(name_, "tp weight-gradient scratch", tp_dw, {dim_});
    engine_.accelerator().memset_async(tp_dw.data, 0, tp_dw.nbytes(), engine_.compute_stream());
    ops().rmsnorm_backward(ctx(), dy, x, param(weight_), rstd, dx, accumulate_dx, tp_dw, weight_offset_);
    engine_.tp_allreduce(tp_dw);
    ops().add(ctx(), dw, tp_dw, dw);
  });
}

}  // namespace strata::nn
