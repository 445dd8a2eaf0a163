// `strata run`: starts the local ranks of a data-parallel job with the
// environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) and STRATA_MASTER_PORT, strata's own store port
// (partition/rendezvous.h), so that the ranks may also start a
// torch.distributed process group on MASTER_PORT, and unless it is set
// OMP_NUM_THREADS to the cores / local ranks (at least 1: the ranks share the
// cores instead of each spinning OpenMP workers on all of them); prefixes their output lines with the rank,
// forwards Ctrl-C, and when one rank fails stops the others and says which
// rank failed and how.
//
// Thread-safety: launch() is meant to be called once per process from its main
// thread (it changes the signal mask while it runs).
// Throws: strata::Error(kBadArgument) for bad options; process failures are
// reported through the exit code and stderr, not exceptions.
#pragma once

#include <string>
#include <vector>

#include "partition/rendezvous.h"

namespace strata::launcher {

// Most ranks one launcher starts (-n): each costs a process and two pipes,
// and no machine runs more ranks than this usefully.
constexpr int kMaxLocalRanks = 1024;

struct LaunchOptions {
  int nproc_per_node = 1;  // ranks started by this launcher, 1..kMaxLocalRanks
  int nnodes = 1;          // nnodes x nproc_per_node must fit an int (RANK, WORLD_SIZE)
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port when nnodes == 1, else 29500
  // After a rank fails, how long the others may take to finish on their own
  // (reporting their own errors) before they are sent SIGTERM, then SIGKILL
  // kill_delay_s later. When the first to fail exited kPeerFailedExitCode (its
  // peer failed), at least 10 s, so the peer can finish saying why. Seconds, >= 0; infinity (or any value beyond the
  // clock's range) means never.
  double failure_grace_s = 2.0;
  double kill_delay_s = 3.0;
  bool prefix_output = true;
  std::vector<std::string> command;  // program and arguments
};

// The exit code of a strata tool whose failure is a peer's (a collective or
// the rendezvous broke: Error(kCommunication)), so the launcher can tell the
// rank that failed on its own from the ranks that failed because it did.
constexpr int kPeerFailedExitCode = 3;

// Runs the job; returns the exit code for `strata run`: 0 when every rank exited
// with 0; the exit code of the rank that failed first on its own (128 + signal
// when it was killed; a rank exiting kPeerFailedExitCode is named only when
// no rank failed otherwise), which the last line names;
// 128 + the signal after Ctrl-C (130) or SIGTERM (143).
int launch(const LaunchOptions& options);

// A TCP port on `host` that was free a moment ago.
int find_free_port(const std::string& host);

// partition::RankInfo::from_env(), except that a process alone (no WORLD_SIZE
// above 1) with neither MASTER_PORT nor STRATA_MASTER_PORT takes a free port instead of the default,
// which another single-rank job on this machine may hold.
partition::RankInfo rank_info_from_env();

}  // namespace strata::launcher
