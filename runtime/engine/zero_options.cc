// The ZeroEngine's rules for its options (zero_options.h).
#include "runtime/engine/zero_options.h"

#include <cmath>

#include "core/error.h"

namespace strata::engine {

bool ZeroEngineOptions::any_nvme() const {
  return param_tier == Tier::kNvme || optimizer_tier == Tier::kNvme || grad_tier == Tier::kNvme;
}

void ZeroEngineOptions::validate() const {
  STRATA_CHECK(stage >= 1 && stage <= 3, kBadArgument, "zero_optimization.stage must be 1, 2 or 3, got {}", stage);
  STRATA_CHECK(param_tier == Tier::kDevice || stage == 3, kBadArgument,
               "offload_param.device {} needs zero_optimization.stage 3 (got stage {}): only stage 3 partitions "
               "the parameters",
               tier_name(param_tier), stage);
  STRATA_CHECK(optimizer_tier != Tier::kDevice || grad_tier == Tier::kDevice, kBadArgument,
               "the optimizer on the accelerator reads the gradient shard there: grad tier {} is not device",
               tier_name(grad_tier));
  STRATA_CHECK(grad_tier == Tier::kDevice || grad_tier == Tier::kNvme, kBadArgument,
               "the gradient shard lives in accelerator memory or on nvme, not {}", tier_name(grad_tier));
  STRATA_CHECK(!nvme_path.empty() ||
                   (param_tier != Tier::kNvme && optimizer_tier != Tier::kNvme && grad_tier != Tier::kNvme),
               kBadArgument, "an nvme tier needs nvme_path");
  // 0 (kChooseFromModel): chosen from the model at finalize.
  STRATA_CHECK(reduce_bucket_numel >= 0, kBadArgument, "reduce_bucket_size must be >= 1 (or left out), got {}",
               reduce_bucket_numel);
  STRATA_CHECK(sub_group_numel >= 0, kBadArgument, "sub_group_size must be >= 1 (or left out), got {}",
               sub_group_numel);
  STRATA_CHECK(persistence_threshold_numel >= 0, kBadArgument,
               "stage3_param_persistence_threshold must be >= 0, got {}", persistence_threshold_numel);
  STRATA_CHECK(gradient_clipping >= 0 && std::isfinite(gradient_clipping), kBadArgument,
               "gradient_clipping must be >= 0, got {}", gradient_clipping);
  STRATA_CHECK(optimizer_buffer_count >= 2, kBadArgument, "the optimizer pipeline needs >= 2 buffers, got {}",
               optimizer_buffer_count);
  STRATA_CHECK(prefetch_bucket_numel >= 0, kBadArgument, "stage3_prefetch_bucket_size must be >= 0, got {}",
               prefetch_bucket_numel);
  STRATA_CHECK(max_live_parameters_numel >= 1, kBadArgument, "stage3_max_live_parameters must be >= 1, got {}",
               max_live_parameters_numel);
  STRATA_CHECK(max_reuse_distance_numel >= 0, kBadArgument, "stage3_max_reuse_distance must be >= 0, got {}",
               max_reuse_distance_numel);
  STRATA_CHECK(param_buffer_count >= 1, kBadArgument, "offload_param.buffer_count must be >= 1, got {}",
               param_buffer_count);
  STRATA_CHECK(param_buffer_numel >= 1, kBadArgument, "offload_param.buffer_size must be >= 1, got {}",
               param_buffer_numel);
  STRATA_CHECK(expert_parallel_size >= 1, kBadArgument, "moe.expert_parallel_size must be >= 1, got {}",
               expert_parallel_size);
  adam.validate();
  if (any_nvme()) aio.validate();
}

}  // namespace strata::engine
