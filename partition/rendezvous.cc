// RankInfo from the launcher's environment, and the rank-0-served rendezvous.
#include "partition/rendezvous.h"

#include <charconv>
#include <cstdlib>
#include <thread>

#include "core/error.h"

namespace strata::partition {
namespace {
const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

int env_int(const char* name, int fallback, int min_value) {
  const char* text = env(name);
  if (text == nullptr) return fallback;
  int value = 0;
  std::string_view view(text);
  auto [end, ec] = std::from_chars(view.data(), view.data() + view.size(), value);
  STRATA_CHECK(ec == std::errc() && end == view.data() + view.size() && value >= min_value, kBadArgument,
               "environment variable {}='{}' must be an integer >= {}", name, text, min_value);
  return value;
}
}  // namespace

RankInfo RankInfo::from_env() {
  RankInfo info;
  bool torchrun_style = env("RANK") != nullptr;
  const char* rank_var = torchrun_style ? "RANK" : "OMPI_COMM_WORLD_RANK";
  const char* size_var = torchrun_style ? "WORLD_SIZE" : "OMPI_COMM_WORLD_SIZE";
  const char* local_rank_var = torchrun_style ? "LOCAL_RANK" : "OMPI_COMM_WORLD_LOCAL_RANK";
  const char* local_size_var = torchrun_style ? "LOCAL_WORLD_SIZE" : "OMPI_COMM_WORLD_LOCAL_SIZE";
  info.rank = env_int(rank_var, 0, 0);
  info.world_size = env_int(size_var, 1, 1);
  STRATA_CHECK(info.rank < info.world_size, kBadArgument, "{}={} is not below {}={}", rank_var, info.rank,
               size_var, info.world_size);
  info.local_rank = env_int(local_rank_var, info.rank, 0);
  info.local_world_size = env_int(local_size_var, info.world_size, 1);
  if (const char* addr = env("MASTER_ADDR")) info.master_addr = addr;
  info.master_port = env_int("MASTER_PORT", kDefaultMasterPort, 1);
  STRATA_CHECK(info.master_port <= 65535, kBadArgument, "MASTER_PORT={} is not a TCP port", info.master_port);
  if (env("MASTER_PORT") != nullptr) info.port_source = "MASTER_PORT";
  if (env("STRATA_MASTER_PORT") != nullptr) {
    info.master_port = env_int("STRATA_MASTER_PORT", 0, 1);
    STRATA_CHECK(info.master_port <= 65535, kBadArgument, "STRATA_MASTER_PORT={} is not a TCP port",
                 info.master_port);
    info.port_source = "STRATA_MASTER_PORT";
  } else if (env("TORCHELASTIC_RUN_ID") != nullptr && env("MASTER_PORT") != nullptr) {
    STRATA_CHECK(info.master_port < 65535, kBadArgument,
                 "under torchrun strata's store takes MASTER_PORT + 1, but MASTER_PORT is {}: set STRATA_MASTER_PORT",
                 info.master_port);
    ++info.master_port;
    info.port_source = "MASTER_PORT + 1 (torchrun holds MASTER_PORT)";
  }
  return info;
}

Rendezvous::Rendezvous(const RankInfo& info, std::chrono::milliseconds timeout) : info_(info) {
  if (info_.rank == 0) {
    try {
      server_ = std::make_unique<StoreServer>(info_.master_addr, info_.master_port);
    } catch (const Error& error) {
      // Say which variable chose the port, and how to choose another.
      raise(error.category(),
            "{} (strata's port, from {}; another process holds it: set STRATA_MASTER_PORT to a free port, the same "
            "on every rank)",
            error.message(), info_.port_source);
    }
  }
  client_ = std::make_unique<StoreClient>(info_.master_addr, info_.master_port, info_.rank, timeout);
}

Rendezvous::~Rendezvous() {
  // Rank 0 keeps serving until every rank has said goodbye, so that a peer still
  // finishing its last collective does not see the store vanish and blame rank 0.
  if (server_ != nullptr && client_ != nullptr) {
    try {
      client_->add("strata/finished", 1);
      auto deadline = std::chrono::steady_clock::now() + client_->timeout();
      while (client_->add("strata/finished", 0) < info_.world_size &&
             std::chrono::steady_clock::now() < deadline) {
        if (!client_->dead_ranks().empty()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (const std::exception&) {
    }
  } else if (client_ != nullptr) {
    try {
      client_->add("strata/finished", 1);
    } catch (const std::exception&) {
    }
  }
  client_.reset();
  server_.reset();
}

}  // namespace strata::partition
