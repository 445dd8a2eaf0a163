// The backend-independent parts of communicator.h: all_to_all splits and the
// shared checks and error wording of communicator_support.h.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>

#include "partition/communicator_support.h"
#include "core/error.h"

namespace strata::partition {
namespace {
std::vector<size_t> prefix_sums(const std::vector<size_t>& counts) {
  std::vector<size_t> displs(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), size_t{0});
  return displs;
}

size_t total(const std::vector<size_t>& counts) { return std::accumulate(counts.begin(), counts.end(), size_t{0}); }
}  // namespace

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "average"; }

AllToAllSplits AllToAllSplits::even(int world_size, size_t numel) {
  STRATA_CHECK(world_size >= 1, kBadArgument, "all_to_all over {} ranks: the world size must be at least 1",
               world_size);
  const std::vector<size_t> counts(static_cast<size_t>(world_size), numel);
  return packed(counts, counts);
}

AllToAllSplits AllToAllSplits::packed(std::vector<size_t> send_counts, std::vector<size_t> recv_counts) {
  AllToAllSplits splits;
  splits.send_displs = prefix_sums(send_counts);
  splits.recv_displs = prefix_sums(recv_counts);
  splits.send_counts = std::move(send_counts);
  splits.recv_counts = std::move(recv_counts);
  return splits;
}

size_t AllToAllSplits::send_total() const { return total(send_counts); }
size_t AllToAllSplits::recv_total() const { return total(recv_counts); }

namespace detail {

std::string describe_rank(const CommunicatorOptions& options) {
  if (options.group.empty()) return fmt::format("rank {} of {}", options.rank, options.world_size);
  return fmt::format("rank {} in {}", job_rank(options, options.rank), options.group);
}

int job_rank(const CommunicatorOptions& options, int member) {
  if (options.members.empty() || member < 0 || static_cast<size_t>(member) >= options.members.size()) return member;
  return options.members[static_cast<size_t>(member)];
}

std::string describe_peer(const CommunicatorOptions& options, int member) {
  if (member >= 0 && static_cast<size_t>(member) < options.member_names.size()) {
    return options.member_names[static_cast<size_t>(member)];
  }
  return fmt::format("rank {}", job_rank(options, member));
}

std::string describe_p2p(DType dtype, const Shape& shape, uint64_t tag, const std::string& what) {
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  return fmt::format("[{}] {} (tag {:#x}{}{})", dims, dtype_name(dtype), tag, what.empty() ? "" : ": ", what);
}

void check_exchange(const CommunicatorOptions& options, std::span<const P2POp> ops) {
  const std::string who = describe_rank(options);
  STRATA_CHECK(!ops.empty(), kBadArgument, "exchange on {}: no send or receive given", who);
  for (const P2POp& op : ops) {
    const char* side = op.kind == P2POp::Kind::kSend ? "send" : "receive";
    STRATA_CHECK(op.peer >= 0 && op.peer < options.world_size && op.peer != options.rank, kBadArgument,
                 "exchange on {}: a {} of {} names peer {}, which is {}", who, side,
                 describe_p2p(op.dtype, op.shape, op.tag, op.what), op.peer,
                 op.peer == options.rank ? "this rank" : fmt::format("outside {} ranks", options.world_size));
    for (int64_t d : op.shape) {
      STRATA_CHECK(d >= 0, kBadArgument, "exchange on {}: a {} of {} has a negative dimension", who, side,
                   describe_p2p(op.dtype, op.shape, op.tag, op.what));
    }
    STRATA_CHECK(op.data != nullptr || op.numel() == 0, kBadArgument, "exchange on {}: a {} of {} has no buffer", who,
                 side, describe_p2p(op.dtype, op.shape, op.tag, op.what));
  }
}

void check_options(const CommunicatorOptions& options) {
  const std::string where = options.group.empty() ? "" : fmt::format(" of {}", options.group);
  STRATA_CHECK(options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size, kBadArgument,
               "communicator{}: rank {} outside world size {}", where, options.rank, options.world_size);
  STRATA_CHECK(options.members.empty() || options.members.size() == static_cast<size_t>(options.world_size),
               kBadArgument, "communicator{}: {} members listed for a world size of {}", where,
               options.members.size(), options.world_size);
  STRATA_CHECK(options.member_names.empty() || options.member_names.size() == static_cast<size_t>(options.world_size),
               kBadArgument, "communicator{}: {} member names for a world size of {}", where,
               options.member_names.size(), options.world_size);
}

void check_all_to_all(const CommunicatorOptions& options, const void* send, const void* recv,
                      const AllToAllSplits& splits, DType dtype) {
  const std::string who = describe_rank(options);
  const auto world = static_cast<size_t>(options.world_size);
  const std::pair<const char*, const std::vector<size_t>*> vectors[] = {{"send_counts", &splits.send_counts},
                                                                        {"send_displs", &splits.send_displs},
                                                                        {"recv_counts", &splits.recv_counts},
                                                                        {"recv_displs", &splits.recv_displs}};
  for (const auto& [name, values] : vectors) {
    STRATA_CHECK(values->size() == world, kBadArgument,
                 "all_to_all on {}: {} has {} entries, one per rank ({}) is needed", who, name, values->size(), world);
  }
  const auto me = static_cast<size_t>(options.rank);
  STRATA_CHECK(splits.send_counts[me] == splits.recv_counts[me], kBadArgument,
               "all_to_all on {}: the block this rank sends itself has {} elements (send_counts[{}]) but {} are "
               "expected back (recv_counts[{}])",
               who, splits.send_counts[me], me, splits.recv_counts[me], me);
  // [begin, end) in elements of each non-empty block, checked against overflow.
  const size_t limit = std::numeric_limits<size_t>::max() / dtype_nbytes(dtype);
  auto extent = [&](const char* side, const std::vector<size_t>& counts, const std::vector<size_t>& displs) {
    std::vector<std::pair<size_t, size_t>> blocks;
    for (size_t p = 0; p < world; ++p) {
      if (counts[p] == 0) continue;
      STRATA_CHECK(displs[p] <= limit && counts[p] <= limit - displs[p], kBadArgument,
                   "all_to_all on {}: {} block for rank {} ({} elements at element {}) overflows the address space",
                   who, side, job_rank(options, static_cast<int>(p)), counts[p], displs[p]);
      blocks.emplace_back(displs[p], displs[p] + counts[p]);
    }
    return blocks;
  };
  auto send_blocks = extent("send", splits.send_counts, splits.send_displs);
  auto recv_blocks = extent("receive", splits.recv_counts, splits.recv_displs);
  std::sort(recv_blocks.begin(), recv_blocks.end());
  for (size_t i = 1; i < recv_blocks.size(); ++i) {
    STRATA_CHECK(recv_blocks[i].first >= recv_blocks[i - 1].second, kBadArgument,
                 "all_to_all on {}: receive blocks overlap (elements [{}, {}) and [{}, {}) of recv)", who,
                 recv_blocks[i - 1].first, recv_blocks[i - 1].second, recv_blocks[i].first, recv_blocks[i].second);
  }
  auto end_of = [](const std::vector<std::pair<size_t, size_t>>& blocks) {
    size_t end = 0;
    for (const auto& block : blocks) end = std::max(end, block.second);
    return end;
  };
  const size_t send_nbytes = end_of(send_blocks) * dtype_nbytes(dtype);
  const size_t recv_nbytes = end_of(recv_blocks) * dtype_nbytes(dtype);
  if (send_nbytes > 0 && recv_nbytes > 0) {
    const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
    STRATA_CHECK(s + send_nbytes <= r || r + recv_nbytes <= s, kBadArgument,
                 "all_to_all on {}: send ({} bytes) and recv ({} bytes) overlap; it does not run in place", who,
                 send_nbytes, recv_nbytes);
  }
}

}  // namespace detail
}  // namespace strata::partition
