// Linear (y = x W^T + b, W stored [out, in] as in Hugging Face) and TiledLinear,
// its memory-centric tiled form: W split into out_splits x in_splits tiles, each
// an independent parameter fetched through its own hooks, partial products
// summed. Mathematically the same as Linear, so an operator too large for
// device memory needs only one tile resident at a time.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include "runtime/nn/module.h"

namespace strata::nn {

// What Linear and TiledLinear share, so a layer can hold either.
class LinearBase : public Module {
 public:
  using Module::Module;
  // x: [rows, in] -> [rows, out]. Saves x for backward.
  virtual Activations forward(const Activations& x, int64_t rows) = 0;
  // dy: [rows, out] -> dx [rows, in]; adds into the weight (and bias) gradients.
  virtual Activations backward(const Activations& dy) = 0;
};

class Linear : public LinearBase {
 public:
  Linear(Engine& engine, std::string name, int64_t in, int64_t out, bool bias,
         DType dtype = DType::kF32);
  Activations forward(const Activations& x, int64_t rows) override;
  Activations backward(const Activations& dy) override;

  Parameter& weight() { return *weight_; }
  Parameter* bias() { return bias_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  int64_t in_, out_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
  Activations x_;
  int64_t rows_ = 0;
  std::vector<float> w_scratch_, b_scratch_;
};

class TiledLinear : public LinearBase {
 public:
  // Tile (o, i) is "<name>.weight.tile_<o>_<i>" of shape [out part o, in part i];
  // with bias, out part o has "<name>.bias.tile_<o>". Parts are as even as
  // possible (the first ones one larger). Requires 1 <= splits <= features.
  // Each tile's Parameter::slice names "<name>.weight" / "<name>.bias", so
  // weights load from and save to the untiled Hugging Face tensors.
  TiledLinear(Engine& engine, std::string name, int64_t in, int64_t out, int64_t in_splits,
              int64_t out_splits, bool bias, DType dtype = DType::kF32);
  Activations forward(const Activations& x, int64_t rows) override;
  Activations backward(const Activations& dy) override;

  // Copies a full [out, in] weight (and [out] bias, may be null) into the tiles,
  // and back. Values are converted to the storage dtype.
  void set_full(const float* weight, const float* bias);
  void get_full(float* weight, float* bias);
  // The full [out, in] fp32 gradient assembled from the tile gradients.
  void get_full_grad(float* weight_grad, float* bias_grad);

  int64_t in_splits() const { return static_cast<int64_t>(in_parts_.size()) - 1; }
  int64_t out_splits() const { return static_cast<int64_t>(out_parts_.size()) - 1; }

 private:
  Parameter& tile(int64_t o, int64_t i) { return *tiles_[o * in_splits() + i]; }
  std::vector<Parameter*> tile_params(int64_t o, int64_t i);

  int64_t in_, out_;
  std::vector<int64_t> in_parts_, out_parts_;  // boundaries, size splits + 1
  std::vector<Parameter*> tiles_;              // row-major over (o, i)
  std::vector<Parameter*> biases_;             // per out part, empty without bias
  Activations x_;
  int64_t rows_ = 0;
  std::vector<float> w_scratch_, b_scratch_;
};

// Boundaries of `n` split into `parts` near-equal pieces: {0, ..., n}.
std::vector<int64_t> split_boundaries(int64_t n, int64_t parts);

}  // namespace strata::nn
