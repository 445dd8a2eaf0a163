// ZeroEngine: Engine v2 with ZeRO stages 1, 2 and 3 (ENGINE.md §2–§5).
//
// Parameters are grouped by storage dtype; each group has one
// partition::PartitionLayout, the single source of shard offsets. Each rank
// keeps its shard of every group at home on the tier the options name:
//   stage 1/2: the shard in accelerator memory, plus every full parameter
//              resident (gathered after each optimizer step);
//   stage 3:   the shard in accelerator memory, pinned CPU memory, or a flat
//              per-rank NVMe file per group (`param_tier`); full parameters
//              are gathered by the parameter coordinator (below) on the
//              gather stream and communicator; the compute stream waits on the
//              gather's event, not the host. A parameter is released after
//              post_op with a stream-ordered free — except parameters of at
//              most `persistence_threshold_numel` elements, which stay
//              gathered until the next step changes them, and parameters the
//              trace says are used again within `max_reuse_distance_numel`.
// The stage-3 parameter coordinator (ENGINE.md §3, OperatorTrace):
//   trace:     the first step records its (operator, phase) windows; later
//              steps follow the trace while each pre_op matches the next entry.
//              A window that differs (or a step that ends early) drops the
//              trace with one log line (logger().info); the rest of that step
//              fetches on demand and the next step records afresh.
//   gg:        while following, pre_op issues the allgathers of upcoming ops'
//              parameters, in trace order, as long as the elements gathered
//              ahead of the current op stay within `prefetch_bucket_numel`
//              and everything gathered (the current op's included) within
//              `max_live_parameters_numel` (kept copies are released first
//              when the current op needs the room).
//   nc:        nvme home: shards are read NVMe→pinned staging by the I/O
//              engine with completion callbacks, many in flight, bounded by
//              `param_buffer_count` buffers of at most `param_buffer_numel`
//              elements; each read completes a HostEvent that the gather
//              stream waits on. Beyond gg's reach nc reads ahead, in trace
//              order, into buffers free now; a gather that finds none queues
//              its read for one engine thread, which submits it once the
//              gather stream is past the buffer's last reader. No thread
//              blocks per read, and the host blocks only when every buffer
//              holds a read no gather used (the trace changed) — counted in
//              PrefetchStats.
//   cg:        a non-cpu accelerator copies the pinned shard to device memory
//              on the gather stream right before its allgather (on the cpu
//              accelerator the allgather reads the pinned shard directly).
//   Allgathers are collectives: every decision that issues one depends only
//   on the trace, the budgets and what is gathered — the same on every rank.
//   Reads are local and may run as far ahead as staging allows. Prefetch
//   never changes a result: it moves the same bytes earlier.
// Gradients are summed in fp32 and never averaged: normalise the loss by the
// global number of predicted tokens (global_sum) instead, so N ranks equal one
// rank on the combined batch.
//   stage 1:   full fp32 gradients stay resident and accumulate over micro-steps;
//              step() reduce-scatters them in buckets.
//   stage 2/3: a full fp32 gradient exists only while a parameter's backward
//              runs; at its last use in backward it joins a bucket that is
//              reduce-scattered on its own stream and communicator and added into
//              this rank's fp32 gradient shard (BucketReducer), then freed.
//   The gradient shard (GradShard) lives in accelerator memory or, with
//   `grad_tier` nvme, in a file (ZeRO-Infinity's gradient swapping).
// step() is the optimizer at an accumulation boundary: the global gradient norm
// (f64 allreduce on the control communicator), clipping, a skip without any
// state change when a gradient is not finite (with fp16 loss scaling the scale
// then backs off, DeepSpeed's rule: LossScaler), Adam/AdamW on the CPU over this
// rank's shard through offload::OptimizerSwapper (state in CPU memory or on
// NVMe, `optimizer_tier`), and (stages 1/2) one allgather per group. The
// optimizer walks the layout's sub-groups and streams each: its gradient read
// from the shard, its new values written to the shard's home. So with every
// tier on NVMe, host memory is bounded by sub_group_size, the largest
// parameter slice and the buffers the options name — not by the model.
//
// The optimizer overlapping backward (stages 2/3, `overlap_optimizer`, the
// optimizer on cpu or nvme — on the accelerator a step is one pass at device
// memory bandwidth, nothing worth hiding): after
// prepare_step(lr), the last backward before step() counts down each
// sub-group's parameters as their reduced blocks land in the gradient shard;
// a sub-group whose every parameter has landed is final, and the optimizer
// thread updates it then — speculating that the step will apply unclipped
// (every gradient finite, the global norm within gradient_clipping, the same
// lr). step() computes the global norm, updates the sub-groups still left and
// commits; when the speculation was wrong it rolls back exactly (the state
// saved before each update, or the NVMe slot never committed; the parameter
// home rewritten from the restored master weights) and takes the step as if
// nothing had been speculated. So a result never depends on the overlap.
// Granularity is the sub-group (sub_group_size): a shard of one sub-group
// overlaps nothing.
//
// Collectives: every rank must make the same calls in the same order —
// finalize, prepare_step, the hooks of each step, for_each_owned_range (kWrite)
// before the next pre_op, global_sum and step.
//
// Not yet: the CUDA optimizer (the CPU one serves every backend; on cuda each
// sub-group's gradient is copied to pinned memory for it).
//
// Ownership: borrows the accelerator and the communicators (which must outlive
// it); owns storage, streams, swap files, the optimizer state, the I/O handle,
// (nvme home) the read-queue thread and (after prepare_step) the optimizer thread.
// Thread-safety and errors: see engine.h; collectives fail with
// Error(kCommunication), NVMe I/O with Error(kIo) — a prefetch read that fails
// fails its HostEvent, so the error reaches the gather and compute streams and
// surfaces from the step's next synchronize (loss, step()) on that rank; its
// peers' pending allgathers fail within the communicator's timeout.
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "kernels/optimizer.h"
#include "nvme/io_backend.h"
#include "nvme/io_options.h"
#include "offload/optimizer_swapper.h"
#include "partition/communicator.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/loss_scaler.h"
#include "runtime/engine/state_file.h"
#include "runtime/engine/operator_trace.h"

namespace strata::nvme {
class AioHandle;
class SwapSpace;
}
namespace strata::offload {
class PinnedBufferPool;
}

namespace strata::engine {

// Each traffic class has its own communicator (ENGINE.md §4); they may not be
// the same object, since each runs on its own stream.
struct ZeroComms {
  partition::Communicator* gather = nullptr;   // parameter allgathers
  partition::Communicator* reduce = nullptr;   // gradient reduce-scatters
  partition::Communicator* control = nullptr;  // norms, token counts (f64)
};

struct ZeroEngineOptions {
  int stage = 3;                           // 1, 2 or 3
  Tier param_tier = Tier::kDevice;         // offload_param.device; cpu/nvme need stage 3
  // offload_optimizer.device. kCpu or kNvme: the CPU Adam updates state in
  // host memory or swapped from NVMe (OptimizerSwapper). kDevice ("none"):
  // state in accelerator memory, updated there by Ops::adam_step (CUDA
  // kernels; the CPU Adam on the cpu accelerator); needs param_tier and
  // grad_tier kDevice and never overlaps backward (DeviceOptimizer).
  Tier optimizer_tier = Tier::kCpu;
  // This rank's fp32 gradient shard: accelerator memory (kDevice) or a file
  // under nvme_path (kNvme: ZeRO-Infinity's gradient swapping, so host memory
  // does not grow with the model; train::zero_engine_options picks it with an
  // nvme optimizer).
  Tier grad_tier = Tier::kDevice;
  std::filesystem::path nvme_path;         // swap files (either tier on nvme)
  bool keep_swap_files = false;            // strata.keep_swap_files: leave them on disk at the end
  int64_t reduce_bucket_numel = 500'000'000;        // DeepSpeed's reduce_bucket_size
  int64_t sub_group_numel = 1'000'000'000;          // DeepSpeed's sub_group_size
  int64_t persistence_threshold_numel = 100'000;    // stage3_param_persistence_threshold
  kernels::AdamConfig adam;
  double gradient_clipping = 0;            // max global norm; 0: no clipping
  nvme::AioOptions aio;                    // I/O engine for NVMe tiers
  size_t optimizer_buffer_count = 3;       // pinned buffers of the NVMe optimizer pipeline
  int optimizer_threads = 0;               // CPU Adam threads; 0: OpenMP default
  // Stages 2/3 with optimizer_tier cpu or nvme: after prepare_step, update
  // each sub-group during backward as soon as its gradient is final
  // (speculatively; see above). false: the optimizer runs in step() only.
  bool overlap_optimizer = true;

  // The stage-3 parameter coordinator, in elements (numel). Defaults are DeepSpeed's.
  int64_t prefetch_bucket_numel = 50'000'000;         // stage3_prefetch_bucket_size; 0: no prefetch
  int64_t max_live_parameters_numel = 1'000'000'000;  // stage3_max_live_parameters
  int64_t max_reuse_distance_numel = 1'000'000'000;   // stage3_max_reuse_distance
  // Pinned staging of NVMe→pinned reads, per dtype group: buffer_count
  // buffers of buffer_size elements of the group's dtype, each holding one
  // parameter's shard slice — clamped to the group's parameter count and
  // largest slice, so a small model does not pin gigabytes. A slice larger
  // than buffer_size is refused at finalize (as DeepSpeed does).
  size_t param_buffer_count = 5;                      // offload_param.buffer_count
  int64_t param_buffer_numel = 100'000'000;           // offload_param.buffer_size
  // For tests: makes the I/O engine's backend (e.g. nvme::make_fault_backend
  // around nvme::make_backend); empty: aio.engine's.
  std::function<std::unique_ptr<nvme::IoBackend>()> io_backend;

  // fp16: loss scaling (DeepSpeed's fp16.* keys); unset: a scale of 1 (bf16, fp32).
  std::optional<LossScalerOptions> loss_scaling;

  // Throws Error(kBadArgument) naming the option when inconsistent.
  void validate() const;
};

// Where compute waited for one operator's parameters in one step: the
// compute stream's time from reaching the op's pre_op waits to passing them,
// summed over the op's windows of one phase (stage 3).
struct OpStall {
  OpId op = -1;
  Phase phase = Phase::kForward;
  std::string name;      // the operator's name (op_info)
  int64_t windows = 0;   // windows of (op, phase) whose wait was timed
  double seconds = 0;    // compute-stream time spent at those waits
};

struct StallLog;  // written by the compute stream; zero_coordinator.cc

// What the stage-3 coordinator did in one step (from one step() to the next).
// A fetch is a parameter an operator needs at pre_op that was not still
// gathered from an earlier use: it was prefetched (complete or still in flight
// at pre_op) or gathered on demand there.
struct PrefetchStats {
  bool trace_followed = false;   // the step matched a recorded trace to its end
  bool trace_dropped = false;    // the step diverged from the trace (logged once)
  int64_t windows = 0;           // pre_op calls
  int64_t prefetched_ready = 0;  // fetches whose allgather had completed at pre_op
  int64_t prefetched_in_flight = 0;  // fetches issued ahead, still running at pre_op
  int64_t on_demand = 0;         // fetches issued at their op's pre_op
  int64_t reused = 0;            // uses served by a copy kept gathered (reuse distance,
                                 // persistence, an enclosing window)
  int64_t gathers = 0;           // allgathers issued (prefetch and on demand)
  uint64_t gather_nbytes = 0;    // bytes of full parameters those allgathers produce (this rank)
  int64_t reads = 0;             // NVMe→pinned reads issued
  int64_t reads_ahead = 0;       // of them, issued by nc's walk before a gather needed them
  int64_t reads_deferred = 0;    // of them, queued for a buffer the gather stream still reads
  uint64_t read_nbytes = 0;      // bytes of parameter shards those reads move (this rank)
  int64_t blocked_waits = 0;     // times pre_op blocked the host (every staging buffer held
                                 // by a read no gather used: after a trace change)
  double blocked_seconds = 0;    // host time pre_op spent blocked
  size_t peak_gathered_nbytes = 0;  // most bytes of full parameters gathered at once

  int64_t fetches() const { return prefetched_ready + prefetched_in_flight + on_demand; }
  int64_t prefetched() const { return prefetched_ready + prefetched_in_flight; }

  // Stall on parameters: how long the compute stream sat at pre_op's waits
  // for gathered parameters. Timed on the stream itself, by host functions
  // enqueued right before and right after the waits (cpu: on the stream's
  // thread; cuda: when the stream reaches them), so it means the same on
  // every backend: time compute could not run because a parameter was not
  // there. Only windows with a gather not yet complete at pre_op are timed
  // (the others cannot stall, and cost no host function). Stages 1/2: 0.
  // The stream writes these figures after pre_op returns, into a log this
  // struct's copies share: they are final once the compute stream has passed
  // the step's last timed wait — after a synchronize of it, and after step()
  // of a step whose last window produced gradients (step() waits for every
  // gradient bucket, each of which waits for compute). Work the stream skips
  // after an error is not timed. Thread-safe.
  double param_stall_seconds() const;
  int64_t stalled_windows() const;          // windows timed
  std::vector<OpStall> op_stalls() const;   // per (op, phase) timed, most seconds first
  std::shared_ptr<StallLog> stall_log;      // null: nothing timed (yet)
};

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
  // Of the optimizer's own time, the share compute waited for: the host time
  // step() spent on it over (that + the thread's hidden time, less the drain
  // the two overlap in). 1 without overlap.
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
  void zero_grad() override;
  void for_each_owned_range(ParamId id, Access access, const RangeFn& fn) override;

  int rank() const;
  int world_size() const;
  const ZeroEngineOptions& options() const { return options_; }

  // Sum of `value` over ranks (f64 allreduce on the control communicator);
  // collective, blocks. For the global count of predicted tokens.
  double global_sum(double value);
  // The optimizer at an accumulation boundary (see above); collective. `lr`
  // replaces options().adam.lr for this step (a schedule's value).
  StepResult step(float lr);
  // The next backward is the last before step(lr): the optimizer may update
  // sub-groups during it (overlap_optimizer, stages 2/3; otherwise this only
  // checks). Collective (it may reduce a partly filled gradient bucket): every
  // rank calls it after the previous micro-step's backward and before the
  // last micro-step's backward — before its forward is simplest. Until step()
  // (or zero_grad(), which abandons the step and rolls back) the parameters
  // may not be read or written through for_each_owned_range nor saved. A
  // different lr at step(), or more than one backward after this call, is
  // detected and redone exactly. Error(kBadArgument) when called twice
  // without a step() between.
  void prepare_step(float lr);
  // prepare_step was called and neither step() nor zero_grad() since.
  bool step_prepared() const;
  int64_t step_count() const;

  // ---- checkpoints (ENGINE.md §6) ---------------------------------------------------
  // Writes this rank's state into the existing directory `dir`: per dtype
  // group its parameter shard (params_<dtype>.bin, storage dtype) and its
  // optimizer state (master_, exp_avg_, exp_avg_sq_<dtype>.bin, fp32), then
  // engine.json (step count, loss scaler, the layout written). NVMe-resident
  // optimizer state is copied from its committed slot, which no step writes
  // between steps. Every file is durable (fsync, and the directory) before
  // this returns; the result names each with its size and CRC-32. Between
  // steps only (after step(), before the next pre_op); not collective.
  std::vector<StateFile> save_state(const std::filesystem::path& dir);
  // Loads what save_state wrote for this rank into this finalized engine:
  // parameters, optimizer state, step count, loss scaler (the stage and tiers
  // may differ; the layout must not). Error(kBadArgument) naming the file when
  // it was written for another world size, rank or model, Error(kIo) for a
  // short or unreadable file. Every rank calls it before the next pre_op.
  void load_state(const std::filesystem::path& dir);
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
  size_t gathered_nbytes() const { return gathered_nbytes_; }
  size_t peak_gathered_nbytes() const { return peak_gathered_nbytes_; }
  // Parameter allgathers issued so far (stage 3: one per gather of a parameter).
  int64_t gathers_issued() const { return gathers_issued_; }
  // The coordinator's counts for the last completed step (step() closes one)
  // and for the step running now.
  PrefetchStats last_step_prefetch() const { return last_prefetch_; }
  PrefetchStats current_prefetch() const { return prefetch_; }
  // Times the operator trace was dropped since construction.
  int64_t trace_drops() const { return trace_ ? trace_->drops() : 0; }

 private:
  struct Group;
  struct Gathered;
  void on_finalize() override;
  void on_grad_ready(ParamId id, Event& ready) override;
  struct Staging;
  struct ReadQueue;
  // Stage 3 coordinator.
  void fetch(ParamId id);           // pre_op: id gathered (now or before), compute waits
  void issue_gather(ParamId id, bool prefetch);  // cg + gg on the gather stream
  // nc: read id's slice into a staging buffer. ahead: only into a free one
  // (false when none is); else for a gather being issued (deferred to the
  // read queue when every buffer still has a reader queued).
  bool stage_read(ParamId id, bool ahead);
  void prefetch_from(size_t position);           // gg then nc along the trace
  void make_room(OpId op);          // max_live: release kept copies the current op needs the room of
  // Releases kept copies whose next use is after trace entry `after` (and,
  // with prefetched_too, unused prefetched copies) until `need` more elements fit.
  void release_kept(size_t after, int64_t need, bool prefetched_too);
  // The one log line of a drop; `got` is the window that diverged (nullopt:
  // the step ended early). Releases what was fetched for the lost future.
  void on_trace_dropped(const OperatorTrace::Advance& what, std::optional<OperatorTrace::Entry> got);
  void release_all_unused();        // every gathered copy no open window uses (persistent ones stay)
  void drain_staging();             // waits for every read into staging; forgets staged ones
  int64_t gathered_numel(ParamId id) const;
  bool persistent(ParamId id) const;
  // `after`: where compute's last use of the copy is; a copy compute never
  // used (prefetched) goes after its own gather instead.
  void release_gathered(ParamId id, Event& after);
  // Blocks until `need` more gathered elements fit max_live_parameters with
  // the copies compute may still read (releasing_) counted.
  void wait_for_room(int64_t need);
  void sync_full_params();          // stages 1/2: allgather every group into the full copies
  void init_optimizer();
  // The optimizer overlapping backward (zero_optimizer.cc).
  struct Overlap;
  void arm_groups(float lr);                    // prepare_step: each group's open step and countdown
  void on_landed(size_t group, const std::vector<size_t>& params);  // reducer stream's host function
  void overlap_main();                          // the optimizer thread
  double settle_overlap();                      // waits until the thread is idle; disarms; returns seconds waited
  void roll_back_speculation();                 // aborts every group's open step, rewrites the homes
  void abandon_speculation();                   // settle + roll back (zero_grad, destructor)
  bool overlaps_optimizer() const;              // prepare_step arms the optimizer thread
  // The optimizer inputs of group g: gradients streamed from the shard (their
  // statistics recorded per sub-group), new values to the home.
  offload::StepInputs step_inputs(Group& g, float grad_scale);
  void check_not_prepared(const char* what) const;
  void note_written(ParamId id);    // after a kWrite range: copies and master weights are stale
  bool home_is_host_addressable() const;
  // A host view of elements [first, first + numel) of the group's parameter
  // shard (aligned: slice or sub-group boundaries): the home itself when it is
  // host memory, else the pinned window (`load`: filled from the home first),
  // valid until the next call. store_home_range writes the window back.
  void* home_range(Group& g, size_t first, size_t numel, bool load);
  void store_home_range(Group& g, size_t first, size_t numel);
  // The largest range home_range serves for `g` (its largest slice or sub-group).
  size_t max_home_range_numel(const Group& g) const;
  // Calls fn(first, numel) over the whole shard in ranges home_range serves.
  void for_each_home_chunk(const Group& g, const std::function<void(size_t first, size_t numel)>& fn) const;
  void allreduce_f64(double* values, size_t count);  // control communicator, blocks

  ZeroComms comms_;
  ZeroEngineOptions options_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<int> group_of_;        // per parameter
  std::vector<size_t> index_in_group_;
  std::vector<std::unique_ptr<Gathered>> gathered_;  // per parameter
  std::vector<float*> grad_full_;    // per parameter: its full fp32 gradient (stage 1: resident)
  std::unique_ptr<Stream> gather_stream_, control_stream_;
  // Host <-> home and gradient-shard copies of the optimizer, init, checkpoints
  // (home_range, GradShard::read): synchronized by each use, one user at a time.
  std::unique_ptr<Stream> home_stream_;
  std::unique_ptr<nvme::AioHandle> aio_;           // when a tier is nvme
  std::unique_ptr<nvme::SwapSpace> grad_swap_;     // grad_tier nvme: the gradient files
  static constexpr size_t kControlSlots = 4;
  void* control_buffer_ = nullptr;                 // allreduce_f64: kControlSlots doubles, accelerator memory
  void* window_ = nullptr;                         // pinned: home_range of a non-host home
  size_t window_nbytes_ = 0;
  std::vector<std::unique_ptr<offload::PinnedBufferPool>> pools_;  // nvme optimizer staging
  offload::PinnedBufferPool* pool_ = nullptr;      // the newest (largest) of pools_
  void* stage1_grads_ = nullptr;                   // stage 1: every full fp32 gradient
  size_t stage1_grads_nbytes_ = 0;
  int64_t steps_ = 0;
  LossScaler loss_scaler_;
  int64_t gathers_issued_ = 0;
  std::unique_ptr<Event> compute_point_;
  std::unique_ptr<Event> gather_point_;  // the device optimizer's step waits for the gather stream here
  bool full_params_stale_ = false;   // stages 1/2: shards written since the last gather
  bool optimizer_stale_ = true;      // master weights must be (re)initialised from the shards
  size_t gathered_nbytes_ = 0, peak_gathered_nbytes_ = 0;
  int64_t live_numel_ = 0;           // elements gathered now (max_live_parameters)
  // Copies released at a post_op that compute may still read until it passes `after`.
  struct Releasing {
    std::shared_ptr<Event> after;
    int64_t numel = 0;
  };
  std::deque<Releasing> releasing_;
  int64_t releasing_numel_ = 0;
  std::unique_ptr<OperatorTrace> trace_;
  std::vector<size_t> window_position_;  // per open window: its trace entry, or npos
  std::vector<uint32_t> visited_;    // per parameter: walk generation (prefetch_from)
  uint32_t walk_ = 0;
  int64_t step_boundaries_ = 0;      // step() calls (for messages)
  uint64_t consumed_seq_ = 0;        // staging readers recorded on the gather stream so far
  std::unique_ptr<ReadQueue> read_queue_;  // nvme home; after aio_ (destroyed first)
  PrefetchStats prefetch_, last_prefetch_;
  std::unique_ptr<Overlap> overlap_;     // after prepare_step; destroyed (joined) first in ~ZeroEngine
};

}  // namespace strata::engine
