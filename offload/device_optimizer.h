// DeviceOptimizer: the optimizer of one dtype group when its state stays on
// the accelerator (offload_optimizer.device none, docs/DESIGN.md §5.2): the fp32
// master weights and both Adam moments of this rank's shard in accelerator
// memory, updated there by Ops::adam_step — CUDA kernels on a GPU, the CPU
// Adam kernel on the cpu accelerator (whose memory is host memory). The
// gradient is read where GradShard keeps it in accelerator memory, and the
// new values are written straight into the parameter home, so a step moves
// nothing between host and device.
//
// Sub-groups. Its statistics are taken per sub-group (the layout's, as the
// OptimizerSwapper's) and merged by the caller in sub-group order, so on the
// cpu accelerator the global norm has the bits of the cpu and nvme tiers'
// norm, and a step equals theirs bit for bit. The update itself is
// elementwise: one call covers the shard.
//
// There is no speculation: a step on the accelerator is one pass at memory
// bandwidth (16 bytes read and 12 written per element), too short to hide
// behind backward for what rolling back would cost.
//
// Ownership: borrows the accelerator, the Ops and the stream, which must
// outlive it; owns its state memory.
// Thread-safety: one thread drives it. Every call that returns data (or
// finishes a step) synchronizes its stream first.
// Errors: Error(kOutOfMemory) from the allocation when the accelerator's
// budget is too small for 12 bytes per element; errors of the stream's work
// (a failed kernel) are rethrown by the call that synchronizes;
// Error(kBadArgument) for a negative step count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "core/accelerator.h"
#include "core/tensor.h"

namespace strata::offload {

class DeviceOptimizer {
 public:
  // numel: elements of this rank's shard; sub_group_numel: the layout's
  // sub-group length (the last sub-group may be shorter).
  DeviceOptimizer(Accelerator& accelerator, ops::Ops& ops, Stream& stream, size_t numel,
                  size_t sub_group_numel, kernels::AdamConfig adam);
  ~DeviceOptimizer();
  DeviceOptimizer(const DeviceOptimizer&) = delete;
  DeviceOptimizer& operator=(const DeviceOptimizer&) = delete;

  size_t numel() const { return numel_; }
  size_t sub_group_count() const { return sub_group_count_; }
  // (first element, element count) of sub-group k.
  std::pair<size_t, size_t> sub_group_range(size_t k) const;
  int64_t step_count() const { return step_count_; }
  void set_lr(float lr);

  // Master weights = `params` (numel elements of `dtype` in accelerator
  // memory) widened to fp32; moments zero; step count 0.
  void initialize(const void* params, DType dtype);
  // The statistics of `grad` (numel fp32 in accelerator memory), one per
  // sub-group in order, once the stream's earlier work has run.
  std::vector<kernels::GradStats> grad_stats(const float* grad);
  // Step step_count() + 1 over the whole shard with grad * grad_scale; the new
  // values go into `params` (numel elements of `dtype` in accelerator memory:
  // the 16-bit copy of the master, or an fp32 copy). Returns once done.
  void step(const float* grad, float grad_scale, void* params, DType dtype);

  // Checkpoints pass the state through host memory in chunks of at most
  // kStateChunkNumel elements per array (16 MiB each), however large the
  // shard or its sub-groups. save: `sink(first, count, master, exp_avg,
  // exp_avg_sq)` for each chunk in order, host views valid during the call.
  // restore: as OptimizerSwapper::restore — `fill` writes each chunk, then the
  // step count is set.
  static constexpr size_t kStateChunkNumel = size_t{1} << 22;
  using StateSinkFn = std::function<void(size_t first, size_t count, const float* master, const float* exp_avg,
                                         const float* exp_avg_sq)>;
  using StateFillFn =
      std::function<void(size_t first, size_t count, float* master, float* exp_avg, float* exp_avg_sq)>;
  void save(const StateSinkFn& sink);
  void restore(const StateFillFn& fill, int64_t step_count);

 private:

  Accelerator& accelerator_;
  ops::Ops& ops_;
  Stream& stream_;
  std::unique_ptr<ops::ComputeContext> ctx_;
  const size_t numel_;
  const size_t sub_group_numel_;
  const size_t sub_group_count_;
  kernels::AdamConfig adam_;
  int64_t step_count_ = 0;
  Tensor master_, exp_avg_, exp_avg_sq_;  // fp32 [numel] each
  Tensor sums_;                           // fp64 [sub_group_count]: each sub-group's sum of squares
};

}  // namespace strata::offload
