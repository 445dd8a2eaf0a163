// Embedding and RMSNorm modules (Hugging Face names: "<name>.weight").
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include "runtime/nn/module.h"

namespace strata::nn {

class Embedding : public Module {
 public:
  Embedding(Engine& engine, std::string name, int64_t vocab, int64_t dim,
            DType dtype = DType::kF32);
  // ids: [rows] -> [rows, dim]. Ids outside [0, vocab) raise kBadArgument.
  Activations forward(const std::vector<int32_t>& ids);
  // Adds dout [rows, dim] into the table gradient.
  void backward(const Activations& dout);
  Parameter& weight() { return *weight_; }

 private:
  int64_t vocab_, dim_;
  Parameter* weight_;
  std::vector<int32_t> ids_;
  std::vector<float> scratch_;
};

class RMSNorm : public Module {
 public:
  RMSNorm(Engine& engine, std::string name, int64_t dim, double eps, DType dtype = DType::kF32);
  Activations forward(const Activations& x, int64_t rows);
  Activations backward(const Activations& dy);
  Parameter& weight() { return *weight_; }

 private:
  int64_t dim_;
  double eps_;
  Parameter* weight_;
  Activations x_;
  std::vector<float> rstd_;
  int64_t rows_ = 0;
  std::vector<float> scratch_;
};

}  // namespace strata::nn
