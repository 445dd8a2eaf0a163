// Linear and TiledLinear modules over the CPU GEMM kernels.
#include "runtime/nn/linear.h"

#include <cstring>

#include "kernels/nn_ops.h"
#include "runtime/core/error.h"

namespace strata::nn {

Linear::Linear(Engine& engine, std::string name, int64_t in, int64_t out, bool bias, DType dtype)
    : LinearBase(engine, std::move(name)), in_(in), out_(out) {
  STRATA_CHECK(in > 0 && out > 0, kBadArgument, "{}: bad Linear shape in={} out={}", name_, in,
               out);
  weight_ = &add_parameter("weight", dtype, {out, in});
  if (bias) bias_ = &add_parameter("bias", dtype, {out});
}

Activations Linear::forward(const Activations& x, int64_t rows) {
  check_numel(name_, "input", x.size(), static_cast<size_t>(rows * in_));
  x_ = x;
  rows_ = rows;
  Activations y(static_cast<size_t>(rows * out_));
  std::vector<Parameter*> params{weight_};
  if (bias_ != nullptr) params.push_back(bias_);
  pre(params, false);
  const float* w = load(*weight_, w_scratch_);
  const float* b = bias_ != nullptr ? load(*bias_, b_scratch_) : nullptr;
  cpu::linear_forward(x.data(), in_, w, b, rows, in_, out_, y.data(), out_, false);
  post(params, false);
  return y;
}

Activations Linear::backward(const Activations& dy) {
  check_numel(name_, "output gradient", dy.size(), static_cast<size_t>(rows_ * out_));
  Activations dx(static_cast<size_t>(rows_ * in_));
  std::vector<Parameter*> params{weight_};
  if (bias_ != nullptr) params.push_back(bias_);
  pre(params, true);
  const float* w = load(*weight_, w_scratch_);
  cpu::linear_backward(dy.data(), out_, x_.data(), in_, w, rows_, in_, out_, dx.data(), in_, false,
                       grad(*weight_), bias_ != nullptr ? grad(*bias_) : nullptr);
  post(params, true);
  return dx;
}

std::vector<int64_t> split_boundaries(int64_t n, int64_t parts) {
  STRATA_CHECK(parts >= 1 && parts <= n, kBadArgument, "cannot split {} features into {} parts", n,
               parts);
  std::vector<int64_t> b{0};
  for (int64_t p = 0; p < parts; ++p) b.push_back(b.back() + n / parts + (p < n % parts ? 1 : 0));
  return b;
}

TiledLinear::TiledLinear(Engine& engine, std::string name, int64_t in, int64_t out,
                         int64_t in_splits, int64_t out_splits, bool bias, DType dtype)
    : LinearBase(engine, std::move(name)),
      in_(in),
      out_(out),
      in_parts_(split_boundaries(in, in_splits)),
      out_parts_(split_boundaries(out, out_splits)) {
  for (int64_t o = 0; o < out_splits; ++o) {
    for (int64_t i = 0; i < in_splits; ++i) {
      tiles_.push_back(&add_parameter(
          "weight.tile_" + std::to_string(o) + "_" + std::to_string(i), dtype,
          {out_parts_[o + 1] - out_parts_[o], in_parts_[i + 1] - in_parts_[i]},
          ParameterSlice{child_name("weight"), {out, in}, {out_parts_[o], in_parts_[i]}}));
    }
  }
  if (bias) {
    for (int64_t o = 0; o < out_splits; ++o) {
      biases_.push_back(&add_parameter("bias.tile_" + std::to_string(o), dtype,
                                       {out_parts_[o + 1] - out_parts_[o]},
                                       ParameterSlice{child_name("bias"), {out}, {out_parts_[o]}}));
    }
  }
}

std::vector<Parameter*> TiledLinear::tile_params(int64_t o, int64_t i) {
  std::vector<Parameter*> params{&tile(o, i)};
  // The bias of an out part is added once, with its first input tile.
  if (!biases_.empty() && i == 0) params.push_back(biases_[o]);
  return params;
}

Activations TiledLinear::forward(const Activations& x, int64_t rows) {
  check_numel(name_, "input", x.size(), static_cast<size_t>(rows * in_));
  x_ = x;
  rows_ = rows;
  Activations y(static_cast<size_t>(rows * out_));
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      const auto params = tile_params(o, i);
      pre(params, false);  // fetch this tile only
      const float* w = load(tile(o, i), w_scratch_);
      const float* b = params.size() > 1 ? load(*params[1], b_scratch_) : nullptr;
      cpu::linear_forward(x.data() + in_parts_[i], in_, w, b, rows, in_parts_[i + 1] - in_parts_[i],
                          out_parts_[o + 1] - out_parts_[o], y.data() + out_parts_[o], out_,
                          /*accumulate=*/i > 0);
      post(params, false);  // the engine may release it before the next tile
    }
  }
  return y;
}

Activations TiledLinear::backward(const Activations& dy) {
  check_numel(name_, "output gradient", dy.size(), static_cast<size_t>(rows_ * out_));
  Activations dx(static_cast<size_t>(rows_ * in_), 0.0f);
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      const auto params = tile_params(o, i);
      pre(params, true);
      const float* w = load(tile(o, i), w_scratch_);
      cpu::linear_backward(dy.data() + out_parts_[o], out_, x_.data() + in_parts_[i], in_, w, rows_,
                           in_parts_[i + 1] - in_parts_[i], out_parts_[o + 1] - out_parts_[o],
                           dx.data() + in_parts_[i], in_, /*accumulate_dx=*/true, grad(tile(o, i)),
                           params.size() > 1 ? grad(*params[1]) : nullptr);
      post(params, true);
    }
  }
  return dx;
}

namespace {

// Copies a rows x cols block between matrices with row strides src_ld / dst_ld.
void copy_block(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows,
                int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * dst_ld, src + r * src_ld, static_cast<size_t>(cols) * sizeof(float));
  }
}

}  // namespace

void TiledLinear::set_full(const float* weight, const float* bias) {
  std::vector<float> block;
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      Parameter& t = tile(o, i);
      block.resize(static_cast<size_t>(t.desc.numel()));
      copy_block(weight + out_parts_[o] * in_ + in_parts_[i], in_, block.data(), t.desc.shape[1],
                 t.desc.shape[0], t.desc.shape[1]);
      const TensorView v = engine_.data(t);
      convert(block.data(), DType::kF32, v.data, v.desc.dtype, block.size());
    }
    if (!biases_.empty() && bias != nullptr) {
      const TensorView v = engine_.data(*biases_[o]);
      convert(bias + out_parts_[o], DType::kF32, v.data, v.desc.dtype,
              static_cast<size_t>(v.numel()));
    }
  }
}

void TiledLinear::get_full(float* weight, float* bias) {
  std::vector<float> block;
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      Parameter& t = tile(o, i);
      block.resize(static_cast<size_t>(t.desc.numel()));
      const TensorView v = engine_.data(t);
      convert(v.data, v.desc.dtype, block.data(), DType::kF32, block.size());
      copy_block(block.data(), t.desc.shape[1], weight + out_parts_[o] * in_ + in_parts_[i], in_,
                 t.desc.shape[0], t.desc.shape[1]);
    }
    if (!biases_.empty() && bias != nullptr) {
      const TensorView v = engine_.data(*biases_[o]);
      convert(v.data, v.desc.dtype, bias + out_parts_[o], DType::kF32,
              static_cast<size_t>(v.numel()));
    }
  }
}

void TiledLinear::get_full_grad(float* weight_grad, float* bias_grad) {
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      Parameter& t = tile(o, i);
      copy_block(grad(t), t.desc.shape[1], weight_grad + out_parts_[o] * in_ + in_parts_[i], in_,
                 t.desc.shape[0], t.desc.shape[1]);
    }
    if (!biases_.empty() && bias_grad != nullptr) {
      std::memcpy(bias_grad + out_parts_[o], grad(*biases_[o]),
                  static_cast<size_t>(biases_[o]->desc.numel()) * sizeof(float));
    }
  }
}

}  // namespace strata::nn
