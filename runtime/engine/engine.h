// Engine v2 (docs/DESIGN.md §4.1): the hooks between model code (runtime/nn) and
// whatever owns parameter memory — a ResidentEngine that keeps everything on
// the accelerator, or a ZeroEngine that partitions, offloads and prefetches.
//
// Lifecycle. Model code DECLARES parameters (name, dtype, shape, slice) and
// operators (one operator = one hook window = the parameters one kernel group
// reads); nothing is allocated. finalize() sees every declaration and creates
// storage where the engine's configuration says. Declaring after finalize, or
// using hooks before it, throws Error(kBadArgument).
//
// Ids. Parameters and operators have dense integer ids in declaration order;
// names are for logs, checkpoints and Hugging Face files only. Layers below
// runtime/ (offload/, partition/) see ids, shapes and bytes, never nn types.
//
// Hooks are stream-ordered, not host-blocking. The model runs an operator as
//     pre_op(op, phase);  ...enqueue kernels on compute()...;  post_op(op, phase);
// After pre_op returns, param(p) is valid for every p of `op`, and work
// enqueued on the compute stream afterwards sees the parameter's full value
// (the engine makes the stream wait on an event, never the host). In a
// backward phase grad(p) is valid too. post_op records where the op's kernels
// end; the engine may release gathered memory once that point is reached
// (stream-ordered free) and, in backward, treats the op's gradient
// contributions as enqueued. A parameter's gradient is complete at its LAST
// use in a backward pass (a tied embedding is used twice); the engine reduces
// or hands it on only then (see set_grad_ready_callback).
//
// Phases: kForward, kBackward, and kRecompute — the forward of a checkpointed
// segment run again inside backward, fetched like forward.
//
// Ownership: the engine owns all parameter and gradient storage and the
// compute stream; it borrows the Accelerator, which must outlive it.
// Thread-safety: one training thread drives declarations, hooks and steps.
// Errors: Error(kBadArgument) for unknown ids, calls out of order, and access
// outside a hook window the engine can detect; kOutOfMemory when storage does
// not fit its budget; errors of asynchronous work surface from the compute
// stream's synchronize (and events recorded after the failure).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/ops.h"
#include "kernels/quant_blocks.h"
#include "offload/hook_ids.h"
#include "core/accelerator.h"
#include "core/tensor.h"
#include "partition/communicator.h"

namespace strata::engine {

using offload::OpId;
using offload::ParamId;
using offload::Phase;
using offload::phase_name;

// Where a parameter sits when it is a block of a larger logical tensor (a
// TiledLinear tile of a Hugging Face weight): that tensor's name and shape,
// and the block's offset in each dimension. Used to load and save by HF name.
// With `strides` it is instead a strided view of the tensor (gpt-oss's
// stacked experts: one expert's transposed block, gate and up interleaved):
// element i of a 1-D parameter, or (i, j) of a 2-D one, is element base + i
// strides[0] (+ j strides[1]) of the tensor in row-major order; `offset` is
// then unused. Either way no two parameters cover the same element.
struct ParameterSlice {
  std::string tensor;
  Shape tensor_shape;
  std::vector<int64_t> offset;
  std::vector<int64_t> strides;  // empty: the block at `offset`
  int64_t base = 0;
};

// What a parameter is; no storage. `name` is the Hugging Face tensor name (or,
// for a tile, "<HF name>.tile_<o>_<i>" with `slice` saying where it belongs).
struct ParamInfo {
  std::string name;
  DType dtype = DType::kF32;  // storage dtype (fp32, fp16 or bf16)
  Shape shape;
  std::optional<ParameterSlice> slice;
  // Not trained (Engine::freeze): no gradient — grad() gives an empty view,
  // which every op takes as "not wanted" —, never reduced, no optimizer state.
  // A partitioning engine still shards, offloads and gathers it like any
  // other parameter (backward needs it for the input gradient).
  bool frozen = false;
  // Its own AdamW weight decay (Engine::set_weight_decay; a trainer's
  // parameter group, e.g. no decay for biases and norms); nullopt: the
  // optimizer's (ZeroEngineOptions::adam). Parameters of different decay
  // form groups of their own.
  std::optional<float> weight_decay = std::nullopt;
  // Its learning rate as a multiple of the step's (Engine::set_lr_scale; a
  // trainer's parameter group with its own lr, e.g. a head trained faster).
  // Parameters of different scales form groups of their own.
  float lr_scale = 1.0f;
  // Expert `expert` of `experts` of one mixture-of-experts layer
  // (Engine::mark_expert); -1: not an expert's. With expert parallelism only
  // the ranks that own the expert hold it (Engine::owns_expert).
  int32_t expert = -1;
  int32_t experts = 0;
  // Tensor parallelism (Engine::tensor_group() of size > 1): true when this
  // is this rank's shard of a tensor split across the tp group (`slice` says
  // which block); false when every tp rank holds the same tensor (norms, the
  // embedding, a row-parallel bias) and computes the same gradient for it.
  bool tp_split = false;
  // Of a tp shard: how many consecutive tp ranks hold this same block (a kv
  // head shared by the ranks whose query heads use it, when a model has
  // fewer kv heads than tp ranks); they sum its gradient among them, and the
  // gradient norm counts the first one's. 1: this rank's alone.
  int32_t tp_copies = 1;
  // Pipeline parallelism: another stage holds this same tensor too (a tied
  // embedding: the first stage's lookup table is the last stage's lm_head);
  // its rank in the pipeline group (Engine::share_with_stage), -1: none. The
  // two stages' gradients are summed; the norm counts the lower stage's.
  int32_t stage_peer = -1;
  // Kept block-quantized (Engine::store_blocks: a frozen weight read from
  // an FP8 or MXFP4 checkpoint; docs/DESIGN.md §4.2.2). A ZeRO-3 engine keeps
  // it at home in its stored form (QuantBlocks::stored_shape: FP8's e4m3
  // bytes, MXFP4's codes and scales, partitioned like any parameter's
  // elements) with the scale grid whole on every rank, and dequantizes it to
  // `dtype` on the accelerator per gather (Ops::dequantize_fp8_blocks,
  // Ops::dequantize_mxfp4_blocks); param() and for_each_owned_range(kRead)
  // give the dequantized values, the bits of a reader that dequantized it at
  // load. After finalize set only where the engine keeps it so (nullopt:
  // stored in `dtype`).
  std::optional<kernels::QuantBlocks> blocks = std::nullopt;

  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_nbytes(dtype); }
};

struct OpInfo {
  std::string name;             // e.g. "model.layers.0.self_attn.q_proj"
  std::vector<ParamId> params;  // what the op's kernels read
};


class Engine {
 public:
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- declaration ------------------------------------------------------------
  // Names are unique; shapes non-empty with positive dims; dtype float storage.
  ParamId declare_parameter(ParamInfo info);
  // Every parameter id must exist; an op may list no parameter (a window that
  // only marks a point in the trace).
  OpId declare_operator(std::string name, std::vector<ParamId> params);
  // Marks a declared parameter frozen (ParamInfo::frozen), before finalize.
  void freeze(ParamId id);
  // Gives a declared parameter its own weight decay (ParamInfo::weight_decay),
  // before finalize; finite and >= 0.
  void set_weight_decay(ParamId id, float weight_decay);
  // Gives a declared parameter its lr scale (ParamInfo::lr_scale), before
  // finalize; finite and >= 0.
  void set_lr_scale(ParamId id, float lr_scale);
  // Marks a declared parameter as expert `expert` of the `experts` of one
  // mixture-of-experts layer (ParamInfo::expert), before finalize.
  void mark_expert(ParamId id, int expert, int experts);
  // Asks that frozen parameter `id` be kept block-quantized as `blocks`
  // describes (ParamInfo::blocks; its shape must be the parameter's: FP8 a
  // 2-D weight with positive blocks, MXFP4 a 2-D weight with rows of a
  // multiple of 32 elements), before finalize and after freeze. An engine that does
  // not keep blocks (ResidentEngine, ZeroEngine below stage 3: their full
  // copies live on the accelerator anyway) stores it in its dtype: after
  // finalize param_info(id).blocks says which, and a parameter kept so is
  // written with write_blocks, not for_each_owned_range.
  void store_blocks(ParamId id, const kernels::QuantBlocks& blocks);
  // Creates storage for every declared parameter (zero-filled; see
  // for_each_owned_range to initialise or load). Once only.
  void finalize();
  bool finalized() const { return finalized_; }

  int32_t parameter_count() const { return static_cast<int32_t>(params_.size()); }
  int32_t operator_count() const { return static_cast<int32_t>(ops_.size()); }
  const ParamInfo& param_info(ParamId id) const;
  const OpInfo& op_info(OpId id) const;
  // Throws kBadArgument naming `name` when there is no such parameter.
  ParamId find_parameter(const std::string& name) const;
  // Number of declared operators that list `id` (its uses per forward / backward).
  int32_t uses_of(ParamId id) const;

  // ---- compute -------------------------------------------------------------------
  Accelerator& accelerator() const { return accelerator_; }
  ops::Ops& ops() const { return *ops_impl_; }
  // The context of the compute stream: model kernels are enqueued here.
  ops::ComputeContext& compute() const { return *compute_; }
  Stream& compute_stream() const { return *compute_stream_; }

  // ---- hooks ---------------------------------------------------------------------
  virtual void pre_op(OpId op, Phase phase) = 0;
  virtual void post_op(OpId op, Phase phase) = 0;
  // A window of `op` that runs no kernels in this pass — an expert no rank
  // routed a token to —, called exactly where its pre_op/post_op would be.
  // Its parameters are not fetched and param/grad may not be used; in a
  // backward phase it counts as a use that adds nothing, so a gradient all of
  // whose uses were skipped is complete without being asked for (a
  // partitioning engine then has nothing of this rank's to reduce). Every
  // rank must skip the same windows: decide from sum_over_ranks.
  void skip_op(OpId op, Phase phase);
  // Advice before the windows of `ops` of one micro-batch run (from each
  // one's next window through the ones of its backward): ops[i]'s will be
  // skipped when skipped[i] is non-zero, run otherwise. A prefetching engine
  // fetches ahead by it; wrong advice costs bandwidth, never correctness.
  // Every rank must give the same advice.
  virtual void plan_skip(std::span<const OpId> /*ops*/, std::span<const uint8_t> /*skipped*/) {}
  // Sums `values` over the data-parallel ranks, in place (host memory);
  // collective and blocking: every rank calls it at the same point. A model
  // agrees on data-dependent choices with it (which experts any rank routed to).
  virtual void sum_over_ranks(double* values, size_t count) = 0;

  // ---- tensor parallelism (docs/DESIGN.md §5) ---------------------------------------
  // The tensor-parallel group of this rank: `size` consecutive job ranks that
  // split each decoder layer's projections (Megatron's layout), `rank` this
  // rank's position in it. size 1 (the default): nothing is split.
  struct TensorGroup {
    int size = 1;
    int rank = 0;
  };
  const TensorGroup& tensor_group() const { return tensor_group_; }
  // Sums `view` (accelerator memory, float dtype) over the tensor group in
  // place: ordered after the compute stream's work so far, and the compute
  // stream's later work waits for it (Megatron's g after a row-parallel
  // projection, f before a column-parallel one in backward). Collective over
  // the tensor group, in the same order on every member; every member gets
  // the same bits. Refused (kBadArgument) when the group has one member.
  virtual void tp_allreduce(const TensorView& view);
  // Sequence parallelism's pair, ordered on the compute stream as tp_allreduce:
  // tp_allgather writes `full` ([size * n, ...]) as the members' `local`
  // ([n, ...]) in member order; tp_reduce_scatter writes `local` as this
  // member's block of the sum of the members' `full`. Same dtype; `full` has
  // size times `local`'s elements. Refused (kBadArgument) with one member.
  virtual void tp_allgather(const TensorView& local, const TensorView& full);
  virtual void tp_reduce_scatter(const TensorView& full, const TensorView& local);

  // ---- context parallelism (docs/DESIGN.md §5, issue 46) ----------------------------
  // The context-parallel group of this rank: `size` ranks that split every
  // sequence, member `rank` holding its chunks `rank` and 2·size−1−rank
  // (nn::RingAttention's layout); `comm` the group's communicator, over which
  // the model's attention passes keys and values (or Ulysses' all-to-alls),
  // and `stream` a stream of the engine's for those transfers (both null with
  // size 1). The members hold the same parameters: an engine with it sums
  // every gradient over the group as over data parallelism (ZeroEngine:
  // ZeRO over the dp x cp ranks).
  struct ContextGroup {
    int size = 1;
    int rank = 0;
    partition::Communicator* comm = nullptr;
    Stream* stream = nullptr;
  };
  const ContextGroup& context_group() const { return context_group_; }

  // ---- expert parallelism (docs/DESIGN.md §4.2) -----------------------------------
  // The expert-parallel group of this rank: `size` data-parallel ranks that
  // split every mixture-of-experts layer's experts between them, member i
  // holding experts [i * E / size, (i + 1) * E / size); `ranks[i]` is member
  // i's data-parallel rank (the index sum_over_ranks callers lay values out
  // by), `member` this rank's index. size 1 (the default): every rank holds
  // every expert. dp_rank and dp_size: this rank among the data-parallel ranks.
  struct ExpertGroup {
    int size = 1;
    int member = 0;
    std::vector<int> ranks{0};
    int dp_rank = 0;
    int dp_size = 1;
  };
  const ExpertGroup& expert_group() const { return expert_group_; }
  // Whether this rank holds expert `expert` of `experts` (always with size 1).
  // A rank never opens (nor skips) the windows of an expert it does not hold.
  bool owns_expert(int expert, int experts) const;
  // Rows to and from the expert group's members (Communicator::all_to_all
  // semantics over the group: `send` and `recv` in one dtype, splits in
  // elements, accelerator memory): ordered after the compute stream's work so far, and the compute
  // stream's later work waits for it. Collective over the expert group, in
  // the same order on every member. Refused (kBadArgument) when the group has
  // one member: there is nothing to exchange.
  virtual void exchange_experts(const TensorView& send, const TensorView& recv,
                                const partition::AllToAllSplits& splits);

  // ---- pipeline parallelism (docs/DESIGN.md §5.4) -------------------------------------
  // Before finalize: parameter `id` is held by another pipeline stage too
  // (ParamInfo::stage_peer), `peer` its rank in `pp`, the pipeline group's
  // communicator (which must outlive the engine). Every shared parameter of
  // one engine names the same communicator.
  void share_with_stage(ParamId id, partition::Communicator& pp, int peer);
  // After a step's last backward and before its optimizer step: adds the peer
  // stage's gradient of every shared parameter to this stage's, so both hold
  // the sum (the same bits: fp32 addition commutes). Ordered on the compute
  // stream; collective with the peers (each calls it at the same point).
  // Nothing without shared parameters.
  void sum_stage_gradients();

  // ---- a split backward (pipeline schedules with W: zb-h1) -----------------------------
  // While a sink is set, a Linear's backward computes only its input
  // gradient — in a kRecompute window: it reads the weight and is not a use
  // of the gradient — and hands the sink its output gradient dy and input x
  // (whole matrices, accelerator memory; dy valid only until the compute
  // stream's next work, so the sink copies it; x as long as the model keeps
  // it, which the sink is told: pipeline::DeferredWeightGrads) with the function that adds
  // dy^T x into its gradients in a kBackward window of its own (W). Modules
  // that do not consult the sink compute their weight gradients at once, so
  // the result never depends on what is deferred, only the time it runs.
  using WeightGradFn = std::function<void(const ops::MatView& dy, const ops::MatView& x)>;
  class WeightGradSink {
   public:
    virtual ~WeightGradSink() = default;
    virtual void defer(const ops::MatView& dy, const ops::MatView& x, WeightGradFn weight_grads) = 0;
  };
  void set_weight_grad_sink(WeightGradSink* sink) { weight_grad_sink_ = sink; }
  WeightGradSink* weight_grad_sink() const { return weight_grad_sink_; }

  // The full parameter (storage dtype, accelerator memory). Valid between
  // pre_op and post_op of an op that lists it.
  virtual TensorView param(ParamId id) = 0;
  // Its fp32 gradient accumulator (same shape, accelerator memory); kernels add
  // into it. Valid in a backward window of an op that lists it. A frozen
  // parameter's is an empty view (no data): skip its weight gradient.
  virtual TensorView grad(ParamId id) = 0;

  // Called (on the training thread, from post_op) when a parameter's gradient
  // for this backward pass is complete: all its uses have run post_op(kBackward).
  // Never for a frozen parameter.
  // `ready` is recorded on the compute stream after its last contribution.
  using GradReadyFn = std::function<void(ParamId id, Event& ready)>;
  void set_grad_ready_callback(GradReadyFn fn) { grad_ready_ = std::move(fn); }

  // Sets every gradient this rank holds to zero (stream-ordered on compute()).
  virtual void zero_grad() = 0;

  // ---- range-based init, load and save -----------------------------------------
  // Calls fn(first, host) once per contiguous range of parameter `id`'s
  // flattened elements that this rank owns: elements [first, first +
  // host.numel()), as a host view in the storage dtype. kWrite: the values fn
  // leaves in `host` become the parameter's (fn must fill all of it). kRead:
  // `host` holds the current values. The view is valid during the call only.
  // A resident engine owns every element; a sharded one only its shard. Blocks
  // until the data has moved (not for use on the hot path).
  enum class Access : uint8_t { kRead, kWrite };
  using RangeFn = std::function<void(int64_t first, const TensorView& host)>;
  virtual void for_each_owned_range(ParamId id, Access access, const RangeFn& fn) = 0;
  // A parameter kept block-quantized (param_info(id).blocks after
  // finalize): its scale grid `scales` (a host view of the whole grid of
  // QuantBlocks::scale_dtype and scale_shape, copied) and its stored form,
  // fn(first, host) over this rank's owned ranges of it as
  // for_each_owned_range(kWrite) gives them but with host views of
  // QuantBlocks::stored_dtype over the stored elements (FP8: e4m3 bytes,
  // one per element; MXFP4: bytes of the kept form, kernels::pack_mxfp4's).
  // Error(kBadArgument) for a parameter not kept so or a grid of another
  // shape. Blocks until written.
  virtual void write_blocks(ParamId id, const TensorView& scales, const RangeFn& fn);

 protected:
  // `accelerator` must outlive the engine.
  explicit Engine(Accelerator& accelerator);
  virtual void on_finalize() = 0;
  // Whether this engine keeps the parameters store_blocks names quantized;
  // finalize drops the requests of one that does not, before on_finalize.
  virtual bool keeps_blocks() const { return false; }
  // Called by implementations at the start of pre_op / post_op.
  void check_hook(OpId op) const;
  // Hook-window bookkeeping shared by the engines: open_window (in pre_op)
  // checks the op and records the window; close_window (in post_op) checks
  // that it closes an open window of (op, phase) and removes it. Windows may
  // nest or overlap, and close in any order.
  void open_window(OpId op, Phase phase);
  void close_window(OpId op, Phase phase);
  // Whether an open window (a backward one when `backward`) lists parameter `id`.
  bool in_window(ParamId id, bool backward) const;
  // Implementations call this from post_op(kBackward) after recording `ready`
  // on the compute stream: counts the uses and, for each parameter of `op`
  // whose gradient just became complete, calls on_grad_ready and then the
  // callback set with set_grad_ready_callback.
  void note_backward_done(OpId op, Event& ready);
  // An engine's own reaction to a complete gradient (a ZeRO engine starts its
  // reduction here). `ready` is the compute-stream point after the last contribution.
  virtual void on_grad_ready(ParamId /*id*/, Event& /*ready*/) {}
  // An engine's own part of skip_op, between the window's open and close.
  virtual void on_skip_op(OpId /*op*/, Phase /*phase*/) {}
  // Set by an engine with expert parallelism (its constructor); checked there.
  void set_expert_group(ExpertGroup group) { expert_group_ = std::move(group); }
  // Set by an engine with tensor parallelism (its constructor).
  void set_tensor_group(TensorGroup group) { tensor_group_ = group; }
  // Set by an engine with context parallelism (its constructor).
  void set_context_group(ContextGroup group) { context_group_ = group; }
  // Refuses a window of an expert this rank does not hold (pre_op, skip_op).
  void check_owned(OpId op) const;
  // sum_stage_gradients' view of a shared parameter's gradient for this step:
  // the whole fp32 tensor this rank holds (zeros when no use has added to it
  // yet), or an empty view when it has none to sum (frozen).
  virtual TensorView stage_shared_grad(ParamId id) = 0;
  // After sum_stage_gradients has summed `id`'s gradient (stream-ordered on
  // the compute stream): an engine that held it back reduces it now.
  virtual void on_stage_grad_summed(ParamId /*id*/) {}

 private:
  Accelerator& accelerator_;
  std::unique_ptr<ops::Ops> ops_impl_;
  std::unique_ptr<Stream> compute_stream_;
  std::unique_ptr<ops::ComputeContext> compute_;
  std::vector<ParamInfo> params_;
  std::vector<OpInfo> ops_;
  std::vector<int32_t> uses_;           // per parameter: declared ops listing it
  std::vector<int32_t> backward_seen_;  // per parameter: uses done in this backward
  std::unordered_map<std::string, ParamId> by_name_;
  bool finalized_ = false;
  GradReadyFn grad_ready_;
  struct Window {
    OpId op;
    Phase phase;
  };
  std::vector<Window> open_windows_;  // pre_op without its post_op yet
  std::unique_ptr<Event> skip_point_;  // skip_op's compute-stream point (backward)
  ExpertGroup expert_group_;
  TensorGroup tensor_group_;
  ContextGroup context_group_;
  partition::Communicator* stage_comm_ = nullptr;  // share_with_stage's pipeline group
  WeightGradSink* weight_grad_sink_ = nullptr;
};

}  // namespace strata::engine
