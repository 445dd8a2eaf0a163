// Linear (y = x W^T + b, W stored [out, in] as in Hugging Face) and TiledLinear,
// its memory-centric tiled form: W split into out_splits x in_splits tiles, each
// an independent parameter with its own operator (hook window), partial
// products summed. Mathematically the same as Linear, so an operator too large
// for device memory needs only one tile gathered at a time.
// Activations are MatViews (a column block of a wider matrix is fine).
// A Linear may carry a LoRA adapter (runtime/nn/lora.h); TiledLinear does not.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <vector>

#include "runtime/nn/lora.h"
#include "runtime/nn/module.h"

namespace strata::nn {

// What Linear and TiledLinear share, so a layer can hold either.
class LinearBase : public Module {
 public:
  LinearBase(engine::Engine& engine, std::string name, int64_t in, int64_t out)
      : Module(engine, std::move(name)), in_(in), out_(out) {}
  // y [rows, out] = x [rows, in] W^T (+ b) (+ the adapter's term). `lora` is
  // the adapter's scratch, read only by a Linear that carries one.
  virtual void forward(const MatView& x, const MatView& y, Phase phase = Phase::kForward,
                       const LoraScratch& lora = {}) = 0;
  // dx [rows, in] = dy W (+= when accumulate_dx; dx may be empty: not wanted);
  // adds into the gradients of the weight, bias and adapter that train. x is
  // the forward's input.
  virtual void backward(const MatView& dy, const MatView& x, const MatView& dx, bool accumulate_dx,
                        const LoraScratch& lora = {}) = 0;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 protected:
  void check_rows(const MatView& a, int64_t a_cols, const MatView& b, int64_t b_cols) const;
  int64_t in_, out_;
};

// Tensor parallelism (Megatron's): how a Linear's weight is split across the
// tp group (Engine::tensor_group()). kColumn: this rank holds the output rows
// [t out/tp, (t+1) out/tp) of the weight and bias, and computes those output
// columns. kRow: it holds the input columns [t in/tp, (t+1) in/tp) of the
// weight and reads those input columns; its output is a partial sum the
// caller completes with Engine::tp_allreduce, and the bias (every rank holds
// all of it) is added by tp rank 0 only, so the sum carries it once — its
// gradient, from the complete dy, is the same on every rank. in_features()
// and out_features() are this rank's widths.
enum class TensorSplit : uint8_t { kNone, kColumn, kRow };
// A kColumn split into other blocks than the tp ranks': block `block` of
// `blocks`, shared by `copies` consecutive tp ranks (a kv head the query
// heads of several ranks use: Module::add_tp_shard). blocks 0: the ranks'.
struct TpBlock {
  int64_t blocks = 0, block = 0;
  int copies = 1;
};

// A Linear's weight and bias as views of larger checkpoint tensors rather
// than tensors of their own (gpt-oss's stacked experts: strided
// engine::ParameterSlice views, each expert's block transposed).
struct LinearSlices {
  engine::ParameterSlice weight, bias;
};

class Linear : public LinearBase {
 public:
  // When `lora` targets this projection (LoraSpec::targets_module(name)), it
  // also declares the adapter "<name>.lora_A.weight" [r, in] and
  // "<name>.lora_B.weight" [out, r], fp32, in the same operator as the weight
  // (a partitioning engine gathers them together). Freezing the base is the
  // caller's business (DecoderModel freezes it).
  // `in` and `out` are the whole tensor's; with a split the caller checks
  // that the tp size divides the split one. Adapters do not combine with a split.
  // `slices`: where the weight and bias lie in the checkpoint (null: tensors
  // "<name>.weight" and "<name>.bias" of their own); no split or adapter with them.
  Linear(engine::Engine& engine, std::string name, int64_t in, int64_t out, bool bias,
         DType dtype = DType::kF32, const LoraSpec* lora = nullptr, TensorSplit split = TensorSplit::kNone,
         TpBlock block = {}, const LinearSlices* slices = nullptr);
  void forward(const MatView& x, const MatView& y, Phase phase = Phase::kForward,
               const LoraScratch& lora = {}) override;
  void backward(const MatView& dy, const MatView& x, const MatView& dx, bool accumulate_dx,
                const LoraScratch& lora = {}) override;

  // A block shared by several tp ranks (TpBlock::copies > 1): backward
  // forms the weight and bias gradients in `scratch` (fp32, shared_scratch_numel()),
  // each rank at its block's place and zeros elsewhere, sums it over the tp
  // group — so each block gets the sum over the ranks sharing it — and adds
  // its own block into the gradients. dx as backward's. backward() refuses
  // such a projection.
  void backward_shared(const MatView& dy, const MatView& x, const MatView& dx, bool accumulate_dx,
                       const TensorView& scratch);
  int64_t shared_scratch_numel() const;
  bool shared() const { return block_.copies > 1; }

  // The weight's and bias's gradients from dy and x alone (the input
  // gradient already taken): a deferred backward's W (Engine::WeightGradSink),
  // in a backward window of its own.
  void weight_backward(const MatView& dy, const MatView& x);

  ParamId weight() const { return weight_; }
  ParamId bias() const { return bias_; }  // -1 without bias
  OpId op() const { return op_; }
  bool adapted() const { return lora_a_ >= 0; }
  // The seed of this projection's dropout mask in a forward whose
  // LoraScratch::seed is `forward_seed` (each projection draws its own).
  uint64_t mask_seed(uint64_t forward_seed) const { return forward_seed ^ name_key_; }
  ParamId lora_a() const { return lora_a_; }  // -1 without an adapter
  ParamId lora_b() const { return lora_b_; }

 private:
  // The adapter's scratch as [rows, r] matrices (checked against its shape).
  std::pair<MatView, MatView> scratch(const LoraScratch& lora, int64_t rows) const;
  // The dropout scratch as [rows, in] matrices; the mask seed of this projection.
  std::pair<MatView, MatView> dropout_scratch(const LoraScratch& lora, int64_t rows) const;

  ParamId weight_;
  ParamId bias_ = -1;
  bool bias_in_forward_ = true;  // false on tp ranks > 0 of a kRow split
  TpBlock block_;                 // a shared kColumn block (copies > 1)
  ParamId lora_a_ = -1, lora_b_ = -1;
  int64_t rank_ = 0;
  float scaling_ = 0;
  uint64_t name_key_ = 0;  // mixed into the dropout seed: each projection its own mask
  OpId op_;
};

class TiledLinear : public LinearBase {
 public:
  // Tile (o, i) is "<name>.weight.tile_<o>_<i>" of shape [out part o, in part i];
  // with bias, out part o has "<name>.bias.tile_<o>", read by tile (o, 0)'s
  // operator. Parts are as even as possible (the first ones one larger).
  // Requires 1 <= splits <= features. Each tile's slice names "<name>.weight" /
  // "<name>.bias", so weights load from and save to the untiled HF tensors.
  TiledLinear(engine::Engine& engine, std::string name, int64_t in, int64_t out,
              int64_t in_splits, int64_t out_splits, bool bias, DType dtype = DType::kF32);
  void forward(const MatView& x, const MatView& y, Phase phase = Phase::kForward,
               const LoraScratch& lora = {}) override;
  void backward(const MatView& dy, const MatView& x, const MatView& dx, bool accumulate_dx,
                const LoraScratch& lora = {}) override;

  int64_t in_splits() const { return static_cast<int64_t>(in_parts_.size()) - 1; }
  int64_t out_splits() const { return static_cast<int64_t>(out_parts_.size()) - 1; }

 private:
  struct Tile {
    ParamId weight;
    ParamId bias;  // -1 unless this is the first input tile of a biased out part
    OpId op;
  };
  const Tile& tile(int64_t o, int64_t i) const { return tiles_[o * in_splits() + i]; }

  std::vector<int64_t> in_parts_, out_parts_;  // boundaries, size splits + 1
  std::vector<Tile> tiles_;                    // row-major over (o, i)
};

// Boundaries of `n` split into `parts` near-equal pieces: {0, ..., n}.
std::vector<int64_t> split_boundaries(int64_t n, int64_t parts);

}  // namespace strata::nn
