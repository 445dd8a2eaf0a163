// ZeroEngine's per-group storage, shared by its translation units
// (zero_engine.cc: hooks, coordinator, step; zero_engine_state.cc:
// checkpoints). Not a public header.
#pragma once

#include <memory>
#include <vector>

#include "nvme/swap_space.h"
#include "offload/optimizer_swapper.h"
#include "partition/layout.h"
#include "runtime/engine/bucket_reducer.h"
#include "runtime/engine/zero_engine.h"

namespace strata::engine {

// nvme home: the pinned staging buffers of one group (nc). A buffer is free
// when no parameter holds it and the gather stream is past its last reader.
struct ZeroEngine::Staging {
  struct Buffer {
    void* data = nullptr;
    ParamId holder = -1;                   // the parameter whose read it holds (no gather yet), -1: none
    std::shared_ptr<HostEvent> read_done;  // its latest read (shared with the read's callback)
    // Gather stream, after the copy / allgather that last read the buffer; a
    // fresh event per reader, since a deferred read waits for this one point.
    std::shared_ptr<Event> consumed;
    uint64_t consumed_seq = 0;             // order of `consumed` on the gather stream
  };
  std::vector<Buffer> buffers;
  size_t buffer_nbytes = 0;
};

// One dtype group: its layout, this rank's shard at home, its gradient shard,
// reducer and optimizer.
struct ZeroEngine::Group {
  DType dtype = DType::kF32;
  std::vector<ParamId> params;
  std::unique_ptr<partition::PartitionLayout> layout;
  void* home = nullptr;  // device: accelerator memory; cpu: pinned memory; nvme: unused
  std::unique_ptr<nvme::SwapSpace> swap;
  nvme::File* file = nullptr;         // nvme home
  void* host_params = nullptr;        // pinned shard staging when home is not host-addressable
  float* host_grads = nullptr;        // pinned fp32 shard staging (non-cpu accelerators)
  float* grad_accum = nullptr;        // fp32 [shard_numel], accelerator memory
  std::unique_ptr<BucketReducer> reducer;
  std::unique_ptr<offload::OptimizerSwapper> swapper;
  void* full_flat = nullptr;          // stages 1/2: every full parameter
  std::vector<size_t> full_offset;    // per member: offset in full_flat
  Staging staging;                    // stage 3, nvme home
};

}  // namespace strata::engine
