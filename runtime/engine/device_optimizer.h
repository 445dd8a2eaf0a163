// DeviceOptimizer: the optimizer of one dtype group when its state stays on
// the accelerator (offload_optimizer.device none, ENGINE.md §5): the fp32
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
// Error(kBadArgument) for ranges outside the shard.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "runtime/core/accelerator.h"

namespace strata::engine {

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

  // Checkpoints: state elements [first, first + count) to or from host memory.
  void read_state(size_t first, size_t count, float* master, float* exp_avg, float* exp_avg_sq);
  void write_state(size_t first, size_t count, const float* master, const float* exp_avg,
                   const float* exp_avg_sq);
  void set_step_count(int64_t step_count);

 private:
  TensorView view(float* base, size_t first, size_t count) const;
  void check_range(size_t first, size_t count) const;

  Accelerator& accelerator_;
  ops::Ops& ops_;
  Stream& stream_;
  std::unique_ptr<ops::ComputeContext> ctx_;
  const size_t numel_;
  const size_t sub_group_numel_;
  const size_t sub_group_count_;
  kernels::AdamConfig adam_;
  int64_t step_count_ = 0;
  float* master_ = nullptr;  // numel fp32 each
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
  double* sums_ = nullptr;  // per sub-group sum of squares (accelerator memory)
};

}  // namespace strata::engine
