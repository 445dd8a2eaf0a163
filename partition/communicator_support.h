// What the Gloo and NCCL communicators share (internal to partition/): how
// their errors name this rank and its group, the checks of their options, and
// the checks of an all_to_all that one rank can make before submitting it.
#pragma once

#include <string>

#include "partition/communicator.h"

namespace strata::partition::detail {

// "rank 1 of 4" for a communicator over the whole job; "rank 3 in tp group 1
// (ranks 2,3)" for a group (the job rank of this member).
std::string describe_rank(const CommunicatorOptions& options);
// The job rank of the communicator's rank `member` (itself for the whole job).
int job_rank(const CommunicatorOptions& options, int member);
// What errors call the communicator's rank `member` as a point-to-point
// peer: its member name ("pp stage 1 (ranks 2,3)") or "rank <job rank>".
std::string describe_peer(const CommunicatorOptions& options, int member);
// "[2, 12, 32] fp32 (tag 0x...): activation of micro-batch 3 ..." for errors.
std::string describe_p2p(DType dtype, const Shape& shape, uint64_t tag, const std::string& what);
// Throws Error(kBadArgument) naming the op for what one rank can check of an
// exchange (Communicator::exchange).
void check_exchange(const CommunicatorOptions& options, std::span<const P2POp> ops);
// Throws Error(kBadArgument) for a rank outside the world size or members that
// do not list one job rank per rank of the communicator.
void check_options(const CommunicatorOptions& options);
// Throws Error(kBadArgument) naming the op, the rank and the offending entry
// (see AllToAllSplits for what is checked).
void check_all_to_all(const CommunicatorOptions& options, const void* send, const void* recv,
                      const AllToAllSplits& splits, DType dtype);

}  // namespace strata::partition::detail
