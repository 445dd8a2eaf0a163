// Who this process is in the job, read from the environment `strata run` (or
// torchrun, or mpirun) sets, and the rendezvous that connects the ranks: rank 0
// serves the key-value store at MASTER_ADDR and strata's port, every rank
// connects. strata's port is STRATA_MASTER_PORT when set (`strata run` sets
// it, one port above or beside MASTER_PORT); else, under torchrun
// (TORCHELASTIC_RUN_ID set), MASTER_PORT + 1, because torchrun's agent store,
// which torch.distributed's env:// initialisation joins, holds MASTER_PORT;
// else MASTER_PORT. So torch.distributed and strata run side by side.
//
// Ownership: Rendezvous owns the server (rank 0) and this rank's client.
// Thread-safety: RankInfo is a value; Rendezvous is safe to share (see StoreClient).
// Throws: strata::Error(kBadArgument) for missing or malformed variables (naming
// the variable), kCommunication when the store cannot be served or reached.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "partition/store.h"

namespace strata::partition {

inline constexpr int kDefaultMasterPort = 29500;

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;  // strata's store (see above)
  // Where master_port came from, for messages: "STRATA_MASTER_PORT",
  // "MASTER_PORT + 1 (torchrun holds MASTER_PORT)", "MASTER_PORT" or "default".
  std::string port_source = "default";

  // RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, the port (see
  // above); when RANK is absent, OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE
  // (mpirun). With neither, a single rank (rank 0 of 1). Local values default
  // to the global ones.
  static RankInfo from_env();
};

class Rendezvous {
 public:
  // Rank 0 starts the store server first; every rank then connects its client
  // (registered as its liveness channel) within `timeout`.
  Rendezvous(const RankInfo& info, std::chrono::milliseconds timeout);
  ~Rendezvous();

  const RankInfo& info() const { return info_; }
  StoreClient& store() { return *client_; }

 private:
  RankInfo info_;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<StoreClient> client_;
};

}  // namespace strata::partition
