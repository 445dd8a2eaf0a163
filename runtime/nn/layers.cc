// Embedding and RMSNorm modules over the CPU kernels.
#include "runtime/nn/layers.h"

#include "kernels/nn_ops.h"
#include "runtime/core/error.h"

namespace strata::nn {

Embedding::Embedding(Engine& engine, std::string name, int64_t vocab, int64_t dim, DType dtype)
    : Module(engine, std::move(name)), vocab_(vocab), dim_(dim) {
  weight_ = &add_parameter("weight", dtype, {vocab, dim});
}

Activations Embedding::forward(const std::vector<int32_t>& ids) {
  ids_ = ids;
  const auto rows = static_cast<int64_t>(ids.size());
  Activations out(static_cast<size_t>(rows * dim_));
  Parameter* params[] = {weight_};
  pre(params, false);
  cpu::embedding_forward(load(*weight_, scratch_), ids.data(), rows, vocab_, dim_, out.data());
  post(params, false);
  return out;
}

void Embedding::backward(const Activations& dout) {
  const auto rows = static_cast<int64_t>(ids_.size());
  check_numel(name_, "output gradient", dout.size(), static_cast<size_t>(rows * dim_));
  Parameter* params[] = {weight_};
  pre(params, true);
  cpu::embedding_backward(dout.data(), ids_.data(), rows, vocab_, dim_, grad(*weight_));
  post(params, true);
}

RMSNorm::RMSNorm(Engine& engine, std::string name, int64_t dim, double eps, DType dtype)
    : Module(engine, std::move(name)), dim_(dim), eps_(eps) {
  weight_ = &add_parameter("weight", dtype, {dim});
}

Activations RMSNorm::forward(const Activations& x, int64_t rows) {
  check_numel(name_, "input", x.size(), static_cast<size_t>(rows * dim_));
  x_ = x;
  rows_ = rows;
  rstd_.resize(static_cast<size_t>(rows));
  Activations y(x.size());
  Parameter* params[] = {weight_};
  pre(params, false);
  cpu::rmsnorm_forward(x.data(), load(*weight_, scratch_), rows, dim_, eps_, y.data(),
                       rstd_.data());
  post(params, false);
  return y;
}

Activations RMSNorm::backward(const Activations& dy) {
  check_numel(name_, "output gradient", dy.size(), x_.size());
  Activations dx(dy.size());
  Parameter* params[] = {weight_};
  pre(params, true);
  cpu::rmsnorm_backward(dy.data(), x_.data(), load(*weight_, scratch_), rstd_.data(), rows_, dim_,
                        dx.data(), grad(*weight_));
  post(params, true);
  return dx;
}

}  // namespace strata::nn
