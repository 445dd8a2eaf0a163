// ds_config → ZeroEngineOptions (see engine_options.h).
#include "runtime/config/engine_options.h"

#include <optional>
#include <string>

#include "core/error.h"
#include "core/log.h"
#include "nvme/io_options.h"

namespace strata {
namespace {

Tier tier_of(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone: return Tier::kDevice;
    case OffloadDevice::kCpu: return Tier::kCpu;
    case OffloadDevice::kNvme: return Tier::kNvme;
  }
  return Tier::kDevice;
}

engine::ZeroEngineOptions map_options(const Config& c) {
  engine::ZeroEngineOptions o;
  o.stage = c.zero.stage;
  o.param_tier = tier_of(c.zero.offload_param.device);
  // "none": the optimizer state stays on the accelerator and is updated there
  // (DeepSpeed's meaning); cpu and nvme: the CPU Adam.
  o.optimizer_tier = tier_of(c.zero.offload_optimizer.device);
  // With the optimizer on NVMe the gradient shard goes there too (as
  // ZeRO-Infinity swaps gradients with the optimizer state): host memory then
  // stays bounded by the config's buffers, not by the model.
  o.grad_tier = o.optimizer_tier == Tier::kNvme ? Tier::kNvme : Tier::kDevice;
  const std::string& param_path = c.zero.offload_param.nvme_path;
  const std::string& optimizer_path = c.zero.offload_optimizer.nvme_path;
  const bool param_nvme = o.param_tier == Tier::kNvme;
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
  o.optimizer_buffer_count = static_cast<size_t>(c.zero.offload_optimizer.buffer_count);
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
  return o;
}

}  // namespace

engine::ZeroEngineOptions zero_engine_options(const Config& config, const std::string& source) {
  for (const auto& note : no_effect_notes(config)) logger().warn("{}: {}", source, note);
  engine::ZeroEngineOptions o = map_options(config);
  try {
    o.validate();
  } catch (const Error& e) {
    raise(e.category(), "{}: {}", source, e.message());
  }
  return o;
}

std::optional<std::string> engine_refusal(const Config& config) {
  try {
    map_options(config).validate();
  } catch (const Error& e) {
    return e.message();
  }
  return std::nullopt;
}

}  // namespace strata
