// ZeroEngine: Engine v2 with ZeRO stages 1, 2 and 3 (docs/DESIGN.md §5). It
// composes the pieces below it; each owns one concern and states its own
// contract:
//   ParamHome (offload/param_home.h): where this rank's shard of each dtype
//       group lives — accelerator memory, pinned CPU memory or an NVMe file
//       (offload_param.device) — and the one way to read or write ranges of it.
//   ParamCoordinator (offload/param_coordinator.h), stage 3: full parameters
//       gathered for each operator from every rank's slice, prefetched along
//       the recorded operator trace within the byte budgets, released after
//       use. Stages 1/2 keep every full parameter resident instead, gathered
//       after each optimizer step.
//   BucketReducer + GradShard (offload/): gradients summed in fp32, never averaged —
//       normalise the loss by the global number of predicted tokens
//       (global_sum) instead, so N ranks equal one rank on the combined batch.
//         stage 1:   full fp32 gradients stay resident and accumulate over
//                    micro-steps; step() reduce-scatters them in buckets;
//         stage 2/3: a full fp32 gradient exists only while a parameter's
//                    backward runs; at its last use it joins a bucket that is
//                    reduce-scattered on its own stream and communicator and
//                    added into this rank's gradient shard (in accelerator
//                    memory, or a file with `grad_tier` nvme).
//   ShardOptimizer (offload/shard_optimizer.h): Adam/AdamW over the
//       shards — the CPU Adam with state in CPU memory or on NVMe, or Ops on
//       the accelerator (offload_optimizer.device none) — and, after
//       prepare_step, sub-groups updated during the last backward as soon as
//       their gradient is final, speculatively, rolled back exactly when the
//       step says otherwise — or, while clipping fires, their statistics
//       taken and their state read ahead, so step() is left the arithmetic.
//       At stage 3 (optimizer on cpu or nvme) step() hands even that, and the
//       state's write-back, to the optimizer thread and returns: the next
//       forward's gathers of a sub-group's parameters wait for its update
//       only (ParamCoordinator::set_home_updates), and the next backward's
//       first window, prepare_step, zero_grad, a checkpoint, a parameter
//       access or the next step() join it first (its error is rethrown
//       there, the step undone). ZeroEngineOptions::overlap_next_forward.
//   Expert parallelism (options.expert_parallel_size > 1): the experts this
//       rank holds (Engine::owns_expert) form groups of their own, partitioned,
//       gathered and reduced over the expert-dp group (ZeroComms::expert_*);
//       the other members' experts have no storage here; exchange_experts is
//       the ep group's all_to_all (docs/DESIGN.md §4.2).
//   Tensor parallelism (ZeroComms::tensor): rank() and world_size() are the
//       dp group's; parameters split across tp (ParamInfo::tp_split) form
//       groups of their own, so the gradient norm sums theirs over tp and
//       counts the replicated ones (the same on every tp rank) once; the
//       files of a rank carry its job rank (job_rank()).
// step() at an accumulation boundary: the global gradient norm (f64 allreduce
// on the control communicator), clipping, a skip without any state change when
// a gradient is not finite (with fp16 loss scaling the scale then backs off,
// DeepSpeed's rule: LossScaler), the optimizer, and fresh copies of the
// parameters for the next step. zero_engine.cc reads in that order.
//
// Collectives: every rank must make the same calls in the same order —
// finalize, prepare_step, the hooks of each step, for_each_owned_range (kWrite)
// before the next pre_op, global_sum and step.
//
// Ownership: borrows the accelerator and the communicators (which must outlive
// it); owns the homes, gathered copies, gradient shards, streams, swap files,
// the optimizer state, the I/O handle and the coordinator's and optimizer's
// threads.
// Thread-safety and errors: see engine.h; collectives fail with
// Error(kCommunication), NVMe I/O with Error(kIo) — a prefetch read that fails
// fails its HostEvent, so the error reaches the gather and compute streams and
// surfaces from the step's next synchronize (loss, step()) on that rank; its
// peers' pending allgathers fail within the communicator's timeout.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "kernels/optimizer.h"
#include "nvme/io_backend.h"
#include "nvme/io_options.h"
#include "offload/param_coordinator.h"
#include "offload/param_home.h"
#include "partition/communicator.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/loss_scaler.h"
#include "offload/shard_optimizer.h"
#include "runtime/engine/state_file.h"
#include "runtime/engine/zero_options.h"
#include "runtime/engine/zero_sizes.h"

namespace strata::nvme {
class AioHandle;
class SwapSpace;
}

namespace strata::engine {

// Each traffic class has its own communicator (docs/DESIGN.md §5); they may not be
// the same object, since each runs on its own stream.
struct ZeroComms {
  partition::Communicator* gather = nullptr;   // parameter allgathers
  partition::Communicator* reduce = nullptr;   // gradient reduce-scatters
  partition::Communicator* control = nullptr;  // norms, token counts (f64)
  // Expert parallelism (ZeroEngineOptions::expert_parallel_size > 1; null
  // otherwise): the ep group (the token exchange) and, over the expert-dp
  // group, the experts' allgathers and reduce-scatters (partition/process_groups.h).
  partition::Communicator* expert_exchange = nullptr;
  partition::Communicator* expert_gather = nullptr;
  partition::Communicator* expert_reduce = nullptr;
  // Tensor parallelism (null: none): the tp group (Engine::tp_allreduce, and
  // the gradient norm's sum over the split parameters). With it, gather,
  // reduce and control are the dp group's: ZeRO partitions each tp shard over
  // the ranks holding the same one (partition/process_groups.h).
  partition::Communicator* tensor = nullptr;
  // Pipeline parallelism (null: none): the pp group, over which the gradient
  // norm, the overflow flags and job_sum are summed too (each stage holds
  // other parameters); gather, reduce and control are then the stage's dp
  // group's. Engine::share_with_stage names the same communicator.
  partition::Communicator* pipeline = nullptr;
  // Context parallelism (null: none): the cp group (Engine::context_group(),
  // the model's ring or Ulysses attention). With it, gather, reduce and
  // control are the dp-cp group's: the ranks of a cp group hold the same
  // parameters, so ZeRO partitions and sums gradients over dp x cp
  // (partition/process_groups.h), and rank() / world_size() are that group's.
  partition::Communicator* context = nullptr;
};

// What the stage-3 coordinator did in a step, and where compute waited
// (offload/param_coordinator.h).
using offload::OpStall;
using offload::PrefetchStats;

// What one step() did.
struct StepResult {
  bool applied = false;     // false: a gradient was not finite; nothing changed
  double grad_norm = 0;     // global L2 norm of the summed gradients (before clipping)
  float grad_scale = 1;     // factor applied to the stored gradients (1/loss scale x clipping)
  double loss_scale = 1;    // the loss scale this step's gradients carried
  int64_t step = 0;         // optimizer steps applied so far
  // Host time step() spent, for the step breakdown (bench, metrics):
  double grad_wait_seconds = 0;  // waiting for the last gradient buckets to land in the shards
  double optimizer_seconds = 0;  // norm, Adam over the shards, new values to their home
  // The optimizer overlapping backward (prepare_step):
  double optimizer_drain_seconds = 0;       // of optimizer_seconds: waiting for the optimizer thread's last sub-groups
  double optimizer_overlapped_seconds = 0;  // optimizer thread's busy time before step(), hidden behind backward
  int64_t sub_groups = 0;                   // sub-groups this step updated (every group)
  int64_t sub_groups_overlapped = 0;        // of them, updated by the optimizer thread (kept)
  bool rolled_back = false;                 // speculative updates were undone (clipping, overflow, lr)
  // What the optimizer thread did during backward (nullopt: no thread):
  // speculated, or read ahead (statistics, NVMe state) for a step expected
  // to clip; and how many sub-groups' state it read (read-ahead, NVMe).
  std::optional<offload::OverlapMode> overlap_mode;
  int64_t sub_groups_read_ahead = 0;
  // Speculated and kept (NVMe): sub-groups whose state the thread read before
  // their gradient was final (offload::AppliedStep::sub_groups_prefetched).
  int64_t sub_groups_prefetched = 0;
  // The update overlapping the next forward (ZeroEngineOptions::
  // overlap_next_forward): this step's sub-groups left after backward are
  // updated, and the state committed, after step() returns.
  bool update_overlaps_forward = false;
  // The previous step's update, overlapped with this step's forward (0 when
  // none was): the optimizer thread's time on it, and what this step waited
  // for it — the join before its backward (from when compute had run all it
  // was given before it) plus the stall of forward windows whose gathers
  // waited for an update.
  double previous_update_seconds = 0;
  double previous_update_wait_seconds = 0;
  // Of the optimizer's own time, the share compute waited for: the host time
  // step() spent on it plus previous_update_wait_seconds, over (step()'s time
  // less the drain it overlaps, plus the thread's time behind backward and
  // previous_update_seconds). 1 without overlap.
  double optimizer_not_hidden_fraction() const;
};

class ZeroEngine final : public Engine {
 public:
  ZeroEngine(Accelerator& accelerator, ZeroComms comms, ZeroEngineOptions options);
  ~ZeroEngine() override;

  void pre_op(OpId op, Phase phase) override;
  void post_op(OpId op, Phase phase) override;
  TensorView param(ParamId id) override;
  TensorView grad(ParamId id) override;
  // grad(), for the calling thread to add into at once (a host-addressable
  // accelerator only, Error(kBadArgument) otherwise): a buffer made now is
  // zero-filled by this thread instead of on the compute stream, and for one
  // that exists the compute stream's work so far is waited for (none is
  // queued on a caller driving the engine from the host: no wait). The
  // caller's writes are done before its post_op, whose ready point the
  // gradient's reduction waits for. The C API's gradient adds on cpu.
  TensorView host_grad(ParamId id);
  void zero_grad() override;
  void for_each_owned_range(ParamId id, Access access, const RangeFn& fn) override;
  void write_blocks(ParamId id, const TensorView& scales, const RangeFn& fn) override;

  void plan_skip(std::span<const OpId> ops, std::span<const uint8_t> skipped) override;
  void exchange_experts(const TensorView& send, const TensorView& recv, const partition::AllToAllSplits& splits) override;
  void tp_allreduce(const TensorView& view) override;
  void tp_allgather(const TensorView& local, const TensorView& full) override;
  void tp_reduce_scatter(const TensorView& full, const TensorView& local) override;
  void sum_over_ranks(double* values, size_t count) override;  // the control communicator
  // This rank among the data-parallel ranks (the world without tensor parallelism;
  // with context parallelism the dp x cp ranks ZeRO partitions over, member d * cp + c).
  int rank() const;
  int world_size() const;
  // This rank in the job (pp stage x dp x tp + dp rank x tp + tp rank;
  // rank() without tensor and pipeline parallelism): what its files are
  // named by. job_size(): every rank.
  int job_rank() const;
  int job_size() const;
  // The I/O handle of the tiers on NVMe (null when none is): others that
  // stream through the same engine (layer-major's boundaries) borrow it.
  nvme::AioHandle* nvme_io() const { return aio_.get(); }
  // After finalize: the sizes in use, with a size left to choose
  // (kChooseFromModel) replaced by the choice from the model's layers.
  const ZeroEngineOptions& options() const { return options_; }
  // After finalize: sub_group_size and reduce_bucket_size, chosen or as given, and why (zero_sizes.h).
  const ZeroSizes& zero_sizes() const { return zero_sizes_; }

  // Sum of `value` over ranks (f64 allreduce on the control communicator);
  // collective, blocks. For the global count of predicted tokens.
  double global_sum(double value);
  // Sum of `value` over every rank of the job (the dp groups', then the tp
  // group's, then the pp group's); collective over the job, blocks. For agreement and barriers
  // that must span the tp groups (checkpoints).
  double job_sum(double value);
  // The optimizer at an accumulation boundary (see above); collective. `lr`
  // replaces options().adam.lr for this step (a schedule's value).
  StepResult step(float lr);
  // The first half of step(), ahead of it (torch.nn.utils.clip_grad_norm_'s
  // place in a loop): waits for the gradients' reductions and the optimizer
  // thread, takes the global norm, and returns it (unscaled, as
  // StepResult::grad_norm; infinity when a gradient is not finite); the next
  // step() uses that norm and clips to `max_norm` (<= 0: not at all) instead
  // of gradient_clipping -- that step only. No window may open until step()
  // or zero_grad() (which drops it). Collective; after the last backward.
  double clip_grad_norm(double max_norm);
  // The next backward is the last before step(lr): the optimizer may update
  // sub-groups during it (overlap_optimizer, stages 2/3; otherwise this only
  // checks). Collective (it may reduce a partly filled gradient bucket): every
  // rank calls it after the previous micro-step's backward and before the
  // last micro-step's backward — before its forward: DecoderModel's forward
  // already lands the lm_head's gradient (the loss's backward is fused into
  // forward()), which a step prepared after it does not update during
  // backward. While the last step's update overlaps the forward (see above)
  // the arming waits for the join (the first backward window). Until step()
  // (or zero_grad(), which abandons the step and rolls back) the parameters
  // may not be read or written through for_each_owned_range nor saved. A
  // different lr at step(), or more than one backward after this call, is
  // detected and redone exactly — except that at stage 3 a sub-group
  // speculated during an earlier backward has already changed the parameters
  // the next micro-step's forward gathers (a rollback cannot undo that), so
  // call it before the last micro-step. Error(kBadArgument) when called twice
  // without a step() between. `backwards`: the backward passes still to come
  // (layer-major: the step's m, each layer's in a row, so a layer's update
  // overlaps the backwards of the layers below; nothing of a sub-group is
  // used by a forward after its last backward).
  void prepare_step(float lr, int backwards = 1);
  // How later prepare_step()s use backward (offload/shard_optimizer.h):
  // kAuto (the default) speculates unless the last prepared step clipped,
  // and reads ahead while clipping fires; kSpeculate and kReadAhead fix the
  // mode. The results are the same bits in every mode.
  void set_overlap_policy(offload::OverlapPolicy policy);
  // prepare_step was called and neither step() nor zero_grad() since.
  bool step_prepared() const;
  // Waits for the update the last step() handed over (overlap_next_forward)
  // now rather than at the next backward — for a caller about to use the
  // cores for something else (a benchmark's reference step) — and rethrows
  // its error (the step undone). No-op when none is running.
  void join_update() { finish_update(); }
  // An evaluation pass between steps (forward windows only, no gradient):
  // stage 3 gathers its parameters on demand and leaves the operator trace of
  // the training step alone, so the next step still follows it (without
  // this, the evaluation's windows would diverge from the trace and switch
  // prefetch off for a step). Nothing else changes; stages 1/2 read their
  // resident copies as always. Between steps only (not after prepare_step,
  // not with a backward pass open); end_evaluation before the next training
  // window. Error(kBadArgument) when misplaced.
  void begin_evaluation();
  void end_evaluation();
  bool evaluating() const { return evaluating_; }
  int64_t step_count() const;

  // ---- checkpoints (docs/DESIGN.md §5.3) ---------------------------------------------------
  // Writes this rank's state into the existing directory `dir`: per dtype
  // group its parameter shard (params_<dtype>.bin, storage dtype) and its
  // optimizer state (master_, exp_avg_, exp_avg_sq_<dtype>.bin, fp32), then
  // engine.json (step count, loss scaler, the layout written). NVMe-resident
  // optimizer state is copied from its committed slot, which no step writes
  // between steps. Every file is durable (fsync, and the directory) before
  // this returns; the result names each with its size and CRC-32. Between
  // steps only (after step(), before the next pre_op); not collective.
  // With FrozenState::kOmitted the frozen groups' parameters are not written
  // (a LoRA base that never changes: the caller keeps its identity and loads
  // it again before load_state).
  enum class FrozenState { kSaved, kOmitted };
  std::vector<StateFile> save_state(const std::filesystem::path& dir,
                                    FrozenState frozen = FrozenState::kSaved);
  // Loads what save_state wrote for this rank into this finalized engine:
  // parameters, optimizer state, step count, loss scaler (the stage and tiers
  // may differ; the layout must not). Frozen parameters the state omitted keep
  // the values they have. Error(kBadArgument) naming the file when it was
  // written for another world size, rank or model, Error(kIo) for a short or
  // unreadable file. Every rank calls it before the next pre_op.
  void load_state(const std::filesystem::path& dir);
  // The Adam moments by parameter (a trainer's optimizer state_dict): this
  // rank's elements of every trained parameter, sink(id, first, count,
  // exp_avg, exp_avg_sq) for elements [first, first + count) of parameter id
  // (flattened), host views valid during the call. One pass over the state
  // (each sub-group read once from NVMe); every owned element of a trained
  // parameter is given once, frozen ones never. write_moments replaces them:
  // fill writes the same ranges (the padding between parameters gets zero),
  // the fp32 master weights are kept and the Adam step count becomes
  // `step_count`. Between steps only, like save_state; not collective.
  using MomentSinkFn =
      std::function<void(ParamId id, int64_t first, size_t count, const float* exp_avg, const float* exp_avg_sq)>;
  using MomentFillFn = std::function<void(ParamId id, int64_t first, size_t count, float* exp_avg, float* exp_avg_sq)>;
  void read_moments(const MomentSinkFn& sink);
  void write_moments(const MomentFillFn& fill, int64_t step_count);
  // Bytes this rank's engine moved between NVMe and host memory so far
  // (parameter shards and optimizer state; 0 without an nvme tier).
  uint64_t nvme_bytes_read() const;
  uint64_t nvme_bytes_written() const;
  // Multiply the loss by this before backward (ForwardOptions::grad_scale):
  // the fp16 loss scale of the coming step, 1 without loss scaling. step()
  // divides it out, skips a step whose gradients overflow and adjusts it.
  double loss_scale() const { return loss_scaler_.scale(); }
  const LossScaler& loss_scaler() const { return loss_scaler_; }

  // Bytes of full parameters gathered now and at most since finalize (stage 3).
  size_t gathered_nbytes() const;
  size_t peak_gathered_nbytes() const;
  // Parameter allgathers issued so far (stage 3: one per gather of a parameter).
  int64_t gathers_issued() const;
  // The coordinator's counts for the last completed step (step() closes one)
  // and for the step running now (stage 3; empty otherwise).
  PrefetchStats last_step_prefetch() const;
  PrefetchStats current_prefetch() const;
  // Times the operator trace was dropped since construction.
  int64_t trace_drops() const;
  // The tensor group's collectives since construction (Megatron's f and g;
  // with sequence parallelism their allgathers and reduce-scatters) and their
  // bytes: each call's whole buffer (the full tensor of an allgather or
  // reduce-scatter), as nccl-tests size them.
  struct TensorTraffic {
    int64_t allreduces = 0, allgathers = 0, reduce_scatters = 0;
    uint64_t bytes = 0;
  };
  TensorTraffic tensor_traffic() const { return tensor_traffic_; }

 private:
  // Refuses a tp_allgather / tp_reduce_scatter pair of views that do not match.
  void check_tp_pair(const char* op, const TensorView& local, const TensorView& full) const;
  // Runs a tensor-group collective that submit() enqueues on the tensor
  // stream (returning its completion) in the compute stream's order.
  template <typename Submit>
  void on_tensor_stream(Submit&& submit);
  // One dtype group: its layout (the single source of shard offsets), this
  // rank's shard at home, its gradient shard and reducer.
  struct Group {
    DType dtype = DType::kF32;
    bool frozen = false;                     // every member frozen: no gradient shard, reducer or optimizer
    // Experts this rank holds (expert parallelism): partitioned over the
    // expert-dp group, gathered and reduced on its communicators.
    bool expert = false;
    // Shards of tensors split across the tp group (ParamInfo::tp_split);
    // counted: the gradient norm's (not a copy of a block a lower tp rank
    // holds too, ParamInfo::tp_copies); stage_copy: a tensor another pipeline
    // stage holds too (ParamInfo::stage_peer), on the higher of the two,
    // whose gradient the norm does not count. suffix names their files: "_tp",
    // "_tp_copy", "" — then "_pp_copy" for a stage copy.
    bool tp_split = false;
    bool tp_counted = true;
    bool stage_copy = false;
    // "_tp", "_tp_copy", then "_pp_copy" for a tensor another pipeline stage counts.
    std::string suffix;
    // Parameters with their own weight decay (ParamInfo::weight_decay, not
    // the optimizer's): that decay, and "_wd<decay>" naming their files.
    std::optional<float> weight_decay;
    std::string decay_suffix;
    // Parameters with their own lr scale (ParamInfo::lr_scale, not 1): that
    // scale, and "_lr<scale>" naming their files after the decay's suffix.
    float lr_scale = 1.0f;
    std::string lr_suffix;
    std::string key;                         // names its files: "fp32", "bf16_frozen", "fp32_experts", "fp32_wd0"
    partition::Communicator* gather_comm = nullptr;
    partition::Communicator* reduce_comm = nullptr;
    int shard = -1;                          // its index among the optimizer's shards (trainable groups)
    std::vector<ParamId> params;
    std::unique_ptr<partition::PartitionLayout> layout;
    std::unique_ptr<offload::ParamHome> home;
    std::unique_ptr<offload::GradShard> grads;        // this rank's fp32 gradient shard (memory or nvme)
    std::unique_ptr<offload::BucketReducer> reducer;  // after grads: destroyed first (its stream writes them)
    void* full_flat = nullptr;               // stages 1/2: every full parameter
    std::vector<size_t> full_offset;         // per member: offset in full_flat
  };
  void on_finalize() override;
  // Stage 3 keeps frozen FP8 and MXFP4 weights so (the stages 1/2 keep full copies on the accelerator).
  bool keeps_blocks() const override { return options_.stage == 3; }
  // fn(first, host) over parameter id's owned range, host a view of `dtype`
  // elements of its home (for_each_owned_range and write_blocks).
  void owned_home_range(ParamId id, Access access, DType dtype, const RangeFn& fn);
  void on_skip_op(OpId op, Phase phase) override;
  void on_grad_ready(ParamId id, Event& ready) override;
  TensorView stage_shared_grad(ParamId id) override;
  void on_stage_grad_summed(ParamId id) override;
  void create_group(Group& g);      // finalize: layout, home, gradient shard, reducer
  // Where a trained group's parameters live: offload_param's tier, except
  // with the optimizer on the accelerator, which updates them there (then
  // offload_param moves the frozen groups only).
  Tier trained_param_tier() const {
    return options_.optimizer_tier == Tier::kDevice ? Tier::kDevice : options_.param_tier;
  }
  void sync_full_params();          // stages 1/2: allgather every group into the full copies
  void refresh_copies();            // the homes changed: copies are stale (re-gathered when next needed)
  void check_not_prepared(const char* what) const;
  // The update overlapping the next forward can run here (see overlap_next_forward).
  bool update_can_overlap_forward() const;
  // Joins the update step() handed over (if any): waits, then zeroes the
  // gradient shards step() left to it. On its error the step is undone (step
  // count, copies) and the error rethrown.
  void finish_update();
  // The step boundary: the trace closed, every gradient reduced into the
  // shards, the optimizer thread settled, the global statistics taken.
  struct GradBoundary {
    kernels::GradStats global;
    double nonfinite_ranks = 0;
    double grad_wait_seconds = 0, drain_seconds = 0, norm_seconds = 0;
  };
  GradBoundary reach_boundary();
  void arm_step(float lr);          // prepare_step's work: the optimizer armed for the coming backward(s)
  int prepared_backwards_ = 1;      // prepare_step's backwards
  void zero_grad_shards();          // the gradient shards zero (their reducers synchronized)
  void check_no_backward(const char* what) const;
  void note_written(ParamId id);    // after a kWrite range: copies and master weights are stale
  TensorView grad_buffer(ParamId id, bool for_host);  // grad() and host_grad()
  // The trained parameters' owned elements within shard elements [first,
  // first + numel) of group g: fn(id, first element in the parameter,
  // offset in the range, count).
  template <typename Fn>
  void for_each_param_in(const Group& g, size_t first, size_t numel, Fn&& fn) const;
  // f64 sum over `comm` (the control communicator unless given) on `stream`
  // (the control stream unless given); blocks.
  void allreduce_f64(double* values, size_t count, partition::Communicator* comm = nullptr,
                     Stream* stream = nullptr);
  Group& group_of(ParamId id) { return *groups_[static_cast<size_t>(group_of_[static_cast<size_t>(id)])]; }
  // This rank holds the parameter (not an expert another ep member owns).
  bool holds(ParamId id) const { return group_of_[static_cast<size_t>(id)] >= 0; }

  ZeroComms comms_;
  ZeroEngineOptions options_;
  ZeroSizes zero_sizes_;
  std::unique_ptr<Stream> gather_stream_, control_stream_;
  std::unique_ptr<Stream> exchange_stream_;        // expert parallelism: the token all_to_alls
  std::unique_ptr<Stream> tensor_stream_;          // tensor parallelism: the tp group's allreduces
  std::unique_ptr<Stream> context_stream_;         // context parallelism: the model's ring transfers
  std::unique_ptr<Stream> pipeline_stream_;        // pipeline parallelism: the pp group's norm and job sums
  TensorTraffic tensor_traffic_;
  // Host <-> home and gradient-shard copies of the optimizer, init, checkpoints
  // (ParamHome::host_range, GradShard::read): synchronized by each use.
  std::unique_ptr<Stream> home_stream_;
  std::unique_ptr<nvme::AioHandle> aio_;           // when a tier is nvme
  std::unique_ptr<nvme::SwapSpace> grad_swap_;     // grad_tier nvme: the gradient files
  std::unique_ptr<offload::HostWindow> window_;    // the homes' pinned window (before groups_)
  // One stream per reduce communicator, shared by the groups' reducers over it (before groups_).
  std::map<partition::Communicator*, std::unique_ptr<Stream>> reduce_streams_;
  std::vector<std::unique_ptr<Group>> groups_;     // per (dtype, frozen), in order of first declaration
  std::vector<int> group_of_;                      // per parameter; -1: not held (another ep member's expert)
  std::vector<size_t> index_in_group_;             // per parameter
  std::vector<float*> grad_full_;                  // per parameter: its full fp32 gradient (stage 1: resident)
  void* stage1_grads_ = nullptr;                   // stage 1: every full fp32 gradient
  size_t stage1_grads_nbytes_ = 0;
  // Parameters kept block-quantized (ParamInfo::blocks): each one's whole
  // scale grid (QuantBlocks::scale_dtype), on the host (for_each_owned_range's
  // dequantization) and, for FP8, in accelerator memory (the gathers'; MXFP4's
  // gathers carry their scales), indexed by parameter (null: not kept so).
  struct KeptScales {
    std::vector<uint8_t> host;
    void* device = nullptr;
  };
  std::vector<std::unique_ptr<KeptScales>> kept_scales_;
  std::unique_ptr<ops::ComputeContext> gather_ctx_;  // the gathers' dequantization (with any parameter kept so)
  std::unique_ptr<offload::ParamCoordinator> coordinator_;  // stage 3; before groups_ die
  std::unique_ptr<offload::ShardOptimizer> optimizer_;      // after the groups it borrows
  offload::OverlapPolicy overlap_policy_ = offload::OverlapPolicy::kAuto;  // set_overlap_policy, kept for finalize
  void* control_buffer_ = nullptr;                 // allreduce_f64: control_slots_ doubles, accelerator memory
  size_t control_slots_ = 0;
  int64_t steps_ = 0;
  bool update_pending_ = false;      // step() handed its update over; finish_update() not yet
  std::optional<float> deferred_prepare_;  // prepare_step's lr while an update was pending: armed at the join
  double update_seconds_ = 0;        // the last finished update's thread time (StepResult::previous_update_seconds)
  // The last join: when the compute stream reached it (0: not yet), and when it returned.
  std::shared_ptr<std::atomic<int64_t>> join_reached_;
  int64_t join_end_ns_ = 0;
  LossScaler loss_scaler_;
  std::unique_ptr<Event> compute_point_, gather_point_;
  bool full_params_stale_ = false;   // stages 1/2: shards written since the last gather
  bool evaluating_ = false;          // between begin_evaluation and end_evaluation
  std::optional<GradBoundary> boundary_;  // clip_grad_norm() reached it; step() takes it
  std::optional<double> clip_override_;   // clip_grad_norm()'s max_norm for the coming step
};

}  // namespace strata::engine
