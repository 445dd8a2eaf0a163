// Embedding and RMSNorm modules (Hugging Face names: "<name>.weight").
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include "runtime/nn/module.h"

namespace strata::nn {

// With tensor parallelism (Megatron's vocabulary-parallel embedding) each tp
// rank holds the table's rows [first_id(), first_id() + vocab / tp) (the
// caller checks that tp divides vocab): forward writes this rank's share of
// the lookup (zeros for the other ranks' ids), which the caller sums over tp,
// and backward adds into this rank's rows only.
class Embedding : public Module {
 public:
  // padding_idx: the row that gets no gradient from lookups (torch's
  // nn.Embedding padding_idx; the config's pad_token_id); -1: none.
  // scale: every looked-up row times it (Gemma's sqrt(hidden_size), rounded
  // to `dtype` here as transformers rounds it to the weight's dtype).
  Embedding(engine::Engine& engine, std::string name, int64_t vocab, int64_t dim,
            DType dtype = DType::kF32, int64_t padding_idx = -1, double scale = 1.0);
  // ids int32 [rows] (validated by the caller) -> out [rows, dim].
  void forward(const TensorView& ids, const TensorView& out, Phase phase = Phase::kForward);
  // Adds dout [rows, dim] into the table gradient.
  void backward(const TensorView& ids, const TensorView& dout);
  ParamId weight() const { return weight_; }
  OpId op() const { return op_; }
  int64_t vocab() const { return vocab_; }
  int64_t first_id() const { return first_id_; }  // this rank's first row (0 without tensor parallelism)
  bool split() const { return split_; }

 private:
  int64_t vocab_, dim_, padding_idx_, first_id_ = 0;
  float scale_ = 1.0f;
  bool split_ = false;
  ParamId weight_;
  OpId op_;
};

// y = x / rms(x) * (weight_offset + w): weight_offset 1 is Gemma's norm.
class RMSNorm : public Module {
 public:
  RMSNorm(engine::Engine& engine, std::string name, int64_t dim, double eps,
          DType dtype = DType::kF32, float weight_offset = 0.0f);
  // x, y [rows, dim]; rstd fp32 [rows] (saved for backward).
  void forward(const TensorView& x, const TensorView& y, const TensorView& rstd,
               Phase phase = Phase::kForward);
  // dx [rows, dim] = the input gradient (+= when accumulate_dx); adds the weight gradient.
  // tp_dw: for a norm each tensor-parallel rank applies to its own share of
  // the rows (qwen3's per-head q/k norms over a rank's heads), fp32 [dim]
  // scratch: this pass's weight gradient is formed there, summed over the tp
  // group (Engine::tp_allreduce), then added — the accumulating gradient
  // itself must not be summed, or earlier passes would count tp times.
  void backward(const TensorView& dy, const TensorView& x, const TensorView& rstd,
                const TensorView& dx, bool accumulate_dx, const TensorView& tp_dw = {});
  ParamId weight() const { return weight_; }

 private:
  int64_t dim_;
  double eps_;
  float weight_offset_;
  ParamId weight_;
  OpId op_;
};

}  // namespace strata::nn
