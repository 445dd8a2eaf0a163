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

namespace strata::train {

using strata::zero_engine_options;

// The three communicators a ZeroEngine needs, one per traffic class (docs/DESIGN.md
// §5), made over `store` with keys under "<prefix>/gather", "/reduce",
// "/control" (NCCL on cuda, Gloo on cpu). Collective: every rank calls it.
struct ZeroCommunicators {
  std::unique_ptr<partition::Communicator> gather, reduce, control;
  engine::ZeroComms comms() const { return {gather.get(), reduce.get(), control.get()}; }
};
ZeroCommunicators make_zero_communicators(Accelerator& accelerator, partition::StoreClient& store, int rank,
                                          int world_size, std::chrono::milliseconds timeout, const std::string& prefix);

}  // namespace strata::train
