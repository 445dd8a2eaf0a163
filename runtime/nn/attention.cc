// What every attention kind shares (the arena's sizes, the kinds' factory)
// and the Mlp module: projections through Linear children, SwiGLU through Ops.
#include "runtime/nn/attention.h"

#include "core/error.h"
#include "runtime/nn/gqa_attention.h"
#include "runtime/nn/mla_attention.h"

namespace strata::nn {

TensorView reshaped(const TensorView& t, Shape shape) {
  STRATA_CHECK(shape_numel(shape) == t.numel(), kBadArgument, "cannot view {} as {}",
               shape_string(t.desc.shape), shape_string(shape));
  TensorView v = t;
  v.desc.shape = std::move(shape);
  return v;
}

MatView as_matrix(const TensorView& t) {
  const int64_t rows = t.desc.shape.empty() ? 1 : t.desc.shape[0];
  const int64_t cols = rows == 0 ? 0 : t.numel() / rows;
  return MatView{t.data, t.desc.dtype, rows, cols, cols};
}

const LoraScratch& lora_scratch(const LoraScratch* lora) {
  static const LoraScratch kNone;
  return lora != nullptr ? *lora : kNone;
}

size_t arena_nbytes(const std::vector<ArenaTensor>& tensors) {
  size_t n = 0;
  for (const ArenaTensor& t : tensors) {
    n += (static_cast<size_t>(shape_numel(t.shape)) * dtype_nbytes(t.dtype) + 255) / 256 * 256;
  }
  return n;
}

AttentionArena attention_arena(const DecoderConfig& config, int tensor_parallel, int64_t batch, int64_t seq,
                               DType dtype) {
  switch (config.attention) {
    case AttentionKind::kGqa:
      return GqaAttention::arena(config, tensor_parallel, batch, seq, dtype);
    case AttentionKind::kMla:
      return MlaAttention::arena(config, tensor_parallel, batch, seq, dtype);
  }
  raise(ErrorCategory::kInternal, "attention kind {} has no arena", static_cast<int>(config.attention));
}

std::unique_ptr<SelfAttention> make_attention(engine::Engine& engine, std::string name, const DecoderConfig& config,
                                              int64_t layer, DType dtype, const LoraSpec* lora) {
  switch (config.attention) {
    case AttentionKind::kGqa:
      return std::make_unique<GqaAttention>(engine, std::move(name), config, layer, dtype, lora);
    case AttentionKind::kMla:
      return std::make_unique<MlaAttention>(engine, std::move(name), config, layer, dtype, lora);
  }
  raise(ErrorCategory::kInternal, "attention kind {} is not implemented", static_cast<int>(config.attention));
}

Mlp::Mlp(engine::Engine& engine, std::string name, const DecoderConfig& c, DType dtype,
         MlpTiling tiling, const LoraSpec* lora, int64_t intermediate)
    : Module(engine, std::move(name)), act_(c.hidden_act) {
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
  gate_proj_->forward(as_matrix(x), as_matrix(a.gate), phase, lora_scratch(a.lora));
  up_proj_->forward(as_matrix(x), as_matrix(a.up), phase, lora_scratch(a.lora));
  ops().swiglu_forward(ctx(), a.gate, a.up, a.act, act_);
  down_proj_->forward(as_matrix(a.act), as_matrix(y), phase, lora_scratch(a.lora));  // with tp, this rank's features' share
}

void Mlp::backward(const TensorView& dy, const TensorView& x, const MlpActs& a, const MlpGrads& g,
                   const TensorView& dx, bool accumulate_dx) {
  const bool tp = engine_.tensor_group().size > 1;
  STRATA_CHECK(!tp || !accumulate_dx, kInternal, "{}: with tensor parallelism dx is a partial sum, so it cannot accumulate",
               name_);
  down_proj_->backward(as_matrix(dy), as_matrix(a.act), as_matrix(g.dact), false, lora_scratch(a.lora));
  ops().swiglu_backward(ctx(), g.dact, a.gate, a.up, g.dgate, g.dup, act_);
  gate_proj_->backward(as_matrix(g.dgate), as_matrix(x), as_matrix(dx), accumulate_dx, lora_scratch(a.lora));
  up_proj_->backward(as_matrix(g.dup), as_matrix(x), as_matrix(dx), true, lora_scratch(a.lora));  // with tp, a partial sum
}

}  // namespace strata::nn
