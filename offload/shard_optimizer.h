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
// overlaps nothing.
//
// A step at the boundary: settle() (the thread's last sub-groups), grad_stats()
// (this rank's merged statistics), then apply() — or abort() when the step is
// skipped or fails, which closes whatever is open without applying it.
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

struct ShardOptimizerOptions {
  Tier tier = Tier::kCpu;          // offload_optimizer.device: kDevice (none), kCpu or kNvme
  kernels::AdamConfig adam;
  int64_t sub_group_numel = 1'000'000'000;  // sub_group_size
  int threads = 0;                 // CPU Adam threads; 0: OpenMP default
  size_t buffer_count = 3;         // pinned buffers of the NVMe pipeline
  std::filesystem::path nvme_path;
  int rank = 0;
  bool keep_files = false;         // nvme: leave the state files on disk (strata.keep_swap_files)
  bool overlap = true;             // prepare() arms the optimizer thread (cpu/nvme, stages 2/3)
};

// One dtype group's shard as the optimizer sees it.
struct OptimizedShard {
  DType dtype = DType::kF32;
  const partition::PartitionLayout* layout = nullptr;
  ParamHome* home = nullptr;  // where the new values go
  GradShard* grads = nullptr;          // where the final gradient is
  BucketReducer* reducer = nullptr;    // lands the gradient (the overlap counts its landings)
};

// What apply() did.
struct AppliedStep {
  int64_t sub_groups = 0;             // sub-groups updated (every group)
  int64_t sub_groups_overlapped = 0;  // of them, by the optimizer thread during backward (kept)
  double overlapped_seconds = 0;      // the thread's busy time before the boundary (kept)
  bool rolled_back = false;           // speculative updates were undone and redone
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
  void prepare(float lr, float grad_scale, double loss_scale);
  bool prepared() const { return prepared_; }
  // Waits for the thread's last sub-groups (once no landing can come: the
  // reducers synchronized); returns the seconds waited; rethrows its error.
  double settle();
  // This rank's gradient statistics: every sub-group's, merged in order.
  kernels::GradStats grad_stats();
  // The step with `grad_scale` (kernels::combined_grad_scale) at `lr`:
  // speculated sub-groups kept when the speculation holds, else rolled back;
  // the rest updated; every group committed. Closes the step.
  AppliedStep apply(float lr, float grad_scale, double loss_scale);
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
  bool overlaps() const;
  void arm(float lr);
  void on_landed(size_t group, const std::vector<size_t>& params);  // a reducer stream's host function
  void thread_main();
  double settle_thread();
  bool roll_back();
  StepInputs step_inputs(Group& g, float grad_scale);

  Accelerator& accelerator_;
  Stream& home_stream_;
  ShardOptimizerOptions options_;
  std::vector<std::unique_ptr<PinnedBufferPool>> pools_;  // nvme staging
  std::vector<std::unique_ptr<Group>> groups_;
  bool stale_ = true;
  bool prepared_ = false;
  bool speculating_ = false;         // prepared with the thread armed
  std::unique_ptr<Overlap> overlap_;  // joined first in the destructor
};

}  // namespace strata::offload
