// DecoderLayer, DecoderModel (the runner with its activation arena), and
// counter-based parameter initialisation.
#include "runtime/nn/decoder_model.h"

#include <cmath>
#include <algorithm>
#include <cstring>
#include <numbers>

#include "core/error.h"
#include "runtime/nn/context_support.h"
#include "runtime/nn/param_files.h"

namespace strata::nn {

DecoderLayer::DecoderLayer(engine::Engine& engine, std::string name, const DecoderConfig& c,
                           int64_t layer, DType dtype, MlpTiling mlp_tiling, const LoraSpec* lora,
                           bool skip_unrouted_experts, bool sequence_parallel)
    : Module(engine, std::move(name)), sp_(sequence_parallel) {
  STRATA_CHECK(!sp_ || engine.tensor_group().size > 1, kBadArgument, "sequence parallelism needs tensor parallelism (a tp group of 2 or more)");
  const auto norm = [&](const char* local) {
    return std::make_unique<RMSNorm>(engine, child_name(local), c.hidden_size, c.rms_norm_eps, dtype,
                                     c.norm_weight_offset);
  };
  input_layernorm_ = norm("input_layernorm");
  self_attn_ = make_attention(engine, child_name("self_attn"), c, layer, dtype, lora);
  add_child(*input_layernorm_);
  add_child(*self_attn_);
  if (c.sandwich_norms) {
    STRATA_CHECK(!c.moe(), kInternal, "model_type {}: sandwich norms around experts are not implemented",
                 c.model_type);
    attn_out_norm_ = norm("post_attention_layernorm");
    add_child(*attn_out_norm_);
  }
  post_attention_layernorm_ = norm(c.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm");
  add_child(*post_attention_layernorm_);
  if (c.layer_moe(layer)) {
    // With LoRA the experts, the shared experts and the router carry no
    // adapter and stay frozen (resolve_lora_targets leaves no MLP target on
    // a mixture of experts: PEFT would put those on the fused experts).
    STRATA_CHECK(mlp_tiling.in_splits == 1 && mlp_tiling.out_splits == 1, kBadArgument,
                 "model_type {}: MLP tiling is not implemented for the experts yet", c.model_type);
    moe_ = std::make_unique<MoeMlp>(engine, child_name(moe_names(c).block), c, dtype, skip_unrouted_experts);
    add_child(*moe_);
  } else {
    mlp_ = std::make_unique<Mlp>(engine, child_name("mlp"), c, dtype, mlp_tiling, lora);
    add_child(*mlp_);
  }
  if (c.sandwich_norms) {
    mlp_out_norm_ = norm("post_feedforward_layernorm");
    add_child(*mlp_out_norm_);
  }
}

namespace {
// Completes a tp rank's partial sum over the tp group: `out` is `partial`
// summed in place (an allreduce), or with sequence parallelism this rank's
// rows of the sum of every rank's `partial` (a reduce-scatter). No tp: nothing.
void sum_over_tp(engine::Engine& engine, bool sequence_parallel, const TensorView& partial, const TensorView& out) {
  if (sequence_parallel) {
    engine.tp_reduce_scatter(partial, out);
  } else if (engine.tensor_group().size > 1) {
    engine.tp_allreduce(out);
  }
}
}  // namespace

const TensorView& DecoderLayer::block_input(const TensorView& local, const TensorView& gathered) {
  if (!sp_) return local;
  engine_.tp_allgather(local, gathered);
  return gathered;
}

const TensorView& DecoderLayer::block_output(const DecoderActs& a, const TensorView& out) const {
  return sp_ ? a.partial : out;
}

void DecoderLayer::complete(const DecoderActs& a, const TensorView& out) { sum_over_tp(engine_, sp_, a.partial, out); }

void DecoderLayer::forward(const TensorView& x, const TokenPlaces& places, int64_t batch,
                           int64_t seq, const DecoderActs& a, const TensorView& y, Phase phase) {
  // h = x + attn(norm1(x)); y = h + mlp(norm2(h)). Sandwich norms (Gemma):
  // h = x + norm(attn(norm1(x))); y = h + norm(mlp(norm2(h))).
  input_layernorm_->forward(x, a.ln1, a.rstd1, phase);
  const TensorView& attn_y = attn_out_norm_ ? a.attn_out : a.h;
  self_attn_->forward(block_input(a.ln1, a.gathered), places, batch, seq, a.attn, block_output(a, attn_y), phase);
  complete(a, attn_y);
  if (attn_out_norm_) attn_out_norm_->forward(a.attn_out, a.h, a.rstd_attn_out, phase);
  ops().add(ctx(), x, a.h, a.h);
  post_attention_layernorm_->forward(a.h, a.ln2, a.rstd2, phase);
  if (moe_) {
    moe_->forward(a.ln2, a.moe, a.moe_aux, y, phase);
  } else {
    const TensorView& mlp_y = mlp_out_norm_ ? a.mlp_out : y;
    mlp_->forward(block_input(a.ln2, a.gathered), a.mlp, block_output(a, mlp_y), phase);
    complete(a, mlp_y);
    if (mlp_out_norm_) mlp_out_norm_->forward(a.mlp_out, y, a.rstd_mlp_out, phase);
  }
  ops().add(ctx(), a.h, y, y);
}

void DecoderLayer::backward(const TensorView& x, const TokenPlaces& places, int64_t batch,
                            int64_t seq, const DecoderActs& a, const DecoderGrads& g,
                            const TensorView& dres) {
  // The residual passes the gradient through, so each norm's input gradient
  // is ADDED into dres: dy -> dh = dy + d(mlp path) -> dx = dh + d(attn path).
  // With sequence parallelism a block's output gradient is gathered from
  // every rank's rows (the backward of its reduce-scatter), its input
  // gathered again, and its input gradient reduce-scattered to this rank's.
  // Sandwich norms: a block's output gradient is its norm's input gradient (g.dpost).
  const auto block_dy = [&]() -> const TensorView& { return block_input(attn_out_norm_ ? g.dpost : dres, g.dgathered); };
  const TensorView tp_dw = sp_ ? g.dnorm : TensorView{};
  if (moe_) {
    moe_->backward(dres, a.ln2, a.moe, g.moe, a.moe_aux, g.dln, false);
  } else {
    if (mlp_out_norm_) mlp_out_norm_->backward(dres, a.mlp_out, a.rstd_mlp_out, g.dpost, false, tp_dw);
    const TensorView& dy = block_dy();
    mlp_->backward(dy, block_input(a.ln2, a.gathered), a.mlp, g.mlp, block_output(a, g.dln), false);
    complete(a, g.dln);
  }
  post_attention_layernorm_->backward(g.dln, a.h, a.rstd2, dres, /*accumulate_dx=*/true, tp_dw);
  if (attn_out_norm_) attn_out_norm_->backward(dres, a.attn_out, a.rstd_attn_out, g.dpost, false, tp_dw);
  const TensorView& dy = block_dy();
  self_attn_->backward(dy, block_input(a.ln1, a.gathered), places, batch, seq, a.attn, g.attn, block_output(a, g.dln),
                       false);
  complete(a, g.dln);
  input_layernorm_->backward(g.dln, x, a.rstd1, dres, /*accumulate_dx=*/true, sp_ ? g.dnorm : TensorView{});
}

namespace {

// A module that only owns lm_head.weight (its kernel runs inside DecoderModel);
// with tensor parallelism this rank's vocabulary rows, as Embedding's.
class LmHead : public Module {
 public:
  LmHead(engine::Engine& engine, int64_t vocab, int64_t hidden, DType dtype)
      : Module(engine, "lm_head") {
    weight = engine.tensor_group().size > 1 ? add_tp_shard("weight", dtype, {vocab, hidden}, 0)
                                            : add_parameter("weight", dtype, {vocab, hidden});
  }
  ParamId weight;
};

// Lays views out in one allocation, each on a 256-byte boundary.
class ArenaLayout {
 public:
  void add(TensorView& view, DType dtype, Shape shape) {
    view.desc = TensorDesc{dtype, std::move(shape), Tier::kDevice};
    places_.push_back({&view, nbytes_});
    nbytes_ += (view.desc.nbytes() + 255) / 256 * 256;
  }
  size_t nbytes() const { return nbytes_; }
  void bind(void* base) const {
    for (const auto& [view, offset] : places_) view->data = static_cast<char*>(base) + offset;
  }

 private:
  std::vector<std::pair<TensorView*, size_t>> places_;
  size_t nbytes_ = 0;
};

}  // namespace

// Everything a step needs in accelerator memory, plus pinned host staging.
struct DecoderModel::Arena {
  Accelerator* accelerator = nullptr;
  // seq: the tokens per sequence this rank holds; whole_seq: the sequences'
  // (context parallelism: seq = whole_seq / cp, this rank's two chunks).
  int64_t batch = 0, seq = 0, whole_seq = 0;
  bool packed = false;            // the last forward's rows hold packed documents
  bool backward_pending = false;  // a training forward ran and its backward has not
  Tensor memory;
  // Bytes of `memory` holding every layer's saved activations (kept_activations).
  size_t kept_begin = 0, kept_end = 0;
  // The residual stream. Without cpu_checkpointing: res[0] = embeddings,
  // res[l + 1] = layer l's output, so res[l] is layer l's input (its checkpoint
  // when checkpointing). With cpu_checkpointing: two buffers used in turn,
  // layer l reading res[l % 2] and writing res[(l + 1) % 2].
  std::vector<TensorView> res;
  bool alternating = false;  // res is the two buffers of cpu_checkpointing
  // Saved activations: one set per layer, or (checkpointing) one set shared.
  std::vector<DecoderActs> acts;
  DecoderGrads grads;
  // The adapters' scratch, one set for every adapted projection of every
  // layer (each uses it only inside its own operator's window), and this
  // forward's dropout; every acts entry points to it. Empty without adapters.
  LoraScratch lora;
  TensorView dres, final_ln, rstd_f, lse_ce, stats, count, normalizer, ids, targets;
  // Sequence parallelism: the final norm's output on this rank's rows,
  // gathered into final_ln for the loss (empty otherwise).
  TensorView final_ln_local;
  // Tensor parallelism: the vocabulary-parallel loss's scratch (outside the
  // arena, as the fused loss's is): a chunk's logits [chunk, vocab / tp] and
  // its parts, fp32 [2 x chunk] and gathered [tp x 2 x chunk].
  Tensor vocab_memory;
  TensorView vp_logits, vp_parts, vp_gathered;
  // Mixture of experts: the load-balancing statistics (fp64 [2, E]), the loss
  // (fp64 [1]) and its gradient per probability (fp32 [E]); empty when dense.
  TensorView moe_stats, moe_aux, moe_aux_grad;
  // Expert parallelism: the exchange's scratch, shared by the layers (moe_mlp.h).
  TensorView moe_exchange, moe_expert_out;
  // Pinned host memory for each acts entry's expert offsets (E + 1 int32
  // each), then (expert parallelism) the permutation upload the layers share.
  void* host_moe = nullptr;
  // Each layer's routing, kept from its forward to its backward.
  std::vector<MoeRouting> moe_routing;
  TokenPlaces places;  // positions, and the documents' ranges when packed
  // Host side: ids, targets, positions (int32 [rows] each), segment starts
  // and ends (int32 [batch x whole_seq] each), then normalizer and stats (fp64).
  void* host = nullptr;
  std::unique_ptr<Event> uploaded;  // the last upload's copies have read `host`
  // cpu_checkpointing: pinned host memory, checkpoint l (the input of layer l,
  // for each recomputed layer) at l * checkpoint_stride; copied only in order
  // on the compute stream, never touched by the host.
  void* host_checkpoints = nullptr;
  size_t checkpoint_stride = 0, host_checkpoints_nbytes = 0;

  const TensorView& input(size_t l) const { return alternating ? res[l % 2] : res[l]; }
  const TensorView& output(size_t l) const { return input(l + 1); }
  // Layer l's activations, with its own routing state (a mixture of experts:
  // kept per layer even where the layers share one set of buffers).
  DecoderActs acts_of(size_t l) {
    DecoderActs d = acts.size() == 1 ? acts[0] : acts[l];
    if (!moe_routing.empty()) d.moe.routing = &moe_routing[l];
    return d;
  }
  void* host_checkpoint(size_t l) const {
    return static_cast<char*>(host_checkpoints) + l * checkpoint_stride;
  }

  int32_t* host_ints() const { return static_cast<int32_t*>(host); }
  double* host_doubles() const {
    return reinterpret_cast<double*>(static_cast<char*>(host) + host_ints_nbytes());
  }
  size_t host_ints_nbytes() const {
    return (static_cast<size_t>(3 * batch * seq + 2 * batch * whole_seq) * sizeof(int32_t) + 7) / 8 * 8;
  }
  // The owner drains the compute stream first (copies may still use host_checkpoints).
  ~Arena() {
    if (uploaded) uploaded->synchronize();
    if (host != nullptr) accelerator->deallocate_pinned(host);
    if (host_checkpoints != nullptr) accelerator->deallocate_pinned(host_checkpoints);
    if (host_moe != nullptr) accelerator->deallocate_pinned(host_moe);
  }
};

DecoderModel::DecoderModel(engine::Engine& engine, const DecoderConfig& config, DecoderModelOptions options)
    : Module(engine, "model"), config_(config), options_(options) {
  config_.validate();
  act_dtype_ = options_.activation_dtype.value_or(
      engine.accelerator().backend() == Backend::kCpu ? DType::kF32 : options_.dtype);
  STRATA_CHECK(is_float_storage(act_dtype_) && is_float_storage(options_.dtype), kBadArgument,
               "model: parameter and activation dtypes must be fp32, fp16 or bf16");
  STRATA_CHECK(options_.loss_chunk_rows >= 0, kBadArgument, "model: loss_chunk_rows must be >= 0");
  STRATA_CHECK(!options_.cpu_checkpointing || options_.checkpoint_activations, kBadArgument,
               "model: cpu_checkpointing moves activation checkpoints to host memory and needs "
               "checkpoint_activations");
  if (options_.lora.enabled()) {
    options_.lora.validate();
    resolve_lora_targets(options_.lora, config_);  // all-linear, and what this model has, as PEFT sees them
  }
  if (engine.tensor_group().size > 1) {
    tensor_parallel_share(config_, engine.tensor_group().size);  // refuses a model that does not split
    STRATA_CHECK(config_.final_logit_softcapping == 0, kBadArgument,
                 "model_type {}: final_logit_softcapping with tensor parallelism is not implemented yet (the "
                 "vocabulary-parallel loss has no soft cap); train it without tensor_parallel",
                 config_.model_type);
    STRATA_CHECK(!options_.lora.enabled(), kBadArgument,
                 "LoRA adapters are not implemented with tensor parallelism yet");
  }
  STRATA_CHECK(!options_.sequence_parallel || engine.tensor_group().size > 1, kBadArgument,
               "sequence_parallel needs tensor parallelism (tensor_parallel.autotp_size of 2 or more)");
  if (const int cp = engine.context_group().size; cp > 1) {
    // What context parallelism has been built and tested with (context_support.h); the rest by name.
    refuse_unsupported_with_context_parallel(
        fmt::format("context parallelism (size {})", cp),
        {{CpFeature::kLora, options_.lora.enabled(), "LoRA adapters"},
         {CpFeature::kExperts, config_.moe(), fmt::format("mixture-of-experts layers (model_type {})", config_.model_type)},
         {CpFeature::kLatentAttention, config_.attention != AttentionKind::kGqa,
          fmt::format("multi-head latent attention (model_type {})", config_.model_type)}});
    // A model split into parts runs the ring or Ulysses over its own layers,
    // its boundaries this rank's rows: a pipeline stage does (kPipeline);
    // layer-major's chunks are refused with cp where the order is chosen.
    // With tensor parallelism the ring or Ulysses runs over the cp group of
    // each tp rank, on that rank's heads and kv heads.
    check_context_parallel(config_.num_attention_heads, config_.num_key_value_heads, cp, options_.context_method,
                           engine.tensor_group().size);
    context_ = std::make_unique<ContextAttention>(engine, options_.context_method);
  }
  if (options_.loss_chunk_rows == 0) options_.loss_chunk_rows = default_loss_chunk_rows(config_, engine.tensor_group().size);
  DecoderModelOptions::Stage& part = options_.stage;
  if (part.layers < 0) part.layers = config_.num_hidden_layers - part.first_layer;
  STRATA_CHECK(part.first_layer >= 0 && part.layers >= 0 &&
                   part.first_layer + part.layers <= config_.num_hidden_layers,
               kBadArgument, "model: a stage of layers [{}, {}) of a model of {} layers (num_hidden_layers)",
               part.first_layer, part.first_layer + part.layers, config_.num_hidden_layers);
  // No layer: the embedding alone or the head alone (layer-major's own chunks for them).
  STRATA_CHECK(part.layers >= 1 || part.embedding != part.head, kBadArgument,
               "model: a stage without decoder layers holds the embedding or the head, one of them");
  const bool whole = part.embedding && part.head;
  STRATA_CHECK(whole || !(config_.moe() && config_.output_router_logits), kBadArgument,
               "model_type {}: the load-balancing loss (output_router_logits) over a model split into pipeline "
               "stages is not implemented (it needs every layer's routing at once)",
               config_.model_type);
  lookup_ = part.embedding;
  if (part.embedding || (part.head && config_.tie_word_embeddings)) {
    // Gemma scales the embeddings by sqrt(hidden_size) (rounded to the weights' dtype).
    embed_tokens_ = std::make_unique<Embedding>(
        engine, child_name("embed_tokens"), config_.vocab_size, config_.hidden_size, options_.dtype,
        config_.pad_token_id, config_.scale_embedding ? std::sqrt(static_cast<double>(config_.hidden_size)) : 1.0);
    add_child(*embed_tokens_);
  }
  for (int64_t l = part.first_layer; l < part.first_layer + part.layers; ++l) {
    layers_.push_back(std::make_unique<DecoderLayer>(
        engine, child_name("layers." + std::to_string(l)), config_, l, options_.dtype,
        options_.mlp_tiling, options_.lora.enabled() ? &options_.lora : nullptr, options_.skip_unrouted_experts,
        options_.sequence_parallel));
    add_child(*layers_.back());
  }
  if (part.head) {
    norm_ = std::make_unique<RMSNorm>(engine, child_name("norm"), config_.hidden_size, config_.rms_norm_eps,
                                      options_.dtype, config_.norm_weight_offset);
    add_child(*norm_);
    if (config_.tie_word_embeddings) {
      lm_head_param_ = embed_tokens_->weight();
    } else {
      auto head = std::make_unique<LmHead>(engine, config_.vocab_size, config_.hidden_size, options_.dtype);
      lm_head_param_ = head->weight;
      lm_head_ = std::move(head);
      add_child(*lm_head_);
    }
    lm_head_op_ = engine.declare_operator("lm_head", {lm_head_param_});
  }
  if (options_.lora.enabled()) {
    // LoRA trains the adapters only (PEFT's bias="none": biases stay frozen too).
    for (ParamId id : parameters()) {
      if (!is_lora_parameter(engine.param_info(id).name)) engine.freeze(id);
    }
  }
}

DecoderModel::~DecoderModel() {
  // The arenas must outlive the work enqueued on them (a step abandoned by an error).
  try {
    if (!arenas_.empty()) engine_.compute_stream().synchronize();
  } catch (...) {
    // The stream's error belongs to the step that failed; drained either way.
  }
}

size_t DecoderModel::arena_nbytes() const {
  size_t total = 0;
  for (const auto& a : arenas_) total += a ? a->memory.nbytes() : 0;
  return total;
}

size_t DecoderModel::context_buffer_nbytes() const { return context_ ? context_->buffer_nbytes() : 0; }

size_t DecoderModel::host_checkpoint_nbytes() const {
  size_t total = 0;
  for (const auto& a : arenas_) total += a ? a->host_checkpoints_nbytes : 0;
  return total;
}

std::span<const std::byte> DecoderModel::kept_activations(int slot) const {
  if (slot < 0 || static_cast<size_t>(slot) >= arenas_.size() || !arenas_[static_cast<size_t>(slot)]) return {};
  const Arena& a = *arenas_[static_cast<size_t>(slot)];
  return {static_cast<const std::byte*>(a.memory.data()) + a.kept_begin, a.kept_end - a.kept_begin};
}

ParamId DecoderModel::embedding_weight() const { return embed_tokens_ ? embed_tokens_->weight() : -1; }

void DecoderModel::select(int slot) {
  STRATA_CHECK(slot >= 0, kBadArgument, "model: micro-batch slot {} < 0", slot);
  if (static_cast<size_t>(slot) >= arenas_.size()) arenas_.resize(static_cast<size_t>(slot) + 1);
  slot_ = slot;
  arena_ = arenas_[static_cast<size_t>(slot)].get();
}

DecoderModel::Boundary DecoderModel::boundary(int slot, int64_t batch, int64_t seq) {
  select(slot);
  if (batch > 0) ensure_arena(batch, seq);
  STRATA_CHECK(arena_ != nullptr, kBadArgument, "model: micro-batch slot {} has no activations yet", slot);
  const Arena& a = *arena_;
  return {a.input(0), a.input(layers_.size()), a.dres, a.dres};
}

ContextLayout DecoderModel::context_layout(int64_t batch, int64_t seq) const {
  const engine::Engine::ContextGroup& group = engine_.context_group();
  return {group.size, group.rank, batch, seq};
}

void DecoderModel::ensure_arena(int64_t batch, int64_t whole_seq) {
  if (arena_ && arena_->batch == batch && arena_->whole_seq == whole_seq) return;
  // This rank's tokens of each sequence (all of them without context parallelism).
  const int64_t seq = context_layout(batch, whole_seq).local_seq();
  if (arena_) engine_.compute_stream().synchronize();  // the old arena may still be in use
  arenas_[static_cast<size_t>(slot_)].reset();
  arena_ = nullptr;
  auto a = std::make_unique<Arena>();
  a->accelerator = &engine_.accelerator();
  a->batch = batch;
  a->seq = seq;
  a->whole_seq = whole_seq;
  // This rank's share of the heads and MLP features (all of them without tensor parallelism).
  const DecoderConfig c = tensor_parallel_share(config_, engine_.tensor_group().size);
  const int64_t rows = batch * seq, hidden = c.hidden_size, inter = c.intermediate_size;
  // The residual stream's and the norms' rows: this rank's block with sequence parallelism.
  const bool sp = options_.sequence_parallel;
  const int64_t local = sp ? rows / engine_.tensor_group().size : rows;
  // What the attention kind keeps: per layer its saved activations, once its scratch.
  const AttentionArena attention = attention_arena(config_, engine_.tensor_group().size, batch, seq, act_dtype_);
  const int64_t experts = c.num_experts, top_k = c.num_experts_per_tok, moe_inter = c.moe_intermediate_size;
  const int64_t shared_inter = c.shared_expert_intermediate_size;  // qwen2_moe's shared expert (0: none)
  // The rows the experts of this rank run on: its own tokens' k choices, or
  // with expert parallelism up to every ep member's to the experts it holds.
  const int64_t ep = engine_.expert_group().size;
  const int64_t expert_rows = ep * rows * top_k;
  const DType t = act_dtype_;
  // The sigmoid router computes in fp32 (moe_mlp.h, MoeActs::x32).
  const DType router_t = c.sigmoid_router ? DType::kF32 : t;
  const bool router_x32 = c.sigmoid_router && t != DType::kF32;
  const auto layers = layers_.size();
  // Checkpointing keeps one layer's activations; the checkpoints are the
  // residual stream, which stays here unless it goes to host memory, where
  // two device buffers (a layer's input and output) remain.
  a->alternating = options_.cpu_checkpointing;
  a->res.resize(a->alternating ? 2 : layers + 1);
  // (A stage of the embedding or the head alone keeps no layer's activations.)
  a->acts.resize(layers == 0 ? 0 : options_.checkpoint_activations ? 1 : layers);
  ArenaLayout layout;
  for (TensorView& r : a->res) layout.add(r, t, {local, hidden});
  // Every layer's saved activations, in one range; with checkpointing one
  // set the layers share, so none is kept (kept_activations).
  const size_t kept_begin = layout.nbytes();
  // Which MLP each set of activations serves: this stage's layer i's (dense
  // or sparse), or with checkpointing (one set for every layer) both kinds the model has.
  const auto acts_need = [&](size_t i, bool sparse) {
    if (options_.checkpoint_activations) return sparse ? c.any_moe_layer() : c.any_dense_layer();
    return c.layer_moe(options_.stage.first_layer + static_cast<int64_t>(i)) == sparse;
  };
  for (size_t i = 0; i < a->acts.size(); ++i) {
    DecoderActs& d = a->acts[i];
    layout.add(d.ln1, t, {local, hidden});
    layout.add(d.rstd1, DType::kF32, {local});
    d.attn.saved.resize(attention.saved_slots);
    for (const ArenaTensor& x : attention.saved) layout.add(d.attn.saved[x.slot], x.dtype, x.shape);
    layout.add(d.h, t, {local, hidden});
    layout.add(d.ln2, t, {local, hidden});
    layout.add(d.rstd2, DType::kF32, {local});
    if (c.sandwich_norms) {
      layout.add(d.attn_out, t, {local, hidden});
      layout.add(d.rstd_attn_out, DType::kF32, {local});
      layout.add(d.mlp_out, t, {local, hidden});
      layout.add(d.rstd_mlp_out, DType::kF32, {local});
    }
    if (acts_need(i, true)) {
      MoeActs& m = d.moe;
      layout.add(m.logits, router_t, {rows, experts});
      if (router_x32) layout.add(m.x32, DType::kF32, {rows, hidden});
      layout.add(m.probs, DType::kF32, {rows, experts});
      layout.add(m.indices, DType::kI32, {rows, top_k});
      layout.add(m.weights, DType::kF32, {rows, top_k});
      layout.add(m.offsets, DType::kI32, {experts + 1});
      layout.add(m.slots, DType::kI32, {rows, top_k});
      layout.add(m.tokens, DType::kI32, {rows * top_k});
      layout.add(m.xp, t, {rows * top_k, hidden});
      layout.add(m.gate, t, {expert_rows, moe_inter});
      layout.add(m.up, t, {expert_rows, moe_inter});
      layout.add(m.act, t, {expert_rows, moe_inter});
      layout.add(m.yp, t, {rows * top_k, hidden});
      if (ep > 1) {
        layout.add(m.xr, t, {expert_rows, hidden});
        layout.add(m.perm, DType::kI32, {expert_rows});
        layout.add(m.inverse, DType::kI32, {expert_rows});
      }
      if (c.shared_expert()) {
        layout.add(m.shared.gate, t, {rows, shared_inter});
        layout.add(m.shared.up, t, {rows, shared_inter});
        layout.add(m.shared.act, t, {rows, shared_inter});
        layout.add(m.shared_out, t, {rows, hidden});
        layout.add(m.shared_logit, t, {rows, 1});
      }
    }
    if (acts_need(i, false)) {
      layout.add(d.mlp.gate, t, {rows, inter});
      layout.add(d.mlp.up, t, {rows, inter});
      layout.add(d.mlp.act, t, {rows, inter});
    }
  }
  if (!options_.checkpoint_activations) {
    a->kept_begin = kept_begin;
    a->kept_end = layout.nbytes();
  }
  if (options_.lora.enabled() && layers > 0) {
    layout.add(a->lora.h, t, {rows, options_.lora.rank});
    layout.add(a->lora.dh, t, {rows, options_.lora.rank});
    if (options_.lora.dropout > 0) {
      const int64_t in = lora_widest_input(c, options_.lora);
      layout.add(a->lora.xd, t, {rows * in});
      layout.add(a->lora.dxd, t, {rows * in});
    }
  }
  DecoderGrads& g = a->grads;
  layout.add(g.dln, t, {local, hidden});
  if (c.sandwich_norms) layout.add(g.dpost, t, {local, hidden});
  // The layers' backward scratch (none in a stage of the embedding or the head alone).
  const bool layer_scratch = layers > 0;
  if (layer_scratch) {
    g.attn.scratch.resize(attention.scratch_slots);
    for (const ArenaTensor& x : attention.scratch) layout.add(g.attn.scratch[x.slot], x.dtype, x.shape);
  }
  if (c.moe() && layer_scratch) {
    layout.add(g.moe.dyp, t, {rows * top_k, hidden});
    layout.add(g.moe.dxp, t, {rows * top_k, hidden});
    layout.add(g.moe.dact, t, {expert_rows, moe_inter});
    layout.add(g.moe.dgate, t, {expert_rows, moe_inter});
    layout.add(g.moe.dup, t, {expert_rows, moe_inter});
    if (ep > 1) {
      layout.add(g.moe.dxr, t, {expert_rows, hidden});
      layout.add(a->moe_exchange, t, {expert_rows, hidden});
      layout.add(a->moe_expert_out, t, {expert_rows, hidden});
    }
    layout.add(g.moe.dweights, DType::kF32, {rows, top_k});
    layout.add(g.moe.dlogits, router_t, {rows, experts});
    if (router_x32) {
      layout.add(g.moe.dx32, DType::kF32, {rows, hidden});
      layout.add(g.moe.dx16, t, {rows, hidden});
    }
    layout.add(a->moe_stats, DType::kF64, {2, experts});
    layout.add(a->moe_aux, DType::kF64, {1});
    layout.add(a->moe_aux_grad, DType::kF32, {experts});
    if (c.shared_expert()) {
      layout.add(g.moe.shared.dact, t, {rows, shared_inter});
      layout.add(g.moe.shared.dgate, t, {rows, shared_inter});
      layout.add(g.moe.shared.dup, t, {rows, shared_inter});
      layout.add(g.moe.dshared_out, t, {rows, hidden});
      layout.add(g.moe.dshared_logit, t, {rows, 1});
    }
  }
  if (c.any_dense_layer() && layer_scratch) {
    layout.add(g.mlp.dact, t, {rows, inter});
    layout.add(g.mlp.dgate, t, {rows, inter});
    layout.add(g.mlp.dup, t, {rows, inter});
  }
  layout.add(a->dres, t, {local, hidden});
  layout.add(a->final_ln, t, {rows, hidden});
  layout.add(a->rstd_f, DType::kF32, {local});
  if (sp) {
    if (layers > 0) {  // one set for every layer (bound below)
      layout.add(a->acts[0].gathered, t, {rows, hidden});
      layout.add(a->acts[0].partial, t, {rows, hidden});
    }
    layout.add(g.dgathered, t, {rows, hidden});
    layout.add(g.dnorm, DType::kF32, {hidden});
    layout.add(a->final_ln_local, t, {local, hidden});
  }
  layout.add(a->lse_ce, DType::kF32, {rows});
  layout.add(a->stats, DType::kF64, {2});
  layout.add(a->count, DType::kF64, {1});
  layout.add(a->normalizer, DType::kF64, {1});
  layout.add(a->ids, DType::kI32, {rows});
  layout.add(a->targets, DType::kI32, {rows});
  layout.add(a->places.positions, DType::kI32, {rows});
  // The documents over the whole sequences (context parallelism: the block
  // attention evaluates them at global positions).
  layout.add(a->places.segment_start, DType::kI32, {batch * whole_seq});
  layout.add(a->places.segment_end, DType::kI32, {batch * whole_seq});
  a->memory = engine_.accelerator().allocate_tensor(
      DType::kF32, {static_cast<int64_t>(layout.nbytes() / sizeof(float))});
  layout.bind(a->memory.data());
  for (DecoderActs& d : a->acts) {
    d.gathered = a->acts[0].gathered;
    d.partial = a->acts[0].partial;
  }
  for (DecoderActs& d : a->acts) d.attn.lora = d.mlp.lora = &a->lora;
  if (c.moe() && layers > 0) {
    const auto per_acts = static_cast<size_t>(experts + 1);
    const size_t perm = ep > 1 ? 2 * static_cast<size_t>(expert_rows) : 0;
    a->host_moe = engine_.accelerator().allocate_pinned((a->acts.size() * per_acts + perm) * sizeof(int32_t));
    a->moe_routing.resize(layers);
    for (size_t i = 0; i < a->acts.size(); ++i) {
      DecoderActs& d = a->acts[i];
      d.moe.host_offsets = static_cast<int32_t*>(a->host_moe) + i * per_acts;
      if (ep > 1) {
        d.moe.host_perm = static_cast<int32_t*>(a->host_moe) + a->acts.size() * per_acts;
        d.moe.exchange = a->moe_exchange;
        d.moe.expert_out = a->moe_expert_out;
      }
      // The statistics only when the loss has the term; its gradient always
      // a view (zeros without the term would cost a pass: left empty instead).
      if (c.output_router_logits) d.moe_aux = MoeAux{a->moe_stats, a->moe_aux_grad};
    }
  }
  if (options_.stage.head && engine_.tensor_group().size > 1) {
    const int tp = engine_.tensor_group().size;
    const int64_t chunk = std::min(options_.loss_chunk_rows, rows), shard = config_.vocab_size / tp;
    ArenaLayout vocab;
    vocab.add(a->vp_logits, t, {chunk, shard});
    vocab.add(a->vp_parts, DType::kF32, {2 * chunk});
    vocab.add(a->vp_gathered, DType::kF32, {tp * 2 * chunk});
    a->vocab_memory = engine_.accelerator().allocate_tensor(
        DType::kF32, {static_cast<int64_t>(vocab.nbytes() / sizeof(float))});
    vocab.bind(a->vocab_memory.data());
  }
  a->host = engine_.accelerator().allocate_pinned(a->host_ints_nbytes() + 4 * sizeof(double));
  a->uploaded = engine_.accelerator().create_event();
  if (options_.cpu_checkpointing && layers > 1) {
    // Even on the cpu accelerator this is a separate allocation and a real
    // copy, so both backends run the same code and the arena shrinks alike.
    a->checkpoint_stride = (a->res[0].nbytes() + 255) / 256 * 256;
    a->host_checkpoints_nbytes = (layers - 1) * a->checkpoint_stride;
    a->host_checkpoints = engine_.accelerator().allocate_pinned(a->host_checkpoints_nbytes);
  }
  arena_ = a.get();
  arenas_[static_cast<size_t>(slot_)] = std::move(a);
}

void DecoderModel::upload(std::span<const int32_t> ids, std::span<const int32_t> targets,
                        std::span<const int32_t> positions, int64_t batch, int64_t seq, double normalizer) {
  Arena& a = *arena_;
  a.uploaded->synchronize();  // the previous step's copies have read the staging memory
  // This rank's rows (context parallelism: its chunks of each sequence) and every row's documents.
  const ContextLayout place = context_layout(batch, seq);
  const auto rows = static_cast<size_t>(place.local_rows()), whole = static_cast<size_t>(batch * seq);
  int32_t* h = a.host_ints();
  int32_t* pos = h + 2 * rows;
  int32_t* start = h + 3 * rows;
  int32_t* end = start + whole;
  if (place.cp == 1) {
    std::memcpy(h, ids.data(), rows * sizeof(int32_t));
    std::memcpy(h + rows, targets.data(), rows * sizeof(int32_t));
  } else {
    for (size_t r = 0; r < rows; ++r) {
      const auto from = static_cast<size_t>(place.whole_row(static_cast<int64_t>(r)));
      h[r] = ids[from];
      h[rows + r] = targets[from];
    }
  }
  for (size_t r = 0; r < rows; ++r) {
    const auto from = static_cast<size_t>(place.whole_row(static_cast<int64_t>(r)));
    pos[r] = positions.empty() ? static_cast<int32_t>(from % static_cast<size_t>(seq)) : positions[from];
  }
  if (!positions.empty()) {
    // A document starts where its position is 0 and ends where the next one starts.
    for (size_t r = 0; r < whole; ++r) start[r] = static_cast<int32_t>(r % static_cast<size_t>(seq)) - positions[r];
    for (size_t r = whole; r-- > 0;) {
      const bool last_in_row = (r + 1) % static_cast<size_t>(seq) == 0;
      end[r] = last_in_row ? static_cast<int32_t>(seq) : positions[r + 1] == 0 ? start[r + 1] : end[r + 1];
    }
  }
  a.host_doubles()[0] = normalizer;
  Accelerator& acc = engine_.accelerator();
  Stream& s = engine_.compute_stream();
  acc.copy_async(a.ids.data, h, rows * sizeof(int32_t), CopyKind::kHostToDevice, s);
  acc.copy_async(a.targets.data, h + rows, rows * sizeof(int32_t), CopyKind::kHostToDevice, s);
  acc.copy_async(a.places.positions.data, pos, rows * sizeof(int32_t), CopyKind::kHostToDevice, s);
  if (!positions.empty()) {
    acc.copy_async(a.places.segment_start.data, start, whole * sizeof(int32_t), CopyKind::kHostToDevice, s);
    acc.copy_async(a.places.segment_end.data, end, whole * sizeof(int32_t), CopyKind::kHostToDevice, s);
  }
  acc.copy_async(a.normalizer.data, a.host_doubles(), sizeof(double), CopyKind::kHostToDevice, s);
  s.record(*a.uploaded);
}

void DecoderModel::forward(std::span<const int32_t> ids, std::span<const int32_t> targets,
                         int64_t batch, int64_t seq, const ForwardOptions& options) {
  STRATA_CHECK(batch > 0 && seq > 0 && seq <= config_.max_position_embeddings, kBadArgument,
               "model: batch {} x seq {} invalid (max_position_embeddings {})", batch, seq,
               config_.max_position_embeddings);
  const auto rows = static_cast<size_t>(batch * seq);
  STRATA_CHECK(ids.size() == rows && targets.size() == rows, kBadArgument,
               "model: ids has {} and targets {} elements, expected batch {} x seq {} = {}",
               ids.size(), targets.size(), batch, seq, rows);
  // Validated here because the device does not range-check (ops.h).
  const int64_t vocab = config_.vocab_size;
  int64_t counted = 0;
  for (size_t r = 0; r < rows; ++r) {
    STRATA_CHECK(ids[r] >= 0 && ids[r] < vocab, kBadArgument,
                 "model: token id {} at position {} is outside the vocabulary [0, {})", ids[r], r,
                 vocab);
    STRATA_CHECK(targets[r] == ops::kIgnoreIndex || (targets[r] >= 0 && targets[r] < vocab),
                 kBadArgument, "model: target {} at position {} is outside [0, {}) and not {}",
                 targets[r], r, vocab, ops::kIgnoreIndex);
    counted += targets[r] != ops::kIgnoreIndex;
  }
  STRATA_CHECK(!options.backward || options.normalizer > 0 || counted > 0, kBadArgument,
               "model: every target is ignored ({}) and no normalizer is given", ops::kIgnoreIndex);
  STRATA_CHECK(options.normalizer >= 0, kBadArgument, "model: normalizer {} < 0",
               options.normalizer);
  if (!options.positions.empty()) {
    STRATA_CHECK(options.positions.size() == rows, kBadArgument,
                 "model: positions has {} elements, expected batch {} x seq {} = {}", options.positions.size(),
                 batch, seq, rows);
    for (size_t r = 0; r < rows; ++r) {
      const int32_t p = options.positions[r];
      const bool row_start = r % static_cast<size_t>(seq) == 0;
      STRATA_CHECK(p == 0 || (!row_start && p == options.positions[r - 1] + 1), kBadArgument,
                   "model: packed position {} at {} neither starts a document (0) nor follows the one before",
                   p, r);
    }
  }
  const int cp = engine_.context_group().size;
  STRATA_CHECK(cp == 1 || seq % (2 * cp) == 0, kBadArgument,
               "context parallelism cuts each sequence into 2 x {} = {} chunks (two per rank), but the sequence "
               "length {} does not divide by {}",
               cp, 2 * cp, seq, 2 * cp);
  // Sequence parallelism splits this rank's rows (with context parallelism
  // its two chunks of every sequence) over the tp ranks.
  STRATA_CHECK(!options_.sequence_parallel || static_cast<int64_t>(rows) / cp % engine_.tensor_group().size == 0,
               kBadArgument,
               "sequence parallelism splits the micro-batch's {} x {} = {} tokens{} over the {} tensor-parallel ranks: "
               "they do not divide",
               batch, seq, rows,
               cp > 1 ? fmt::format(" (this cp rank's {} of them, context parallelism {})", rows / cp, cp) : "",
               engine_.tensor_group().size);
  select(options.slot);
  ensure_arena(batch, seq);
  Arena& a = *arena_;
  a.packed = !options.positions.empty();
  Accelerator& acc = engine_.accelerator();
  Stream& s = engine_.compute_stream();
  // With context parallelism each rank has a share of the micro-batch's
  // targets: the normaliser is the whole micro-batch's count, as one rank's.
  const double normalizer = cp > 1 && options.normalizer == 0 ? static_cast<double>(counted) : options.normalizer;
  upload(ids, targets, options.positions, batch, seq, normalizer);
  const TokenPlaces places = this->places();
  // This forward's LoRA dropout (a recompute in backward reads the same).
  a.lora.dropout = options.backward ? static_cast<float>(options_.lora.dropout) : 0.0f;
  // With context parallelism each cp rank holds other tokens in the same
  // local rows: its own masks, not its neighbours' pattern again.
  const engine::Engine::ContextGroup& cp_group = engine_.context_group();
  a.lora.seed = cp_group.size > 1 ? options.dropout_seed ^ (static_cast<uint64_t>(cp_group.rank + 1) * 0xd6e8feb86659fd93ull)
                                  : options.dropout_seed;
  acc.memset_async(a.stats.data, 0, a.stats.nbytes(), s);
  const bool aux_loss = config_.moe() && config_.output_router_logits;
  if (aux_loss) acc.memset_async(a.moe_stats.data, 0, a.moe_stats.nbytes(), s);

  if (!lookup_) {
    // A later pipeline stage: the input is the previous stage's output, received into input(0).
  } else if (embed_tokens_->split()) {
    // This rank's vocabulary rows' share of every row's embedding, summed over tp.
    const TensorView& partial = options_.sequence_parallel ? a.acts[0].partial : a.input(0);
    embed_tokens_->forward(a.ids, partial);
    sum_over_tp(engine_, options_.sequence_parallel, partial, a.input(0));
  } else {
    embed_tokens_->forward(a.ids, a.input(0));
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (a.host_checkpoints != nullptr && recomputed(l) && options.backward) {
      // Out before layer l + 1 overwrites the buffer (same stream: in order).
      acc.copy_async(a.host_checkpoint(l), a.input(l).data, a.input(l).nbytes(),
                     CopyKind::kDeviceToHost, s);
    }
    layers_[l]->forward(a.input(l), places, batch, a.seq, a.acts_of(l), a.output(l));
  }
  if (!options_.stage.head) {
    // The output goes on to the next pipeline stage; its gradient comes back before backward().
    a.backward_pending = options.backward;
    return;
  }
  const TensorView& top = a.input(layers_.size());  // the last layer's output (no layer: the input)
  if (options_.sequence_parallel) {
    norm_->forward(top, a.final_ln_local, a.rstd_f);
    engine_.tp_allgather(a.final_ln_local, a.final_ln);  // the loss over every row, on every tp rank
  } else {
    norm_->forward(top, a.final_ln, a.rstd_f);
  }
  if (aux_loss) {
    // transformers' load_balancing_loss_func over every layer's rows; the
    // gradient of grad_scale * coef * aux per router probability.
    ops().moe_aux_loss(ctx(), a.moe_stats, static_cast<double>(batch * seq) * static_cast<double>(layers_.size()),
                       options.grad_scale * config_.router_aux_loss_coef, a.moe_aux, a.moe_aux_grad);
  }

  const bool vocab_parallel = engine_.tensor_group().size > 1;
  if (!options.backward) {
    run(lm_head_op_, Phase::kForward, [&] {
      if (vocab_parallel) {
        vocab_parallel_loss(TensorView{}, 0, TensorView{});
      } else {
        ops().cross_entropy(ctx(), a.final_ln, param(lm_head_param_), a.targets, options_.loss_chunk_rows, a.lse_ce,
                            a.stats, nullptr, static_cast<float>(config_.final_logit_softcapping));
      }
    });
    a.backward_pending = false;
    return;
  }
  TensorView normalizer_view = a.normalizer;
  if (normalizer == 0) {
    acc.memset_async(a.count.data, 0, a.count.nbytes(), s);
    ops().count_targets(ctx(), a.targets, a.count);
    normalizer_view = a.count;
  }
  // The loss's backward, fused: lm_head's backward window, at the end of forward.
  // d loss / d final_ln for every row: grads.dln, or with sequence
  // parallelism grads.dgathered (each rank's share is reduce-scattered below).
  const TensorView dh = options_.sequence_parallel ? a.grads.dgathered : a.grads.dln;
  run(lm_head_op_, Phase::kBackward, [&] {
    if (vocab_parallel) {
      vocab_parallel_loss(normalizer_view, options.grad_scale, dh);
    } else {
      const ops::Ops::CrossEntropyGrad grad{normalizer_view, options.grad_scale, dh, this->grad(lm_head_param_)};
      ops().cross_entropy(ctx(), a.final_ln, param(lm_head_param_), a.targets, options_.loss_chunk_rows, a.lse_ce,
                          a.stats, &grad, static_cast<float>(config_.final_logit_softcapping));
    }
  });
  // Each rank's vocabulary rows gave a partial dh: summed over tp (into
  // grads.dln: this rank's rows with sequence parallelism).
  if (vocab_parallel) sum_over_tp(engine_, options_.sequence_parallel, dh, a.grads.dln);
  a.backward_pending = true;
}

void DecoderModel::vocab_parallel_loss(const TensorView& normalizer, double grad_scale, const TensorView& dh) {
  // Megatron's vocabulary-parallel cross-entropy, chunk by chunk: this rank's
  // logits [n, V / tp], each row's log-sum-exp and target logit over its
  // columns, gathered from every rank (2 n floats each), the whole
  // vocabulary's loss; in training the logits' gradient gives this rank's
  // partial dh and its shard's lm_head gradient.
  Arena& a = *arena_;
  const bool training = dh.data != nullptr;
  const TensorView w = param(lm_head_param_);
  const TensorView dw = training ? grad(lm_head_param_) : TensorView{};
  const int tp = engine_.tensor_group().size;
  const int64_t rows = a.final_ln.desc.shape[0], hidden = config_.hidden_size, shard = w.desc.shape[0];
  const int64_t chunk = a.vp_logits.desc.shape[0];
  const int64_t first_id = engine_.tensor_group().rank * shard;  // this rank's first vocabulary row
  const ops::Ops::VocabParallelGrad grad{normalizer, grad_scale};
  const auto rows_of = [](const TensorView& t, int64_t first, Shape shape) {
    TensorView v = t;
    v.data = static_cast<char*>(t.data) + static_cast<size_t>(first) * (t.nbytes() / static_cast<size_t>(t.desc.shape[0]));
    v.desc.shape = std::move(shape);
    return v;
  };
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = std::min(chunk, rows - r0);
    const TensorView h = rows_of(a.final_ln, r0, {n, hidden});
    const TensorView targets = rows_of(a.targets, r0, {n});
    const TensorView logits = rows_of(a.vp_logits, 0, {n, shard});
    const TensorView parts = rows_of(a.vp_parts, 0, {2, n});
    const TensorView gathered = rows_of(a.vp_gathered, 0, {tp, 2, n});
    ops().linear_forward(ctx(), MatView::of(h), w, TensorView{}, MatView::of(logits), false);
    ops().vocab_parallel_parts(ctx(), logits, targets, first_id, parts);
    engine_.tp_allgather(parts, gathered);
    ops().vocab_parallel_loss(ctx(), logits, gathered, targets, first_id, config_.vocab_size,
                              rows_of(a.lse_ce, r0, {n}), a.stats, training ? &grad : nullptr);
    if (training) {
      ops().linear_backward(ctx(), MatView::of(logits), MatView::of(h), w, MatView::of(rows_of(dh, r0, {n, hidden})),
                            false, dw, TensorView{});
    }
  }
}

void DecoderModel::backward(int slot) {
  select(slot);
  STRATA_CHECK(arena_ != nullptr && arena_->backward_pending, kBadArgument,
               "model: backward() needs a forward() with ForwardOptions::backward (and only one "
               "backward per forward)");
  Arena& a = *arena_;
  a.backward_pending = false;
  Stream& s = engine_.compute_stream();
  const TokenPlaces places = this->places();
  // grads.dln holds d loss / d final_ln (with tensor parallelism summed
  // over tp; with sequence parallelism this rank's rows).
  // Without the head (a pipeline stage), dres already holds the output's
  // gradient, received from the next stage.
  const bool sp = options_.sequence_parallel;
  if (options_.stage.head) {
    norm_->backward(a.grads.dln, a.input(layers_.size()), a.rstd_f, a.dres, /*accumulate_dx=*/false,
                    sp ? a.grads.dnorm : TensorView{});
  }
  for (size_t l = layers_.size(); l-- > 0;) {
    if (recomputed(l)) {
      if (a.host_checkpoints != nullptr) {
        engine_.accelerator().copy_async(a.input(l).data, a.host_checkpoint(l),
                                         a.input(l).nbytes(), CopyKind::kHostToDevice, s);
      }
      // Layer l's output lands where forward put it: layer l + 1's input,
      // whose backward is done (and the recompute reproduces it anyway).
      layers_[l]->forward(a.input(l), places, a.batch, a.seq, a.acts_of(l), a.output(l),
                          Phase::kRecompute);
    }
    layers_[l]->backward(a.input(l), places, a.batch, a.seq, a.acts_of(l), a.grads, a.dres);
  }
  if (!lookup_) {
    // dres is the input's gradient: the previous stage's to receive.
  } else if (sp) {
    // Every row's gradient, of which each tp rank adds its vocabulary rows'.
    engine_.tp_allgather(a.dres, a.grads.dgathered);
    embed_tokens_->backward(a.ids, a.grads.dgathered);
  } else {
    embed_tokens_->backward(a.ids, a.dres);
  }
}

TokenPlaces DecoderModel::places() const {
  TokenPlaces p = arena_->places;
  if (!arena_->packed) p.segment_start = p.segment_end = TensorView{};
  if (context_) {
    p.context = context_.get();
    p.context_size = context_->size();
  }
  return p;
}

void DecoderModel::loss_stats_async(int slot, double* host) {
  select(slot);
  STRATA_CHECK(options_.stage.head, kBadArgument, "model: a pipeline stage without the head has no loss");
  STRATA_CHECK(arena_ != nullptr, kBadArgument, "model: loss requested before any forward()");
  engine_.accelerator().copy_async(host, arena_->stats.data, 2 * sizeof(double), CopyKind::kDeviceToHost,
                                   engine_.compute_stream());
}

LossStats DecoderModel::loss_stats(int slot) {
  select(slot);
  STRATA_CHECK(options_.stage.head, kBadArgument, "model: a pipeline stage without the head has no loss");
  STRATA_CHECK(arena_ != nullptr, kBadArgument, "model: loss requested before any forward()");
  Arena& a = *arena_;
  double* host = a.host_doubles() + 1;
  engine_.accelerator().copy_async(host, a.stats.data, 2 * sizeof(double),
                                   CopyKind::kDeviceToHost, engine_.compute_stream());
  const bool aux_loss = config_.moe() && config_.output_router_logits;
  if (aux_loss) {
    engine_.accelerator().copy_async(host + 2, a.moe_aux.data, sizeof(double), CopyKind::kDeviceToHost,
                                     engine_.compute_stream());
  }
  engine_.compute_stream().synchronize();
  LossStats stats{host[0], host[1]};
  if (aux_loss) {
    stats.aux = host[2];
    stats.aux_coef = config_.router_aux_loss_coef;
  }
  return stats;
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

// Standard normal from two counter-derived uniforms (Box-Muller).
double normal_at(uint64_t key, uint64_t index) {
  const uint64_t a = splitmix64(key ^ splitmix64(2 * index));
  const uint64_t b = splitmix64(key ^ splitmix64(2 * index + 1));
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1p-53;  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * 0x1p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

// Uniform in [-1, 1) from a counter-derived value.
double uniform_at(uint64_t key, uint64_t index) {
  return static_cast<double>(splitmix64(key ^ splitmix64(index)) >> 11) * 0x1p-52 - 1.0;
}

}  // namespace

int64_t default_loss_chunk_rows(const DecoderConfig& config, int tensor_parallel) {
  constexpr int64_t kLogitsBudget = int64_t{64} << 20;
  return std::max<int64_t>(64, kLogitsBudget / (4 * (config.vocab_size / tensor_parallel)));
}

int64_t lora_widest_input(const DecoderConfig& c, const LoraSpec& lora) {
  int64_t in = 0;
  for (const std::string& target : lora.targets) {
    // (Multi-head latent attention's o_proj reads heads x v_head_dim <= heads x head_dim.)
    in = std::max(in, target == "o_proj"      ? c.num_attention_heads * c.head_dim
                      : target == "down_proj" ? c.intermediate_size
                      : target == "q_b_proj"  ? c.q_lora_rank
                      : target == "kv_b_proj" ? c.kv_lora_rank
                                              : c.hidden_size);
  }
  return in;
}

void initialize_parameters(engine::Engine& engine, const std::vector<ParamId>& params,
                           uint64_t seed, double std, float norm_value) {
  std::vector<float> values;
  for (ParamId id : params) {
    const engine::ParamInfo& p = engine.param_info(id);
    // Tiles are keyed by their untiled tensor and element index within it, so a
    // tiled model initialises exactly like an untiled one.
    const std::string& key_name = p.slice ? p.slice->tensor : p.name;
    // (The sigmoid router's correction bias starts at 0 as in transformers' _init_weights.)
    // (gpt-oss's stacked experts' biases end in "_bias"; its sinks start normal, as transformers' _init_weights.)
    const bool is_bias = key_name.ends_with(".bias") || key_name.ends_with("_bias");
    const bool is_norm = p.shape.size() == 1 && !is_bias && !key_name.ends_with(".sinks");
    const bool lora_a = key_name.ends_with(".lora_A.weight"), lora_b = key_name.ends_with(".lora_B.weight");
    const double lora_bound = lora_a ? 1.0 / std::sqrt(static_cast<double>(p.shape.back())) : 0.0;
    const uint64_t key = splitmix64(seed) ^ fnv1a(key_name);
    engine.for_each_owned_range(
        id, engine::Engine::Access::kWrite, [&](int64_t first, const TensorView& host) {
          values.resize(static_cast<size_t>(host.numel()));
          // Each element by its index in the untiled tensor (a tile's or tp shard's runs).
          for_each_tensor_run(p, first, host.numel(), [&](int64_t at, int64_t from, int64_t n) {
            for (int64_t i = 0; i < n; ++i) {
              const auto index = static_cast<uint64_t>(at + i);
              values[static_cast<size_t>(from - first + i)] =
                  is_bias || lora_b ? 0.0f
                  : is_norm         ? norm_value
                  : lora_a          ? static_cast<float>(lora_bound * uniform_at(key, index))
                                    : static_cast<float>(std * normal_at(key, index));
            }
          });
          convert(values.data(), DType::kF32, host.data, host.desc.dtype, values.size());
        });
  }
}

double DecoderModel::router_load_imbalance() const {
  double worst = 0;
  for (const auto& layer : layers_) {
    const MoeMlp* moe = layer->moe();
    if (moe == nullptr || moe->load().empty()) continue;
    const std::vector<double>& load = moe->load();
    double total = 0, most = 0;
    for (double n : load) {
      total += n;
      most = std::max(most, n);
    }
    if (total > 0) worst = std::max(worst, most / (total / static_cast<double>(load.size())));
  }
  return worst;
}

std::vector<std::vector<double>> DecoderModel::router_loads() const {
  std::vector<std::vector<double>> loads;
  for (const auto& layer : layers_) {
    if (const MoeMlp* moe = layer->moe()) loads.push_back(moe->load());
  }
  return loads;
}

void DecoderModel::update_correction_biases(float rate) {
  STRATA_CHECK(config_.sigmoid_router, kBadArgument,
               "moe.router_bias_update_rate: model_type {} has no e_score_correction_bias to update (DeepSeek's "
               "auxiliary-loss-free balancing needs the sigmoid router of deepseek_v3, kimi_k2 or glm4_moe)",
               config_.model_type);
  for (auto& layer : layers_) {
    if (MoeMlp* moe = layer->moe()) moe->update_correction_bias(rate);
  }
}

void DecoderModel::reset_router_load() {
  for (auto& layer : layers_) {
    if (MoeMlp* moe = layer->moe()) moe->reset_load();
  }
}

}  // namespace strata::nn
