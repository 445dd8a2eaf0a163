// The ZeroEngine's options from a checked ds_config: the one mapping from
// DeepSpeed's keys (zero_optimization, optimizer, gradient_clipping, fp16, aio) to
// engine::ZeroEngineOptions, shared by `strata finetune` and the C API
// (runtime/capi) so that the same config file means the same engine in both.
//
// Errors: Error(kBadArgument) naming `source` (the config's file name, or what
// it came from) and the key, for a config the engine cannot run: stage 0,
// two different NVMe paths, or options
// ZeroEngineOptions::validate rejects.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "runtime/config/config.h"
#include "partition/communicator.h"
#include "partition/store.h"
#include "runtime/engine/zero_engine.h"

namespace strata::train {

engine::ZeroEngineOptions zero_engine_options(const Config& config, const std::string& source);

// The three communicators a ZeroEngine needs, one per traffic class (ENGINE.md
// §4), made over `store` with keys under "<prefix>/gather", "/reduce",
// "/control" (NCCL on cuda, Gloo on cpu). Collective: every rank calls it.
struct ZeroCommunicators {
  std::unique_ptr<partition::Communicator> gather, reduce, control;
  engine::ZeroComms comms() const { return {gather.get(), reduce.get(), control.get()}; }
};
ZeroCommunicators make_zero_communicators(Accelerator& accelerator, partition::StoreClient& store, int rank,
                                          int world_size, std::chrono::milliseconds timeout, const std::string& prefix);

}  // namespace strata::train
