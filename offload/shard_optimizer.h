// ShardOptimizer: the Adam/AdamW optimizer of this rank's shards, one per
// dtype group, for the ZeroEngine (docs/DESIGN.md §5.2). Per group, one of
// two implementations:
//   OptimizerSwapper (offload_optimizer.device cpu or nvme): fp32
//       master weights and moments in host memory or swapped from NVMe,
//       updated by the CPU Adam sub-group by sub-group, the gradient streamed
//       from the GradShard and the new values streamed into the ParamHome —
//       so host memory is bounded by sub_group_size, not by the model;
//   DeviceOptimizer (none): state in accelerator memory, one pass of
//       Ops::adam_step over the shard.
// Statistics of the gradient (sum of squares, finiteness) are taken per
// sub-group and merged in sub-group order whoever computed them, so the global
// norm has the same bits on every tier and with or without overlap.
//
// The optimizer overlapping backward (stages 2/3, cpu or nvme state,
// `overlap`): after prepare(), the last backward counts down each sub-group's
// parameters as the BucketReducer lands their blocks in the gradient shard;
// a sub-group whose every parameter has landed is final, and the optimizer
// thread updates it then — speculating that the step applies unclipped (every
// gradient finite, the global norm within gradient_clipping: the grad scale
// prepare() was given, the same lr and loss scale). apply() updates the
// sub-groups left and commits; when the speculation was wrong it rolls back
// exactly (the state saved before each update, or the NVMe slot never
// committed; the home rewritten from the restored master weights) and takes
// the step as if nothing had been speculated. So a result never depends on
// the overlap. Granularity is the sub-group: a shard of one sub-group
// overlaps nothing. With NVMe state the speculating thread also reads state
// ahead of the gradient, into the pool buffers the pipeline can spare: at
// arming, of the sub-groups the previous backward finalized last (the
// embedding's: no backward is left to hide their reads behind), and between
// landings, of the next ones in that order.
//
// When clipping fires, every speculative update is redone, and nothing was
// hidden. So there is a second way to use backward, read-ahead: what does
// not depend on the global norm is taken before it is known — as a
// sub-group becomes final the thread takes its gradient statistics, and
// (NVMe) the arming reads committed state into the free pipeline buffers in
// shard order (the embedding's first: final last, needed first by the next
// forward) — and apply() is left only the arithmetic (and the reads no
// buffer was free for). Per step the thread
// speculates, or reads ahead when the previous prepared step clipped
// (OverlapPolicy::kAuto; before any step, when clipping can fire at all):
// speculation wins when clipping is rare, read-ahead loses nothing when it
// fires. Both give the bits of the step taken in apply() alone. With the
// update overlapping the next forward (apply_async below) the choice is the
// same: what speculation does not reach, and a read-ahead step's whole
// update, then run behind the next forward.
//
// A step at the boundary: settle() (the thread's last sub-groups), grad_stats()
// (this rank's merged statistics), then apply() — or abort() when the step is
// skipped or fails, which closes whatever is open without applying it.
//
// The update overlapping the next forward (apply_async, cpu or nvme state):
// once the norm is known only the arithmetic and the write-back are left, and
// the next forward needs the parameters in shard order (declaration order:
// the embedding, then layer by layer). apply_async hands the sub-groups left
// and the commit to the optimizer thread in that order and returns; each
// sub-group's new values in the home complete an event (home_ready) that the
// parameter coordinator orders the next forward's gathers of that range
// after, so the forward starts on a layer as soon as its parameters are
// updated. finish() joins it (before the gradient shard is touched again, a
// checkpoint, another step) and rethrows its error after rolling the step
// back as a failed apply() is. The same sub-groups are updated with the same
// inputs, so the bits are apply()'s.
//
// Ownership: borrows the accelerator, the Ops, the home stream, the I/O handle
// and every shard's layout, home, gradient shard and reducer, which must
// outlive it; owns the optimizer state, its pinned pools and (after an
// overlapping prepare) the optimizer thread, joined at destruction.
// Thread-safety: one training thread drives it; the reducers' stream threads
// report landings (internally synchronized).
// Errors: Error(kBadArgument) for prepare() twice or a bad lr; Error(kIo) from
// the NVMe state or the homes; the thread's first failure is rethrown by
// settle(). A failed apply() leaves the state of the last committed step once
// abort() has run (NVMe always; cpu state only for a speculated step).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <optional>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "offload/optimizer_swapper.h"
#include "offload/param_home.h"
#include "partition/layout.h"
#include "offload/bucket_reducer.h"
#include "offload/device_optimizer.h"
#include "offload/grad_shard.h"

namespace strata::offload {

class PinnedBufferPool;

// The layout's sub-group length in elements: sub_group_numel rounded up to the
// alignment, at most the shard; every sub-group but the last is this long, so
// sub-group k starts at k times it (an aligned range of every shard file).
size_t sub_group_stride(const partition::PartitionLayout& layout, DType dtype, int64_t sub_group_numel);

// How the optimizer thread uses the last backward of a prepared step.
enum class OverlapMode {
  kSpeculate,  // updates each final sub-group with the unclipped scale; redone when clipping fires
  kReadAhead,  // takes each final sub-group's statistics and (NVMe) reads its state; updates at apply()
};
enum class OverlapPolicy {
  kAuto,       // kReadAhead when the last prepared step clipped (before any: when clipping is on), else kSpeculate
  kSpeculate,  // always
  kReadAhead,  // always
};
const char* overlap_mode_name(OverlapMode mode);

struct ShardOptimizerOptions {
  Tier tier = Tier::kCpu;          // offload_optimizer.device: kDevice (none), kCpu or kNvme
  kernels::AdamConfig adam;
  int64_t sub_group_numel = 1'000'000'000;  // sub_group_size
  int threads = 0;                 // CPU Adam threads; 0: OpenMP default
  size_t buffer_count = 4;         // pinned buffers of the NVMe pipeline (offload_optimizer.buffer_count)
  std::filesystem::path nvme_path;
  int rank = 0;
  bool keep_files = false;         // nvme: leave the state files on disk (strata.keep_swap_files)
  bool overlap = true;             // prepare() arms the optimizer thread (cpu/nvme, stages 2/3)
  bool clipping = false;           // gradient_clipping is on: a step may clip (kAuto's first guess)
  OverlapPolicy policy = OverlapPolicy::kAuto;
};

// One dtype group's shard as the optimizer sees it.
struct OptimizedShard {
  DType dtype = DType::kF32;
  const partition::PartitionLayout* layout = nullptr;
  ParamHome* home = nullptr;  // where the new values go
  GradShard* grads = nullptr;          // where the final gradient is
  BucketReducer* reducer = nullptr;    // lands the gradient (the overlap counts its landings)
  std::string name;                    // names its state files ("optimizer_<name>"); empty: the dtype's
  std::optional<float> weight_decay = std::nullopt;  // its own AdamW decay; nullopt: ShardOptimizerOptions::adam's
  float lr_scale = 1.0f;  // its lr is the step's times this (a trainer's parameter group with its own lr)
};

// What apply() did.
struct AppliedStep {
  int64_t sub_groups = 0;             // sub-groups updated (every group)
  int64_t sub_groups_overlapped = 0;  // of them, by the optimizer thread during backward (kept)
  double overlapped_seconds = 0;      // the thread's busy time before the boundary (kept)
  bool rolled_back = false;           // speculative updates were undone and redone
  // The thread's mode (nullopt: no thread this step), and of the sub-groups,
  // how many had their state read during backward (kReadAhead, NVMe).
  std::optional<OverlapMode> mode;
  int64_t sub_groups_read_ahead = 0;
  // Speculating (NVMe, kept): sub-groups whose state was read before their
  // gradient was final, in the order the previous backward finalized them —
  // the last ones at arming, the next ones while the thread waited.
  int64_t sub_groups_prefetched = 0;
  bool clipped = false;               // the step's scale was not prepare()'s (clipping fired)
  // Why the speculation did not hold (nullptr: it did, or nothing was
  // speculated), and whether more than one backward followed prepare().
  const char* redo_reason = nullptr;
  bool landed_twice = false;
};

class ShardOptimizer {
 public:
  ShardOptimizer(Accelerator& accelerator, ops::Ops& ops, Stream& home_stream, nvme::AioHandle* aio,
                 ShardOptimizerOptions options, std::vector<OptimizedShard> shards);
  ~ShardOptimizer();
  ShardOptimizer(const ShardOptimizer&) = delete;
  ShardOptimizer& operator=(const ShardOptimizer&) = delete;

  // The homes changed under the optimizer (finalize, a parameter written):
  // its master weights are re-read from them before the next update.
  void mark_stale() { stale_ = true; }
  // Master weights = the homes (widened), moments zero — when stale. A
  // device home must be idle for the home stream (the caller orders it).
  void initialize_if_stale();

  // ---- the step in parts -----------------------------------------------------------
  // The next backward is the last before apply(lr, ...): with `overlap`, arms
  // the countdown and the thread, speculating `grad_scale` (the loss scale
  // divided out, no clipping) and `loss_scale`. Collective (a reducer's open
  // bucket is flushed). Error(kBadArgument) when already prepared.
  // `backwards`: the backward passes each parameter's gradient still lands
  // from before apply() (layer-major runs each layer's m backwards in a row:
  // m); a sub-group is final once each member landed that many times.
  void prepare(float lr, float grad_scale, double loss_scale, int backwards = 1);
  bool prepared() const { return prepared_; }
  // How later prepare()s choose the thread's mode.
  void set_policy(OverlapPolicy policy) { options_.policy = policy; }
  // Waits for the thread's last sub-groups, those queued for it included
  // (once no landing can come: the reducers synchronized); returns the
  // seconds waited; rethrows its error.
  double settle();
  // This rank's gradient statistics: every sub-group's, merged in order —
  // of the shards s with include[s] non-zero (empty: every shard).
  kernels::GradStats grad_stats(std::span<const uint8_t> include = {});
  // The step with `grad_scale` (kernels::combined_grad_scale) at `lr`:
  // speculated sub-groups kept when the speculation holds, else rolled back;
  // the rest updated; every group committed. Closes the step.
  AppliedStep apply(float lr, float grad_scale, double loss_scale);
  // apply(), but the updates left (after waiting for each of `after`: the
  // last readers of the homes) and the commit run on the optimizer thread;
  // returns once they are handed over, with what apply() returns but the
  // thread's work. Until finish(), nothing but finish(), updating(),
  // home_ready() and home_stride() may be called. Every group must be on the
  // cpu or nvme tier (Error(kBadArgument) otherwise).
  AppliedStep apply_async(float lr, float grad_scale, double loss_scale, std::vector<std::shared_ptr<Event>> after);
  // An apply_async's work is handed over and not yet finished.
  bool updating() const { return updating_; }
  // Shard s's per-sub-group events of the last apply_async: ready[k] completes
  // once sub-group k's new values are in its home (already complete for those
  // updated during backward), or fails with the update's error. Valid until
  // the next apply_async.
  const std::vector<std::shared_ptr<HostEvent>>& home_ready(size_t s) const;
  // Shard s's sub-group length (elements of its home): sub-group k is [k x it, (k + 1) x it).
  size_t home_stride(size_t s) const;
  // Waits for the work apply_async handed over. On its error, the step is
  // rolled back (the homes rewritten from the committed master weights, as
  // abort() does; cpu state keeps what a failed apply() keeps) and the error
  // rethrown. No-op without one.
  struct Finished {
    double wait_seconds = 0;  // the caller blocked here
    double busy_seconds = 0;  // the thread's time on the work
  };
  Finished finish();
  // Closes the step without applying anything: the thread settled, every
  // speculative update rolled back (the homes rewritten), open steps aborted.
  // Returns whether the step had been speculated (and so was rolled back).
  bool abort();

  // Joins the optimizer thread (after its current batch): no sub-group is
  // updated after this. The destructor calls it too.
  void stop();

  // ---- checkpoints -----------------------------------------------------------------
  // Shard `s`'s committed state in order, in chunks: sink(first, numel,
  // master, exp_avg, exp_avg_sq), host views valid during the call.
  using StateSinkFn = std::function<void(size_t first, size_t numel, const float* master, const float* exp_avg,
                                         const float* exp_avg_sq)>;
  void save(size_t s, const StateSinkFn& sink);
  // Sets shard `s`'s state from fill(first, numel, master, exp_avg,
  // exp_avg_sq) and the step count; no longer stale.
  using StateFillFn =
      std::function<void(size_t first, size_t numel, float* master, float* exp_avg, float* exp_avg_sq)>;
  void restore(size_t s, const StateFillFn& fill, int64_t step_count);

 private:
  struct Group;
  struct Overlap;
  // One apply()'s decisions at the boundary.
  struct Boundary {
    AppliedStep applied;
    bool keep = false;             // the speculated sub-groups stand
    bool read_ahead_step = false;  // the thread read ahead: the step is open, inputs to set
  };
  Boundary open_boundary(float lr, float grad_scale, double loss_scale);
  void set_step(Boundary& b, float lr, float grad_scale);  // inputs and lr of every group's step
  void update_rest(const Boundary& b);                     // swapper groups: the updates left, then commit
  void close_boundary(Boundary& b);                        // the thread's figures; the step closed
  void check_not_updating(const char* what) const;
  bool overlaps() const;
  OverlapMode choose_mode() const;
  void arm(float lr);
  void read_ahead(Group& g, const std::vector<size_t>& sub_groups);
  void prefetch_next();  // the optimizer thread, speculating, between landings
  void finish_other_writes(const Group& g);  // before g's pipeline takes buffers
  void take_stats(Group& g, size_t k);
  void on_landed(size_t group, const std::vector<size_t>& params);  // a reducer stream's host function
  void thread_main();
  double settle_thread(bool take_queued);
  bool roll_back();
  StepInputs step_inputs(Group& g, float grad_scale);

  Accelerator& accelerator_;
  Stream& home_stream_;
  ShardOptimizerOptions options_;
  std::vector<std::unique_ptr<PinnedBufferPool>> pools_;  // nvme staging
  std::vector<std::unique_ptr<Group>> groups_;
  bool stale_ = true;
  bool prepared_ = false;
  bool armed_ = false;               // prepared with the thread armed (in mode_)
  OverlapMode mode_ = OverlapMode::kSpeculate;
  bool last_clipped_ = false;        // the last prepared, applied step clipped (kAuto)
  bool updating_ = false;            // apply_async's work handed over, finish() not yet called
  std::vector<std::vector<std::shared_ptr<HostEvent>>> home_ready_;  // per shard: apply_async's events
  std::unique_ptr<Overlap> overlap_;  // joined first in the destructor
};

}  // namespace strata::offload
