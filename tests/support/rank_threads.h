// Runs N ranks as threads of the test process: one rendezvous store on
// loopback, each rank with its own client of it, all on one shared cpu
// accelerator. What a rank builds on the store (one communicator, the
// ZeroEngine's three) is the body's. Exceptions of any rank are rethrown on
// the calling thread after every rank has ended (the lowest rank's first), so
// Catch2 assertions stay on the main thread.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "partition/store.h"
#include "core/accelerator.h"

namespace strata::test {

using RankThreadBody = std::function<void(int rank, partition::StoreClient& store, Accelerator& accelerator)>;

inline void run_rank_threads(int world_size, std::chrono::milliseconds timeout, const RankThreadBody& body) {
  partition::StoreServer server("127.0.0.1", 0);
  auto accelerator = make_cpu_accelerator();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        partition::StoreClient store("127.0.0.1", server.port(), rank, timeout);
        body(rank, store, *accelerator);
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
