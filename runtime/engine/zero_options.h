// ZeroEngineOptions: what a ZeroEngine is asked to do — the stage, where each
// kind of state lives, the budgets and sizes, the optimizer — and the
// engine's own rules for them (validate). runtime/config/engine_options.cc is
// the one mapping from a ds_config's keys to these fields; its comments name
// the keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>

#include "core/tensor.h"
#include "kernels/optimizer.h"
#include "nvme/io_backend.h"
#include "nvme/io_options.h"
#include "runtime/engine/loss_scaler.h"

namespace strata::engine {

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
  // DeepSpeed's reduce_bucket_size and sub_group_size (these defaults are
  // DeepSpeed's). kChooseFromModel (0): chosen at finalize from the declared
  // parameters' decoder layers (zero_sizes.h; ZeroEngine::zero_sizes() says
  // what was chosen) — what a ds_config without the key gets.
  int64_t reduce_bucket_numel = 500'000'000;
  int64_t sub_group_numel = 1'000'000'000;
  int64_t persistence_threshold_numel = 100'000;    // stage3_param_persistence_threshold
  kernels::AdamConfig adam;
  double gradient_clipping = 0;            // max global norm; 0: no clipping
  nvme::AioOptions aio;                    // I/O engine for NVMe tiers
  size_t optimizer_buffer_count = 4;       // offload_optimizer.buffer_count (its default, DeepSpeed's)
  int optimizer_threads = 0;               // CPU Adam threads; 0: OpenMP default
  // Stages 2/3 with optimizer_tier cpu or nvme: after prepare_step, update
  // each sub-group during backward as soon as its gradient is final
  // (speculatively; offload/shard_optimizer.h). false: the optimizer runs in step() only.
  bool overlap_optimizer = true;
  // Stage 3 with overlap_optimizer: step() returns once the norm is known
  // and hands the update (and the state's write-back) to the optimizer
  // thread, in the order the next forward needs the parameters; that
  // forward's gathers of a sub-group wait for its update only, and the next
  // backward (or anything else that touches the step's state) waits for the
  // rest (offload/shard_optimizer.h, apply_async). false: the update ends in step().
  // With a trained group's parameters on NVMe, the new values of its last
  // sub-groups written stay in pinned memory (cached_param_writes: its
  // largest slice's and kCachedParamWrites more, of the group's dtype), and the forward's
  // gathers of them read no drive (offload::ParamHomeOptions::cached_writes).
  bool overlap_next_forward = true;

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

  // moe.expert_parallel_size: the data-parallel ranks that split each
  // mixture-of-experts layer's experts between them (docs/DESIGN.md §4.2);
  // 1: every rank holds every expert. Must divide the world (checked with
  // the communicators) and the experts of every layer (at finalize).
  int expert_parallel_size = 1;

  // fp16: loss scaling (DeepSpeed's fp16.* keys); unset: a scale of 1 (bf16, fp32).
  std::optional<LossScalerOptions> loss_scaling;

  // Throws Error(kBadArgument) naming the option when inconsistent.
  void validate() const;
  // A tier is on NVMe (the engine needs an I/O handle and nvme_path).
  bool any_nvme() const;
};

// Sub-groups of new values a trained group's parameter home on `home_tier`
// keeps in pinned memory for the next forward's gathers
// (offload::ParamHomeOptions::cached_writes): with the home on NVMe and the
// update overlapping that forward, as many as its largest range spans (a
// gather reads a whole slice: the embedding's, first) and kCachedParamWrites
// more, written while that gather waits; else none. chunk_numel: the home's
// sub-group; the engine and `strata plan` both ask this.
constexpr size_t kCachedParamWrites = 4;
inline size_t cached_param_writes(const ZeroEngineOptions& o, Tier home_tier, size_t chunk_numel,
                                  size_t largest_range_numel) {
  if (home_tier != Tier::kNvme || !o.overlap_optimizer || !o.overlap_next_forward || o.optimizer_tier == Tier::kDevice) {
    return 0;
  }
  return (largest_range_numel + chunk_numel - 1) / chunk_numel + kCachedParamWrites;
}

}  // namespace strata::engine
