// Test rig for the ZeRO engine: N ranks as threads of the test process, each
// with its own rendezvous client and the three Gloo communicators a
// ZeroEngine needs (gather, reduce, control; real TCP over loopback), on one
// shared cpu accelerator. Exceptions of any rank are rethrown on the calling
// thread, so Catch2 assertions stay on the main thread.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "partition/communicator.h"
#include "partition/store.h"
#include "runtime/core/accelerator.h"
#include "runtime/engine/zero_engine.h"

namespace strata::test {

using ZeroRankBody = std::function<void(int rank, Accelerator&, engine::ZeroComms)>;

inline void run_zero_ranks(int world_size, const ZeroRankBody& body,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(30000)) {
  partition::StoreServer server("127.0.0.1", 0);
  auto accelerator = make_cpu_accelerator();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        partition::StoreClient store("127.0.0.1", server.port(), rank, timeout);
        auto make = [&](const char* prefix) {
          partition::CommunicatorOptions options;
          options.rank = rank;
          options.world_size = world_size;
          options.timeout = timeout;
          options.prefix = prefix;
          return partition::make_gloo_communicator(*accelerator, store, options);
        };
        auto gather = make("test/gather"), reduce = make("test/reduce"), control = make("test/control");
        body(rank, *accelerator, engine::ZeroComms{gather.get(), reduce.get(), control.get()});
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
