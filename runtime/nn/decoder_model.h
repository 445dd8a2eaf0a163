// The decoder every supported family is (Hugging Face's *ForCausalLM layouts
// of llama, mistral, qwen2, qwen3 and their mixtures of experts: the variants
// decoder_config.h describes) and its runner: embedding, decoder layers
// (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP -> residual),
// final RMSNorm, and the output
// projection fused with a chunked cross-entropy loss. Parameter names are
// Hugging Face's (hf_tensors), so weights load from and save to HF
// safetensors unchanged (runtime/nn/param_files.h).
//
// DecoderModel is also the model RUNNER (llm.c style): it owns one activation
// arena in accelerator memory, sized for the largest batch x seq seen, holding
// everything a forward saves for backward plus backward scratch; modules hold
// descriptors only. All work is enqueued on the engine's compute stream; the
// host waits only in loss() / loss_stats() (one small copy).
//
// Mixture of experts (mixtral, qwen3_moe, qwen2_moe; runtime/nn/moe_mlp.h): every
// layer's MLP is a MoeMlp, whose forward synchronises the compute stream once
// (the experts' row counts). With the config's output_router_logits (what
// makes transformers add the term), forward also computes the load-balancing
// loss over every layer's routing (attention mask none: every token counts)
// and the loss is the cross-entropy mean + router_aux_loss_coef * aux
// (LossStats::mean); its gradient, grad_scale * coef * d aux, flows into each
// router in backward.
//
// Training forward fuses the loss's backward: the lm_head operator runs in its
// BACKWARD hook window at the end of forward(), computing the loss, dh and the
// lm_head gradient from logits formed once (ops.h, cross_entropy). backward()
// then continues from the final norm down to the embedding.
//
// Activation checkpointing (DecoderModelOptions::checkpoint_activations), per
// decoder layer: forward keeps only each layer's input (its checkpoint, which
// is the residual stream) and runs every layer in ONE shared set of activation
// buffers; backward, from the top, runs each layer's forward again from its
// checkpoint under Phase::kRecompute hooks (so a partitioning engine fetches
// the layer's parameters as for forward), then that layer's backward. The top
// layer is not recomputed: its activations are still in the shared buffers
// when backward starts. With cpu_checkpointing the checkpoints live in pinned
// host memory, copied out in forward and back before each recompute, in order
// on the compute stream. The recompute runs the same kernels on the same
// inputs as forward, so results equal those without checkpointing (bitwise
// with deterministic kernels, as both backends' are).
//
// Ownership: borrows the Engine (which must outlive it). Thread-safety: none.
// Errors: kBadArgument for bad ids/targets/shapes (checked on the host before
// anything is enqueued); errors of enqueued work surface from loss() or the
// engine's compute stream.
#pragma once

#include <memory>
#include <span>

#include "runtime/nn/attention.h"
#include "runtime/nn/context_attention.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/moe_mlp.h"

namespace strata::nn {

// Activations a decoder layer's forward saves for its backward (views of the
// arena). `local` rows: the batch's rows, or with sequence parallelism this tp
// rank's block of them (rows / tp).
struct DecoderActs {
  TensorView ln1, rstd1;  // input norm output [local, hidden], fp32 [local]
  AttentionActs attn;     // the attention kind's (AttentionArena::saved); every row (with tp, this rank's heads)
  TensorView h;           // residual after attention [local, hidden]
  TensorView ln2, rstd2;  // post-attention norm (Gemma's pre_feedforward_layernorm)
  // Sandwich norms (Gemma; empty otherwise): the attention's and the MLP's
  // outputs before their own norms [local, hidden], and those norms' rstd.
  TensorView attn_out, rstd_attn_out, mlp_out, rstd_mlp_out;
  MlpActs mlp;            // dense families
  MoeActs moe;            // mixture-of-experts families
  MoeAux moe_aux;         // the model's load-balancing state (shared by the layers)
  // Sequence parallelism (empty otherwise), shared by the layers: a norm's
  // output gathered from every tp rank [rows, hidden] (a column-parallel
  // block's input, gathered again in backward rather than saved), and a
  // row-parallel block's partial output or input gradient [rows, hidden]
  // before its reduce-scatter.
  TensorView gathered, partial;
};
// Backward scratch shared by all layers.
struct DecoderGrads {
  TensorView dln;  // gradient at a norm's output [local, hidden]
  TensorView dpost;  // sandwich norms: the gradient at a block's output, before its norm [local, hidden]
  AttentionGrads attn;  // the attention kind's (AttentionArena::scratch)
  MlpGrads mlp;
  MoeGrads moe;
  // Sequence parallelism (empty otherwise): the layer output's gradient
  // gathered from every tp rank [rows, hidden], and fp32 [hidden] for a
  // norm's weight gradient over this rank's rows, summed over tp before it
  // is added (RMSNorm::backward's tp_dw).
  TensorView dgathered, dnorm;
};

class DecoderLayer : public Module {
 public:
  // Layer `layer` of `config`. sequence_parallel: the layer's input, output
  // and norms hold this tp rank's block of rows (needs tensor parallelism).
  DecoderLayer(engine::Engine& engine, std::string name, const DecoderConfig& config, int64_t layer,
               DType dtype, MlpTiling mlp_tiling = {}, const LoraSpec* lora = nullptr,
               bool skip_unrouted_experts = true, bool sequence_parallel = false);
  // x, y [local, hidden] (DecoderActs); batch x seq are every rank's rows.
  void forward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
               const DecoderActs& acts, const TensorView& y, Phase phase = Phase::kForward);
  // dres holds the gradient at the layer's output on entry and at its input on return.
  void backward(const TensorView& x, const TokenPlaces& places, int64_t batch, int64_t seq,
                const DecoderActs& acts, const DecoderGrads& grads, const TensorView& dres);

  MoeMlp* moe() const { return moe_.get(); }  // null for a dense MLP

 private:
  // Tensor parallelism's collectives around the attention and MLP blocks
  // (Megatron's f and g). A block reads block_input(...): the norm's output,
  // or with sequence parallelism every rank's gathered into `gathered`; it
  // writes its partial sum to block_output(...), which complete() sums over
  // tp into `out`: in place by an allreduce, or (sequence parallelism) from
  // acts.partial by a reduce-scatter into this rank's rows.
  const TensorView& block_input(const TensorView& local, const TensorView& gathered);
  const TensorView& block_output(const DecoderActs& acts, const TensorView& out) const;
  void complete(const DecoderActs& acts, const TensorView& out);

  bool sp_ = false;
  // post_attention_layernorm_ is the MLP's input norm (Gemma names it
  // pre_feedforward_layernorm); with sandwich norms attn_out_norm_
  // ("post_attention_layernorm") and mlp_out_norm_
  // ("post_feedforward_layernorm") normalise each block's output before its
  // residual add (null otherwise).
  std::unique_ptr<RMSNorm> input_layernorm_, post_attention_layernorm_, attn_out_norm_, mlp_out_norm_;
  std::unique_ptr<SelfAttention> self_attn_;  // the kind config.attention names
  std::unique_ptr<Mlp> mlp_;     // dense families
  std::unique_ptr<MoeMlp> moe_;  // mixture-of-experts families (config.moe())
};

struct DecoderModelOptions {
  DType dtype = DType::kF32;  // parameter storage
  // Activation storage; unset: fp32 on the cpu accelerator (its kernels compute
  // in fp32 anyway), the parameter dtype on cuda.
  std::optional<DType> activation_dtype;
  // Rows of logits the loss forms at a time (scratch: rows x vocab fp32;
  // with tensor parallelism rows x vocab / tp in the activation dtype).
  // 0: default_loss_chunk_rows (64 MiB): bigger chunks make bigger GEMMs.
  int64_t loss_chunk_rows = 0;
  MlpTiling mlp_tiling;           // memory-centric tiling of the MLP projections
  // Per-layer activation checkpointing (see above): the arena holds the
  // checkpoints plus ONE layer's activations instead of every layer's, at the
  // cost of recomputing all but the top layer's forward in backward.
  bool checkpoint_activations = false;
  // Keep the checkpoints in pinned host memory instead of the arena (DeepSpeed's
  // activation_checkpointing.cpu_checkpointing). Requires checkpoint_activations.
  bool cpu_checkpointing = false;
  // LoRA adapters on the projections lora.targets names (runtime/nn/lora.h).
  // Enabled, the model freezes every parameter but the adapters (Engine::freeze:
  // the base gets no gradient and no optimizer state), and the arena gains the
  // adapters' two [rows, r] scratch buffers.
  LoraSpec lora;
  // Megatron's sequence parallelism (needs tensor parallelism: Engine::
  // tensor_group() of size > 1): the residual stream, the norms and what
  // they save hold each tp rank's block of the batch's rows (rows / tp; the
  // rows must divide), gathered before each column-parallel block and
  // reduce-scattered after each row-parallel one; the norms' weight
  // gradients are summed over tp. Every activation a layer keeps is then
  // divided by tp (Korthikanti et al.). The final norm's output is gathered
  // for the loss, the embedding's gradient from the gathered rows.
  bool sequence_parallel = false;
  // Context parallelism (Engine::context_group() of size > 1; issue 46): how
  // the attention crosses the cp group — keys and values around the ring,
  // or Ulysses' all-to-alls (context_attention.h). Each cp rank is given the
  // whole micro-batch (forward's ids, targets, positions; the same on every
  // member) and computes its two chunks of every sequence (chunk-major rows,
  // ContextLayout): RoPE at their positions in the whole sequence, packed
  // documents over the whole sequence, the loss of its rows only
  // (loss_stats() is this rank's share; the ranks' shares sum to the
  // micro-batch's), every gradient this rank's share, which the engine sums
  // over the group as over dp. seq must divide by 2 x cp. Refused with
  // tensor or sequence parallelism, pipeline stages, LoRA, experts and
  // multi-head latent attention (not implemented), by name.
  ContextMethod context_method = ContextMethod::kRing;
  // Mixture of experts: skip the windows of experts no rank routed a token to
  // (moe_mlp.h: a ZeRO-3 engine then never fetches them). false: every expert
  // runs its windows every step, empty where it got no rows — the same
  // result, all experts fetched; for measuring what routing saves
  // (strata-train --all-experts).
  bool skip_unrouted_experts = true;
  // Pipeline parallelism (runtime/pipeline/stages.h): the part of the model
  // this instance holds — decoder layers [first_layer, first_layer + layers),
  // named and configured as in the whole model ("model.layers.<l>"), the
  // embedding lookup when `embedding`, the final norm and lm_head with the
  // loss when `head`. A stage without the embedding takes its input from
  // boundary().input, one without the head ends at boundary().output and its
  // backward starts from boundary().output_grad. With tied embeddings a head
  // without the embedding declares model.embed_tokens.weight itself (its
  // lm_head), which the first stage holds too (Engine::share_with_stage sums
  // their gradients). The default: the whole model.
  struct Stage {
    int64_t first_layer = 0;
    int64_t layers = -1;  // -1: every layer from first_layer on
    bool embedding = true;
    bool head = true;
  };
  Stage stage;
};

struct ForwardOptions {
  // Also run the loss's backward (needed before backward()). False: evaluation.
  bool backward = true;
  // The loss whose gradient is taken is grad_scale * (sum of per-token losses)
  // / normalizer. 0: this micro-batch's own count of predicted tokens (counted
  // on the device; with context parallelism on the host, over the whole
  // micro-batch). Set it to the count over all ranks and micro-batches of a
  // step so that gradients add up to the gradient of the combined batch's mean.
  double normalizer = 0;
  double grad_scale = 1.0;  // e.g. an fp16 loss scale
  // Packed documents: [batch * seq] positions, each row a run of documents
  // whose positions count 0, 1, 2, ... (a 0 starts the next one). Each token
  // then attends only within its document (a block-diagonal causal mask) and
  // its rotary position is its place in its document — what transformers
  // computes for each document alone. Empty: one sequence per row, positions
  // 0..seq-1.
  std::span<const int32_t> positions{};
  // LoRA dropout (DecoderModelOptions::lora.dropout): the mask seed of this
  // forward; give each forward its own (step, micro-batch). Only a training
  // forward (backward = true) drops; evaluation computes without dropout.
  uint64_t dropout_seed = 0;
  // The micro-batch slot (pipeline schedules keep several micro-batches in
  // flight): each slot has an activation arena of its own, so a forward in
  // one leaves another's saved activations alone; backward(slot),
  // loss_stats(slot) and boundary(slot, ...) name it. Slots are made on
  // first use.
  int slot = 0;
};

struct LossStats {
  double sum = 0;    // sum of per-token losses over counted targets
  double count = 0;  // number of counted (not ignored) targets
  // Mixture of experts with output_router_logits: the load-balancing loss of
  // the forward and its coefficient (0 otherwise). transformers' training loss
  // is the mean plus aux_coef * aux; sum and count stay the language-model
  // part, which is what adds up over ranks and micro-batches.
  double aux = 0, aux_coef = 0;
  double lm_mean() const { return sum / count; }
  double mean() const { return sum / count + aux_coef * aux; }
};

class DecoderModel : public Module {
 public:
  DecoderModel(engine::Engine& engine, const DecoderConfig& config, DecoderModelOptions options = {});
  ~DecoderModel() override;

  // Predicting targets[t] from ids[0..t] within each sequence. ids, targets:
  // [batch * seq] host arrays; targets may hold ops::kIgnoreIndex. Enqueues the
  // forward (and, with options.backward, the loss's backward) and returns.
  void forward(std::span<const int32_t> ids, std::span<const int32_t> targets, int64_t batch,
               int64_t seq, const ForwardOptions& options = {});
  // Adds the gradient of the last forward's loss (in `slot`) into every parameter's gradient.
  void backward(int slot = 0);
  // The last forward's loss (in `slot`; a model with the head): waits for it.
  LossStats loss_stats(int slot = 0);
  double loss() { return loss_stats().mean(); }
  // Copies `slot`'s last loss statistics (sum, count: two doubles) to `host`
  // (pinned host memory) on the compute stream, without waiting: valid once
  // the stream has run past it. A model with the head.
  void loss_stats_async(int slot, double* host);

  // A pipeline stage's edges in micro-batch slot `slot` for batch x seq rows
  // (the slot's arena made or resized for them; batch 0: as it is): the
  // residual stream entering the first layer (`input`: a stage without the
  // embedding receives it here before forward) and leaving the last
  // (`output`, read after forward by a stage without the head), and their
  // gradients (`output_grad`: a stage without the head receives it before
  // backward; `input_grad`, read after backward by a stage without the
  // embedding). [rows, hidden] in the activation dtype (with sequence
  // parallelism this tp rank's rows). Valid until the slot is resized.
  struct Boundary {
    TensorView input, output, output_grad, input_grad;
  };
  Boundary boundary(int slot, int64_t batch, int64_t seq);
  const DecoderModelOptions::Stage& stage() const { return options_.stage; }
  // The bytes of `slot`'s arena that hold every layer's saved activations
  // (every Linear's input among them): written by that slot's training
  // forward only, so they stay as it left them through its backward and until
  // its next forward (a split backward's W reads them there). Empty with
  // activation checkpointing (one set the layers share) or before the slot's
  // first forward.
  std::span<const std::byte> kept_activations(int slot) const;
  // The embedding table's parameter (declared by a stage with the embedding,
  // or a head with tied embeddings); -1 when this stage holds none.
  ParamId embedding_weight() const;

  const DecoderConfig& config() const { return config_; }
  DType activation_dtype() const { return act_dtype_; }
  // Mixture of experts: the routers' load imbalance over the forwards since
  // reset_router_load() — per layer, the tokens of the busiest expert over the
  // mean per expert (every rank's tokens: the same value on every rank) —,
  // the worst layer's. 1 is a perfect balance, E / k every token on the same
  // k experts. 0 for a dense model, or with no forward since the reset.
  double router_load_imbalance() const;
  // Each MoE layer's MoeMlp::load() (tokens per expert over the forwards since
  // reset_router_load()), in layer order; dense layers left out.
  std::vector<std::vector<double>> router_loads() const;
  void reset_router_load();
  // DeepSeek-V3's auxiliary-loss-free balancing (moe.router_bias_update_rate):
  // every MoE layer's e_score_correction_bias takes MoeMlp::update_correction_bias
  // from the tokens routed since reset_router_load(). Call after the optimizer
  // step (collective as for_each_owned_range is). kBadArgument when no layer
  // of this model has a correction bias.
  void update_correction_biases(float rate);
  // Bytes of the activation arenas in accelerator memory, every slot's (0 before the first forward).
  size_t arena_nbytes() const;
  // Context parallelism: the bytes of the ring's or Ulysses' buffers, outside
  // the arenas (ContextAttention::buffer_nbytes; 0 without).
  size_t context_buffer_nbytes() const;
  // Bytes of pinned host memory holding activation checkpoints (nonzero only
  // with cpu_checkpointing and more than one layer, after the first forward).
  size_t host_checkpoint_nbytes() const;

 private:
  struct Arena;
  // Makes `slot` the current one (arena_ its arena, or null before its first use).
  void select(int slot);
  // For micro-batches of batch x seq tokens (with context parallelism this
  // rank's two chunks of each sequence: Arena::seq is seq / cp).
  void ensure_arena(int64_t batch, int64_t seq);
  ContextLayout context_layout(int64_t batch, int64_t seq) const;
  TokenPlaces places() const;  // the last forward's (documents only when packed)
  // Whether the forward of layer l runs again in backward (every layer but the top).
  // Tensor parallelism: the loss over this rank's vocabulary rows (Megatron's
  // vocabulary-parallel cross-entropy) from arena final_ln, into lse_ce and
  // stats; with dh (training) also this rank's partial d loss / d final_ln
  // into it, and the lm_head shard's gradient. normalizer, grad_scale: as
  // ForwardOptions'.
  void vocab_parallel_loss(const TensorView& normalizer, double grad_scale, const TensorView& dh);
  bool recomputed(size_t l) const {
    return options_.checkpoint_activations && l + 1 < layers_.size();
  }
  void upload(std::span<const int32_t> ids, std::span<const int32_t> targets,
              std::span<const int32_t> positions, int64_t batch, int64_t seq, double normalizer);

  DecoderConfig config_;
  DecoderModelOptions options_;
  DType act_dtype_;
  std::unique_ptr<Embedding> embed_tokens_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  std::unique_ptr<RMSNorm> norm_;
  std::unique_ptr<Module> lm_head_;  // holds lm_head.weight unless tied
  ParamId lm_head_param_ = -1;
  OpId lm_head_op_ = -1;
  bool lookup_ = true;  // the embedding lookup runs here (options_.stage.embedding)
  std::unique_ptr<ContextAttention> context_;  // context parallelism's attention (null without)
  std::vector<std::unique_ptr<Arena>> arenas_;  // per micro-batch slot
  int slot_ = 0;
  Arena* arena_ = nullptr;  // arenas_[slot_]
};

// DecoderModelOptions::loss_chunk_rows when left 0: as many rows as fit 64 MiB
// of fp32 logits over this rank's vocabulary (all of it, or vocab / tp with
// tensor parallelism), at least 64.
int64_t default_loss_chunk_rows(const DecoderConfig& config, int tensor_parallel = 1);

// The widest input of a projection `lora` targets: the columns of its dropout
// scratch (LoraScratch::xd).
int64_t lora_widest_input(const DecoderConfig& config, const LoraSpec& lora);

// Deterministic initialisation keyed by (parameter name, element index), so the
// result does not depend on declaration order, world size or sharding:
// normal(0, std) for matrices, 1 for norm weights, 0 for biases, and a LoRA
// adapter as PEFT starts it: lora_A Kaiming-uniform (U(-1/sqrt(in),
// 1/sqrt(in)), torch's kaiming_uniform_ with a = sqrt(5)), lora_B zero, so
// training starts from the base model. Writes each rank's owned ranges only
// (engine.for_each_owned_range). norm_value: the norm weights' value (0 for
// Gemma's norms, which multiply by 1 + w, as transformers initialises them).
void initialize_parameters(engine::Engine& engine, const std::vector<ParamId>& params,
                           uint64_t seed, double std = 0.02, float norm_value = 1.0f);

}  // namespace strata::nn
