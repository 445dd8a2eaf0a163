// ds_config → ZeroEngineOptions (see zero_config.h).
#include "runtime/train/zero_config.h"

#include <algorithm>

#include "nvme/io_options.h"
#include "core/error.h"

namespace strata::train {
namespace {

Tier tier_of(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone: return Tier::kDevice;
    case OffloadDevice::kCpu: return Tier::kCpu;
    case OffloadDevice::kNvme: return Tier::kNvme;
  }
  return Tier::kDevice;
}

}  // namespace

engine::ZeroEngineOptions zero_engine_options(const Config& c, const std::string& source) {
  STRATA_CHECK(c.zero.stage >= 1, kBadArgument,
               "{}: zero_optimization.stage is 0; strata's engine partitions at least the optimizer state: use "
               "stage 1, 2 or 3",
               source);
  engine::ZeroEngineOptions o;
  o.stage = c.zero.stage;
  o.param_tier = tier_of(c.zero.offload_param.device);
  // "none": the optimizer state stays on the accelerator and is updated there
  // (DeepSpeed's meaning); cpu and nvme: the CPU Adam.
  o.optimizer_tier = tier_of(c.zero.offload_optimizer.device);
  STRATA_CHECK(o.optimizer_tier != Tier::kDevice || o.param_tier == Tier::kDevice, kBadArgument,
               "{}: zero_optimization.offload_param.device is {} but offload_optimizer.device is none: the optimizer "
               "state (12 bytes per parameter) would stay on the accelerator to spare the parameters' 2; offload "
               "the optimizer too (offload_optimizer.device cpu or nvme)",
               source, tier_name(o.param_tier));
  // With the optimizer on NVMe the gradient shard goes there too (as
  // ZeRO-Infinity swaps gradients with the optimizer state): host memory then
  // stays bounded by the config's buffers, not by the model.
  o.grad_tier = o.optimizer_tier == Tier::kNvme ? Tier::kNvme : Tier::kDevice;
  const std::string& param_path = c.zero.offload_param.nvme_path;
  const std::string& optimizer_path = c.zero.offload_optimizer.nvme_path;
  const bool param_nvme = o.param_tier == Tier::kNvme, optimizer_nvme = o.optimizer_tier == Tier::kNvme;
  STRATA_CHECK(!(param_nvme && optimizer_nvme) || param_path == optimizer_path, kBadArgument,
               "{}: offload_param.nvme_path ({}) and offload_optimizer.nvme_path ({}) differ; strata's engine "
               "keeps both kinds of swap files under one directory for now: give the same path",
               source, param_path, optimizer_path);
  o.nvme_path = param_nvme ? param_path : optimizer_path;
  o.keep_swap_files = c.strata.keep_swap_files;
  o.reduce_bucket_numel = static_cast<int64_t>(c.zero.reduce_bucket_numel);
  o.sub_group_numel = static_cast<int64_t>(c.zero.sub_group_numel);
  o.persistence_threshold_numel = static_cast<int64_t>(c.zero.param_persistence_threshold_numel);
  o.adam.lr = static_cast<float>(c.optimizer.lr);
  o.adam.beta1 = static_cast<float>(c.optimizer.betas[0]);
  o.adam.beta2 = static_cast<float>(c.optimizer.betas[1]);
  o.adam.eps = static_cast<float>(c.optimizer.eps);
  o.adam.weight_decay = static_cast<float>(c.optimizer.weight_decay);
  o.adam.adamw = c.optimizer.type == "AdamW";
  o.gradient_clipping = c.gradient_clipping;
  o.overlap_optimizer = c.strata.overlap_optimizer;
  o.aio.block_size = c.aio.block_size;
  o.aio.queue_depth = c.aio.queue_depth;
  o.aio.thread_count = c.aio.thread_count;
  o.aio.single_submit = c.aio.single_submit;
  o.aio.overlap_events = c.aio.overlap_events;
  o.aio.auto_tune = c.aio.auto_tune;
  o.aio.engine = nvme::parse_engine_kind(c.aio.engine);
  o.optimizer_buffer_count = static_cast<size_t>(std::max(2, c.zero.offload_optimizer.buffer_count));
  // The stage-3 coordinator's budgets (elements), DeepSpeed's keys.
  o.prefetch_bucket_numel = static_cast<int64_t>(c.zero.prefetch_bucket_numel);
  o.max_live_parameters_numel = static_cast<int64_t>(c.zero.max_live_parameters_numel);
  o.max_reuse_distance_numel = static_cast<int64_t>(c.zero.max_reuse_distance_numel);
  o.param_buffer_count = static_cast<size_t>(c.zero.offload_param.buffer_count);
  o.param_buffer_numel = static_cast<int64_t>(c.zero.offload_param.buffer_numel);
  if (c.fp16.enabled) {
    // DeepSpeed's fp16 block: loss_scale 0 is dynamic, > 0 a fixed scale.
    engine::LossScalerOptions scaling;
    scaling.dynamic = c.fp16.loss_scale == 0;
    scaling.static_scale = c.fp16.loss_scale > 0 ? c.fp16.loss_scale : 1.0;
    scaling.initial_scale_power = c.fp16.initial_scale_power;
    scaling.window = c.fp16.loss_scale_window;
    scaling.hysteresis = c.fp16.hysteresis;
    scaling.min_scale = c.fp16.min_loss_scale;
    o.loss_scaling = scaling;
  }
  o.validate();
  return o;
}

ZeroCommunicators make_zero_communicators(Accelerator& accelerator, partition::StoreClient& store, int rank,
                                          int world_size, std::chrono::milliseconds timeout, const std::string& prefix) {
  auto make = [&](const char* traffic) {
    partition::CommunicatorOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.timeout = timeout;
    o.prefix = prefix + "/" + traffic;
    return partition::make_communicator(accelerator, store, o);
  };
  ZeroCommunicators c;
  c.gather = make("gather");
  c.reduce = make("reduce");
  c.control = make("control");
  return c;
}

}  // namespace strata::train
