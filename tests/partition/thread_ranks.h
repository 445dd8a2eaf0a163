// Runs N ranks as threads of the test process, each with its own rendezvous
// client, Gloo communicator (over loopback TCP) and cpu stream. Exceptions
// raised by any rank are rethrown on the calling thread, so Catch2 assertions
// stay on the main thread.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "partition/communicator.h"
#include "partition/store.h"
#include "runtime/core/accelerator.h"

namespace strata::test {

using RankBody = std::function<void(int rank, partition::Communicator&, Accelerator&, Stream&)>;

inline void run_thread_ranks(int world_size, const RankBody& body,
                             std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  partition::StoreServer server("127.0.0.1", 0);
  auto accelerator = make_cpu_accelerator();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        partition::StoreClient store("127.0.0.1", server.port(), rank, timeout);
        partition::CommunicatorOptions options;
        options.rank = rank;
        options.world_size = world_size;
        options.timeout = timeout;
        auto comm = partition::make_gloo_communicator(*accelerator, store, options);
        auto stream = accelerator->create_stream();
        body(rank, *comm, *accelerator, *stream);
        stream->synchronize();
      } catch (...) {
        errors[static_cast<size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace strata::test
