// Test rig for the ZeRO engine: N ranks as threads of the test process
// (tests/support/rank_threads.h), each with the three Gloo communicators a
// ZeroEngine needs (gather, reduce, control; real TCP over loopback), made as
// `strata finetune` makes them (train::make_zero_communicators), on one shared
// cpu accelerator. Exceptions of any rank are rethrown on the calling thread.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>

#include "core/accelerator.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/train/zero_config.h"
#include "tests/support/rank_threads.h"

namespace strata::test {

using ZeroRankBody = std::function<void(int rank, Accelerator&, engine::ZeroComms)>;

// expert_parallel_size > 1: also the ep and expert-dp groups' communicators;
// tensor_parallel_size > 1: the dp group's three and the tp group's;
// context_parallel_size > 1: the dp-cp group's three and the cp group's.
inline void run_zero_ranks(int world_size, const ZeroRankBody& body,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(30000),
                           int expert_parallel_size = 1, int tensor_parallel_size = 1, int context_parallel_size = 1) {
  run_rank_threads(world_size, timeout, [&](int rank, partition::StoreClient& store, Accelerator& accelerator) {
    const train::ZeroCommunicators comms = train::make_zero_communicators(accelerator, store, rank, world_size,
                                                                          timeout, "test", expert_parallel_size,
                                                                          tensor_parallel_size, 1,
                                                                          context_parallel_size);
    body(rank, accelerator, comms.comms());
  });
}

// ZeRO-3 with the parameters on NVMe under `nvme_path`, the swap files kept
// (the kept-base tests read their sizes), every parameter gathered (none
// persistent), one optimizer thread.
inline engine::ZeroEngineOptions nvme_stage3_options(const std::filesystem::path& nvme_path) {
  engine::ZeroEngineOptions o;
  o.stage = 3;
  o.param_tier = Tier::kNvme;
  o.nvme_path = nvme_path;
  o.keep_swap_files = true;
  o.persistence_threshold_numel = 0;
  o.optimizer_threads = 1;
  return o;
}

}  // namespace strata::test
