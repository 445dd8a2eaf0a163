// The ZeroEngine's communicators (see zero_config.h).
#include "runtime/train/zero_config.h"

#include "partition/process_groups.h"

#include "core/error.h"

namespace strata::train {

int choose_expert_parallel_size(const Config& config, const nn::DecoderConfig& model, int world_size,
                                const std::string& source) {
  const int given = config.expert_parallel_size;
  if (given == 0) {
    if (!model.moe() || model.num_experts % world_size != 0) return 1;
    return world_size;
  }
  if (given == 1) return 1;
  STRATA_CHECK(model.moe(), kBadArgument,
               "{}: moe.expert_parallel_size is {}, but the model (model_type {}) has no experts: leave it out or set 1",
               source, given, model.model_type);
  STRATA_CHECK(world_size % given == 0, kBadArgument,
               "{}: moe.expert_parallel_size {} does not divide the world size {} (the ranks that share experts "
               "must be whole groups)",
               source, given, world_size);
  STRATA_CHECK(model.num_experts % given == 0, kBadArgument,
               "{}: moe.expert_parallel_size {} does not divide the model's {} experts (num_local_experts / "
               "num_experts)",
               source, given, model.num_experts);
  return given;
}

ZeroCommunicators make_zero_communicators(Accelerator& accelerator, partition::StoreClient& store, int rank,
                                          int world_size, std::chrono::milliseconds timeout, const std::string& prefix,
                                          int expert_parallel_size, int tensor_parallel_size,
                                          int pipeline_parallel_size, int context_parallel_size) {
  auto options = [&](const char* traffic) {
    partition::CommunicatorOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.timeout = timeout;
    o.prefix = prefix + "/" + traffic;
    return o;
  };
  ZeroCommunicators c;
  if (tensor_parallel_size > 1 || pipeline_parallel_size > 1 || context_parallel_size > 1) {
    STRATA_CHECK(expert_parallel_size == 1 || tensor_parallel_size == 1, kBadArgument,
                 "tensor parallelism with expert parallelism is not implemented yet");
    STRATA_CHECK(expert_parallel_size == 1 || context_parallel_size == 1, kBadArgument,
                 "context parallelism with expert parallelism is not implemented yet");
    const partition::ParallelLayout layout(world_size, tensor_parallel_size, expert_parallel_size,
                                           pipeline_parallel_size, context_parallel_size);
    using partition::GroupKind;
    const auto group = [&](const char* traffic, GroupKind kind) {
      return partition::make_group_communicator(accelerator, store, options(traffic), layout.group_of(kind, rank));
    };
    // ZeRO's ranks: those holding the same parameters (a cp group's members do).
    const GroupKind zero = context_parallel_size > 1 ? GroupKind::kDataContext : GroupKind::kData;
    c.gather = group("gather", zero);
    c.reduce = group("reduce", zero);
    c.control = group("control", zero);
    if (tensor_parallel_size > 1) c.tensor = group("tensor", GroupKind::kTensor);
    if (context_parallel_size > 1) c.context = group("context", GroupKind::kContext);
    if (pipeline_parallel_size > 1) c.pipeline = group("pipeline", GroupKind::kPipeline);
    if (expert_parallel_size > 1) {
      c.expert_exchange = group("experts", GroupKind::kExpert);
      c.expert_gather = group("expert-gather", GroupKind::kExpertData);
      c.expert_reduce = group("expert-reduce", GroupKind::kExpertData);
    }
    return c;
  }
  auto make = [&](const char* traffic) { return partition::make_communicator(accelerator, store, options(traffic)); };
  c.gather = make("gather");
  c.reduce = make("reduce");
  c.control = make("control");
  if (expert_parallel_size > 1) {
    const partition::ParallelLayout layout(world_size, 1, expert_parallel_size);
    using partition::GroupKind;
    c.expert_exchange = partition::make_group_communicator(accelerator, store, options("experts"),
                                                           layout.group_of(GroupKind::kExpert, rank));
    const partition::ProcessGroup& edp = layout.group_of(GroupKind::kExpertData, rank);
    c.expert_gather = partition::make_group_communicator(accelerator, store, options("expert-gather"), edp);
    c.expert_reduce = partition::make_group_communicator(accelerator, store, options("expert-reduce"), edp);
  }
  return c;
}

}  // namespace strata::train
