// The rendezvous key-value store (DESIGN.md §5): a small TCP server, run by
// rank 0 at MASTER_ADDR:MASTER_PORT, and the client every rank uses. Built on
// Boost.Asio. The client implements Gloo's rendezvous::Store, carries the NCCL
// unique id, and doubles as a liveness channel: a rank whose connection drops
// without saying goodbye is reported by dead_ranks(), so collective errors can
// name the rank that died.
//
// Ownership: StoreServer owns its listening socket and I/O thread (joined on
// destruction). StoreClient owns one connection.
// Thread-safety: both are safe to use from several threads (the client
// serialises requests with a mutex).
// Throws: strata::Error(kCommunication) naming the address, key and timeout on
// connection failures and timeouts; kBadArgument for bad addresses.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::partition {

class StoreServer {
 public:
  // Listens on host:port (port 0 picks a free port; see port()).
  StoreServer(const std::string& host, int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class StoreClient : public gloo::rendezvous::Store {
 public:
  // Connects to host:port, retrying until `timeout` (the server may start
  // later). `rank` >= 0 registers this connection as that rank's liveness
  // channel; -1 for an anonymous client. `timeout` also bounds every request
  // and the default wait of get().
  StoreClient(const std::string& host, int port, int rank, std::chrono::milliseconds timeout);
  ~StoreClient() override;  // says goodbye, so this rank is not reported dead

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits up to the client timeout for the key to exist, then returns its value.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // Returns the value if the key exists, without waiting.
  bool try_get(const std::string& key, std::vector<char>& value);
  // Atomically adds `delta` to the integer counter `key` (created at 0) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // Ranks whose liveness connection closed without a goodbye, ascending.
  std::vector<int> dead_ranks();

  std::chrono::milliseconds timeout() const { return timeout_; }
  std::string address() const;

 private:
  struct Impl;
  std::vector<char> request(uint8_t op, const std::string& key, const std::vector<char>& value,
                            uint8_t* status);
  std::unique_ptr<Impl> impl_;
  std::mutex mutex_;
  std::chrono::milliseconds timeout_;
};

// Text form of dead_ranks() for error messages: "rank 3 died" / "no rank reported dead" /
// "rendezvous store unreachable (rank 0 hosts it and may have died)". Never throws.
std::string describe_dead_ranks(StoreClient& store);

}  // namespace strata::partition
