// The decoder layer's two blocks: self-attention -- an interface
// (SelfAttention) whose kind DecoderConfig::attention names, each kind saying
// what it keeps in the activation arena (AttentionArena), so the model lays
// it out and strata plan counts it without knowing the kind -- and the
// SwiGLU MLP (gate/up/down projections), as modules whose children carry the
// Hugging Face names ("<name>.q_proj.weight", ...). What a forward saves for
// its backward lives in the caller's activation arena and is passed in as the
// *Acts structs; backward scratch as *Grads.
// Ownership, thread-safety, errors: see module.h.
#pragma once

#include <memory>
#include <vector>

#include "runtime/nn/layers.h"
#include "runtime/nn/linear.h"
#include "runtime/nn/decoder_config.h"

namespace strata::nn {

// A view of the same memory with another shape (same numel).
TensorView reshaped(const TensorView& t, Shape shape);
// A [rows, ...] tensor as a rows x (everything else) matrix: q [rows, heads,
// head_dim] is the [rows, heads * head_dim] output of q_proj.
MatView as_matrix(const TensorView& t);

// One tensor a block keeps in the model's activation arena: the view it binds
// (its slot in the block's list), its dtype and shape.
struct ArenaTensor {
  size_t slot;
  DType dtype;
  Shape shape;
};
// The bytes `tensors` take in the arena, each on a 256-byte boundary (the
// model's layout; strata plan counts the same).
size_t arena_nbytes(const std::vector<ArenaTensor>& tensors);

// What an attention kind keeps in the activation arena for batch x seq rows:
// per layer `saved` (what its forward saves for backward), once `scratch`
// (backward scratch the layers share); slots index AttentionActs::saved and
// AttentionGrads::scratch, each kind naming its own. DecoderModel lays them
// out without knowing the kind, and strata plan sums them.
struct AttentionArena {
  std::vector<ArenaTensor> saved, scratch;
  size_t saved_slots = 0, scratch_slots = 0;
};
// The arena of `config.attention` on one of `tensor_parallel` ranks (its
// heads' share, tensor_parallel_share), activations in `dtype`.
AttentionArena attention_arena(const DecoderConfig& config, int tensor_parallel, int64_t batch, int64_t seq,
                               DType dtype);

// A layer's saved attention activations (views of the arena, by the kind's
// slots) and the model's one adapter scratch (shared by every layer, not
// saved; null without adapters).
struct AttentionActs {
  std::vector<TensorView> saved;
  const LoraScratch* lora = nullptr;
};
// The backward scratch, by the kind's slots.
struct AttentionGrads {
  std::vector<TensorView> scratch;
};
// The model's one adapter scratch an Acts points to; an empty one without adapters.
const LoraScratch& lora_scratch(const LoraScratch* lora);

class ContextAttention;  // context_attention.h

// Where each token is in its row: positions int32 [rows] (the rotary
// embedding's), and with packed documents the first position of each token's
// document and one past its last (int32 [rows] each, kernels/attention_mask.h);
// segment views without data: one document per row. With context parallelism
// (`context` set) the rows are this rank's two chunks of every sequence
// (context_attention.h), positions theirs in the whole sequence, the document
// arrays over the whole sequences (context_size times the rows), and the
// attention goes through `context`.
struct TokenPlaces {
  TensorView positions, segment_start, segment_end;
  ContextAttention* context = nullptr;
  int context_size = 1;
  bool packed() const { return segment_start.data != nullptr; }
  // A layer's mask (its window, its scale) over these places: with packed
  // documents it also keeps each token within its document (rows of `seq`
  // tokens this rank holds: the whole sequence is context_size times it).
  ops::AttentionMask mask(ops::AttentionMask layer, int64_t seq) const {
    if (packed()) {
      layer.segment_start = segment_start.as<int32_t>();
      layer.segment_end = segment_end.as<int32_t>();
      layer.seq = seq * context_size;
    }
    return layer;
  }
};

// A decoder layer's self-attention: one of the kinds DecoderConfig::attention
// names (gqa_attention.h), made by make_attention. Its children carry the
// Hugging Face names ("<name>.q_proj.weight", ...).
class SelfAttention : public Module {
 public:
  using Module::Module;
  // x, y [batch * seq, hidden]. With tensor parallelism y is this rank's
  // heads' partial sum, and backward's dx likewise: the caller sums them over
  // the tp group (Megatron's g and f; DecoderLayer). acts: the layer's
  // AttentionArena::saved views.
  virtual void forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
                       const AttentionActs& acts, const TensorView& y, Phase phase = Phase::kForward) = 0;
  // dx [rows, hidden] = input gradient (+= when accumulate_dx; not with tp).
  // Leaves acts as forward wrote them: a split backward's W reads the
  // projections' inputs there afterwards (pipeline::DeferredWeightGrads).
  virtual void backward(const TensorView& dy, const TensorView& x, const TokenPlaces& places, int64_t batch,
                        int64_t seq, const AttentionActs& acts, const AttentionGrads& grads, const TensorView& dx,
                        bool accumulate_dx) = 0;
};

// Layer `layer`'s self-attention of the kind `config.attention`; `lora`:
// adapters on the projections it targets.
std::unique_ptr<SelfAttention> make_attention(engine::Engine& engine, std::string name, const DecoderConfig& config,
                                              int64_t layer, DType dtype = DType::kF32,
                                              const LoraSpec* lora = nullptr);

// How the MLP projections are tiled (TiledLinear); 1 x 1 means plain Linear.
struct MlpTiling {
  int64_t in_splits = 1, out_splits = 1;
};

// Saved by Mlp::forward: gate, up and act(gate) * up, each [rows, intermediate]
// (act: config.hidden_act, silu or Gemma's gelu-tanh).
struct MlpActs {
  TensorView gate, up, act;
  const LoraScratch* lora = nullptr;  // as AttentionActs::lora
};
// Backward scratch, each [rows, intermediate].
struct MlpGrads {
  TensorView dact, dgate, dup;
};

class Mlp : public Module {
 public:
  // Adapters (`lora`) need untiled projections: a target with tiling is refused.
  // intermediate: the width (0: config.intermediate_size; qwen2_moe's shared
  // expert passes shared_expert_intermediate_size).
  Mlp(engine::Engine& engine, std::string name, const DecoderConfig& config,
      DType dtype = DType::kF32, MlpTiling tiling = {}, const LoraSpec* lora = nullptr,
      int64_t intermediate = 0);
  // As Attention's: with tensor parallelism y and dx are this rank's
  // features' partial sums, completed by the caller.
  void forward(const TensorView& x, const MlpActs& acts, const TensorView& y,
               Phase phase = Phase::kForward);
  void backward(const TensorView& dy, const TensorView& x, const MlpActs& acts,
                const MlpGrads& grads, const TensorView& dx, bool accumulate_dx);

 private:
  std::unique_ptr<LinearBase> gate_proj_, up_proj_, down_proj_;
  ops::GluActivation act_;  // silu (SwiGLU) or gelu-tanh (Gemma's GeGLU)
};

}  // namespace strata::nn
