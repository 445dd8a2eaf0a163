// The rendezvous store: set/get/wait/add over real TCP, timeouts, dead-rank reporting.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "partition/rendezvous.h"
#include "partition/store.h"
#include "core/error.h"

using namespace strata;
using namespace strata::partition;
using namespace std::chrono_literals;

TEST_CASE("store: set, get, wait and add across clients") {
  StoreServer server("127.0.0.1", 0);
  StoreClient a("127.0.0.1", server.port(), 0, 2000ms);
  StoreClient b("127.0.0.1", server.port(), 1, 2000ms);
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    a.set("key", {'x', 'y', '\0', 'z'});
  });
  b.wait({"key"});
  setter.join();
  REQUIRE(b.get("key") == std::vector<char>{'x', 'y', '\0', 'z'});
  std::vector<char> value;
  REQUIRE_FALSE(b.try_get("missing", value));
  REQUIRE(a.add("counter", 2) == 2);
  REQUIRE(b.add("counter", 3) == 5);
  std::vector<char> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  a.set("big", big);
  REQUIRE(b.get("big") == big);
  REQUIRE(a.dead_ranks().empty());
}

TEST_CASE("store: waiting for a key that never comes times out with the key name") {
  StoreServer server("127.0.0.1", 0);
  StoreClient client("127.0.0.1", server.port(), 0, 2000ms);
  auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(client.wait({"never"}, 300ms), Catch::Contains("never") && Catch::Contains("timed out"));
  REQUIRE(std::chrono::steady_clock::now() - start < 2s);
}

TEST_CASE("store: a client that disappears without goodbye is reported dead by rank") {
  StoreServer server("127.0.0.1", 0);
  StoreClient survivor("127.0.0.1", server.port(), 0, 2000ms);
  {
    // A clean exit says goodbye: not dead.
    StoreClient polite("127.0.0.1", server.port(), 1, 2000ms);
  }
  // Simulate a crash: a forked child connects as rank 2 and _exits without the destructor.
  pid_t pid = fork();
  if (pid == 0) {
    auto* leaked = new StoreClient("127.0.0.1", server.port(), 2, 2000ms);
    (void)leaked;
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  auto deadline = std::chrono::steady_clock::now() + 2s;
  while (survivor.dead_ranks().empty() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  REQUIRE(survivor.dead_ranks() == std::vector<int>{2});
  REQUIRE_THAT(describe_dead_ranks(survivor), Catch::Contains("rank 2 died"));
}

TEST_CASE("store: connecting to a store that is not there fails within the timeout") {
  int port = 0;
  {
    StoreServer probe("127.0.0.1", 0);
    port = probe.port();
  }
  auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(StoreClient("127.0.0.1", port, 3, 300ms), Catch::Contains("rank 3 cannot reach"));
  REQUIRE(std::chrono::steady_clock::now() - start < 2s);
}

TEST_CASE("store: a request to a store whose server died fails naming rank 0") {
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0);
  StoreClient client("127.0.0.1", server->port(), 1, 1000ms);
  server.reset();
  REQUIRE_THROWS_WITH(client.set("k", {'v'}), Catch::Contains("rank 0"));
}

TEST_CASE("rendezvous: RankInfo reads torchrun and mpirun variables") {
  auto clear = [] {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                             "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                             "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
      unsetenv(name);
    }
  };
  clear();
  RankInfo single = RankInfo::from_env();
  REQUIRE(single.rank == 0);
  REQUIRE(single.world_size == 1);
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  setenv("MASTER_PORT", "1234", 1);
  RankInfo mpi = RankInfo::from_env();
  REQUIRE(mpi.rank == 3);
  REQUIRE(mpi.world_size == 8);
  REQUIRE(mpi.local_rank == 1);
  REQUIRE(mpi.local_world_size == 2);
  REQUIRE(mpi.master_addr == "10.0.0.1");
  REQUIRE(mpi.master_port == 1234);
  setenv("RANK", "5", 1);
  setenv("WORLD_SIZE", "4", 1);
  REQUIRE_THROWS_WITH(RankInfo::from_env(), Catch::Contains("RANK=5"));
  setenv("WORLD_SIZE", "x", 1);
  REQUIRE_THROWS_WITH(RankInfo::from_env(), Catch::Contains("WORLD_SIZE='x'"));
  clear();
}

TEST_CASE("rendezvous: strata's store port beside torch.distributed's MASTER_PORT") {
  auto clear = [] {
    for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_PORT", "STRATA_MASTER_PORT", "TORCHELASTIC_RUN_ID"}) {
      unsetenv(name);
    }
  };
  clear();
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "29500", 1);
  CHECK(RankInfo::from_env().master_port == 29500);  // mpirun-like: MASTER_PORT is strata's
  CHECK(RankInfo::from_env().port_source == "MASTER_PORT");
  setenv("TORCHELASTIC_RUN_ID", "job", 1);  // torchrun: its agent store holds MASTER_PORT
  CHECK(RankInfo::from_env().master_port == 29501);
  CHECK_THAT(RankInfo::from_env().port_source, Catch::Contains("torchrun"));
  setenv("STRATA_MASTER_PORT", "31000", 1);  // `strata run`, or the user: it wins
  CHECK(RankInfo::from_env().master_port == 31000);
  CHECK(RankInfo::from_env().port_source == "STRATA_MASTER_PORT");
  setenv("STRATA_MASTER_PORT", "70000", 1);
  CHECK_THROWS_WITH(RankInfo::from_env(), Catch::Contains("STRATA_MASTER_PORT=70000 is not a TCP port"));
  unsetenv("STRATA_MASTER_PORT");
  setenv("MASTER_PORT", "65535", 1);
  CHECK_THROWS_WITH(RankInfo::from_env(), Catch::Contains("set STRATA_MASTER_PORT"));
  clear();
}

TEST_CASE("rendezvous: a store port another process holds is refused naming STRATA_MASTER_PORT") {
  StoreServer holder("127.0.0.1", 0);  // torchrun's agent store, say
  RankInfo info;
  info.master_port = holder.port();
  info.port_source = "MASTER_PORT";
  CHECK_THROWS_WITH(Rendezvous(info, std::chrono::milliseconds(500)),
                    Catch::Contains("from MASTER_PORT; another process holds it: set STRATA_MASTER_PORT"));
}
