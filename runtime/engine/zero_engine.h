// ZeroEngine: Engine v2 with ZeRO stages 1, 2 and 3 (ENGINE.md §2–§5).
//
// Parameters are grouped by storage dtype; each group has one
// partition::PartitionLayout, the single source of shard offsets. Each rank
// keeps its shard of every group at home on the tier the options name:
//   stage 1/2: the shard in accelerator memory, plus every full parameter
//              resident (gathered after each optimizer step);
//   stage 3:   the shard in accelerator memory, pinned CPU memory, or a flat
//              per-rank NVMe file per group (`param_tier`); full parameters
//              are gathered on demand in pre_op (allgather on the gather
//              communicator; the compute stream waits on its event, not the
//              host) and released after post_op with a stream-ordered free —
//              except parameters of at most `persistence_threshold_numel`
//              elements, which stay gathered until the next step changes them.
// Gradients are summed in fp32 and never averaged: normalise the loss by the
// global number of predicted tokens (global_sum) instead, so N ranks equal one
// rank on the combined batch.
//   stage 1:   full fp32 gradients stay resident and accumulate over micro-steps;
//              step() reduce-scatters them in buckets.
//   stage 2/3: a full fp32 gradient exists only while a parameter's backward
//              runs; at its last use in backward it joins a bucket that is
//              reduce-scattered on its own stream and communicator and added into
//              this rank's fp32 gradient shard (BucketReducer), then freed.
// step() is the optimizer at an accumulation boundary: the global gradient norm
// (f64 allreduce on the control communicator), clipping, a skip without any
// state change when a gradient is not finite, Adam/AdamW on the CPU over this
// rank's shard through offload::OptimizerSwapper (state in CPU memory or on
// NVMe, `optimizer_tier`), the new values written to the shard's home, and
// (stages 1/2) one allgather per group.
//
// Collectives: every rank must make the same calls in the same order —
// finalize, the hooks of each step, for_each_owned_range (kWrite) before the
// next pre_op, global_sum and step.
//
// Not yet: operator trace and prefetch (stage 3 gathers when the op asks),
// loss scaling for fp16, the CUDA optimizer (the CPU one serves every backend;
// on cuda the gradient shard is copied to host memory for it).
//
// Ownership: borrows the accelerator and the communicators (which must outlive
// it); owns storage, streams, swap files and the optimizer state.
// Thread-safety and errors: see engine.h; collectives fail with
// Error(kCommunication), NVMe I/O with Error(kIo).
#pragma once

#include <filesystem>
#include <memory>
#include <vector>

#include "kernels/optimizer.h"
#include "nvme/io_options.h"
#include "partition/communicator.h"
#include "runtime/engine/engine.h"

namespace strata::nvme {
class AioHandle;
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
  Tier optimizer_tier = Tier::kCpu;        // offload_optimizer.device: kCpu or kNvme
  std::filesystem::path nvme_path;         // swap files (either tier on nvme)
  int64_t reduce_bucket_numel = 500'000'000;        // DeepSpeed's reduce_bucket_size
  int64_t sub_group_numel = 1'000'000'000;          // DeepSpeed's sub_group_size
  int64_t persistence_threshold_numel = 100'000;    // stage3_param_persistence_threshold
  kernels::AdamConfig adam;
  double gradient_clipping = 0;            // max global norm; 0: no clipping
  nvme::AioOptions aio;                    // I/O engine for NVMe tiers
  size_t optimizer_buffer_count = 3;       // pinned buffers of the NVMe optimizer pipeline
  int optimizer_threads = 0;               // CPU Adam threads; 0: OpenMP default

  // Throws Error(kBadArgument) naming the option when inconsistent.
  void validate() const;
};

// What one step() did.
struct StepResult {
  bool applied = false;     // false: a gradient was not finite; nothing changed
  double grad_norm = 0;     // global L2 norm of the summed gradients (before clipping)
  float grad_scale = 1;     // factor applied to the gradients (clipping)
  int64_t step = 0;         // optimizer steps applied so far
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
  int64_t step_count() const;

  // Bytes of full parameters gathered now and at most since finalize (stage 3).
  size_t gathered_nbytes() const { return gathered_nbytes_; }
  size_t peak_gathered_nbytes() const { return peak_gathered_nbytes_; }
  // Parameter allgathers issued so far (stage 3: one per gather of a parameter).
  int64_t gathers_issued() const { return gathers_issued_; }

 private:
  struct Group;
  struct Gathered;
  void on_finalize() override;
  void on_grad_ready(ParamId id, Event& ready) override;
  void gather(ParamId id);          // stage 3: enqueue the allgather of id, compute waits
  void release_gathered(ParamId id, Event& after);
  void sync_full_params();          // stages 1/2: allgather every group into the full copies
  void init_optimizer();
  void note_written(ParamId id);    // after a kWrite range: copies and master weights are stale
  bool home_is_host_addressable() const;
  // A host view of the group's parameter shard (staged when the home is not
  // host-addressable; `load` fills the staging from the home first).
  void* host_params(Group& g, bool load);
  void store_host_params(Group& g);  // staging back to a non-host home
  void allreduce_f64(double* values, size_t count);  // control communicator, blocks

  ZeroComms comms_;
  ZeroEngineOptions options_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<int> group_of_;        // per parameter
  std::vector<size_t> index_in_group_;
  std::vector<std::unique_ptr<Gathered>> gathered_;  // per parameter
  std::vector<float*> grad_full_;    // per parameter: its full fp32 gradient (stage 1: resident)
  std::unique_ptr<Stream> gather_stream_, control_stream_;
  std::unique_ptr<nvme::AioHandle> aio_;           // when a tier is nvme
  std::vector<std::unique_ptr<offload::PinnedBufferPool>> pools_;  // nvme optimizer staging
  offload::PinnedBufferPool* pool_ = nullptr;      // the newest (largest) of pools_
  void* stage1_grads_ = nullptr;                   // stage 1: every full fp32 gradient
  size_t stage1_grads_nbytes_ = 0;
  int64_t steps_ = 0;
  int64_t gathers_issued_ = 0;
  std::unique_ptr<Event> compute_point_;
  bool full_params_stale_ = false;   // stages 1/2: shards written since the last gather
  bool optimizer_stale_ = true;      // master weights must be (re)initialised from the shards
  size_t gathered_nbytes_ = 0, peak_gathered_nbytes_ = 0;
};

}  // namespace strata::engine
