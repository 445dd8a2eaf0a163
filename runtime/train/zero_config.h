// What `strata finetune`, the C API and the tools share to build a ZeroEngine
// from a checked ds_config: its options (runtime/config/engine_options.h, the
// one mapping) and its three communicators.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "runtime/config/config.h"
#include "runtime/config/engine_options.h"
#include "partition/communicator.h"
#include "partition/store.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_config.h"

namespace strata::train {

using strata::zero_engine_options;

// The three communicators a ZeroEngine needs, one per traffic class (docs/DESIGN.md
// §5), made over `store` with keys under "<prefix>/gather", "/reduce",
// "/control" (NCCL on cuda, Gloo on cpu); with expert_parallel_size > 1 also
// the ep group's (the token exchange) and two over the expert-dp group (the
// experts' gathers and reductions); with tensor_parallel_size > 1, gather,
// reduce and control over this rank's dp group and `tensor` over its tp group
// — partition/process_groups.h's groups; with pipeline_parallel_size > 1 the
// same over the rank's stage, and `pipeline` over its pp group; with
// context_parallel_size > 1 gather, reduce and control over the rank's dp-cp
// group (ZeRO over dp x cp) and `context` over its cp group. Collective:
// every rank calls it.
struct ZeroCommunicators {
  std::unique_ptr<partition::Communicator> gather, reduce, control;
  std::unique_ptr<partition::Communicator> expert_exchange, expert_gather, expert_reduce;
  std::unique_ptr<partition::Communicator> tensor;
  std::unique_ptr<partition::Communicator> pipeline;
  std::unique_ptr<partition::Communicator> context;
  engine::ZeroComms comms() const {
    return {gather.get(),        reduce.get(), control.get(),  expert_exchange.get(), expert_gather.get(),
            expert_reduce.get(), tensor.get(), pipeline.get(), context.get()};
  }
};
// moe.expert_parallel_size for `model` on `world_size` data-parallel ranks:
// the config's value, checked (the model has experts, the value divides the
// world and the experts), or when not given the world size if it divides the
// experts, else 1 (a dense model: 1). `source` names the config in errors.
int choose_expert_parallel_size(const Config& config, const nn::DecoderConfig& model, int world_size,
                                const std::string& source);

ZeroCommunicators make_zero_communicators(Accelerator& accelerator, partition::StoreClient& store, int rank,
                                          int world_size, std::chrono::milliseconds timeout, const std::string& prefix,
                                          int expert_parallel_size = 1, int tensor_parallel_size = 1,
                                          int pipeline_parallel_size = 1, int context_parallel_size = 1);

}  // namespace strata::train
