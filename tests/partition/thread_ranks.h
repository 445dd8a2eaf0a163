// Runs N ranks as threads of the test process (tests/support/rank_threads.h),
// each with one Gloo communicator (over loopback TCP) and its own cpu stream.
// Exceptions raised by any rank are rethrown on the calling thread, so Catch2
// assertions stay on the main thread.
#pragma once

#include <chrono>
#include <functional>

#include "partition/communicator.h"
#include "core/accelerator.h"
#include "tests/support/rank_threads.h"

namespace strata::test {

using RankBody = std::function<void(int rank, partition::Communicator&, Accelerator&, Stream&)>;

inline void run_thread_ranks(int world_size, const RankBody& body,
                             std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  run_rank_threads(world_size, timeout, [&](int rank, partition::StoreClient& store, Accelerator& accelerator) {
    partition::CommunicatorOptions options;
    options.rank = rank;
    options.world_size = world_size;
    options.timeout = timeout;
    auto comm = partition::make_gloo_communicator(accelerator, store, options);
    auto stream = accelerator.create_stream();
    body(rank, *comm, accelerator, *stream);
    stream->synchronize();
  });
}

}  // namespace strata::test
