// Checks of all_to_all on integer-valued data (exact in fp32, bf16 and f64, so
// results are compared for equality): even blocks, uneven counts with zeros,
// displacements that are neither packed nor in rank order (the gaps between
// receive blocks must stay untouched), and a rank that sends and receives
// nothing. Shared by the in-process (threads) tests and the rank program
// started as processes under `strata run`. Works for up to 8 ranks.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "partition/communicator.h"
#include "core/error.h"
#include "tests/partition/collective_checks.h"

namespace strata::test {

// Element i of the block rank `from` sends to rank `to`: below 256 for up to 8 ranks (exact in bf16).
inline float block_value(int from, int to, size_t i) { return static_cast<float>(from * 32 + to * 4 + static_cast<int>(i % 4)); }

// Elements rank `from` sends to rank `to`.
using CountFn = std::function<size_t(int from, int to)>;

// Uneven, with zeros (between ranks and, for some ranks, to themselves).
inline size_t uneven_count(int from, int to) {
  return static_cast<size_t>(((from + 2 * to) % 3) * (1 + from + 2 * to));
}

// Displacements of `counts`' blocks laid out in reverse rank order with `gap`
// unused elements before each; returns them and sets *extent to the elements spanned.
inline std::vector<size_t> scattered_displs(const std::vector<size_t>& counts, size_t gap, size_t* extent) {
  std::vector<size_t> displs(counts.size());
  size_t at = 0;
  for (size_t p = counts.size(); p-- > 0;) {
    at += gap;
    displs[p] = at;
    at += counts[p];
  }
  *extent = at;
  return displs;
}

// One all_to_all of `dtype` (fp32, bf16 or f64) with the given counts; packed
// or scattered displacements. Throws Error(kInternal) naming the first mismatch.
inline void check_all_to_all_case(partition::Communicator& comm, Stream& stream, DType dtype, const CountFn& count,
                                  bool scattered, const std::string& what) {
  const int world = comm.world_size(), me = comm.rank();
  std::vector<size_t> send_counts, recv_counts;
  for (int p = 0; p < world; ++p) {
    send_counts.push_back(count(me, p));
    recv_counts.push_back(count(p, me));
  }
  partition::AllToAllSplits splits = partition::AllToAllSplits::packed(send_counts, recv_counts);
  size_t send_extent = splits.send_total(), recv_extent = splits.recv_total();
  if (scattered) {
    splits.send_displs = scattered_displs(send_counts, 3, &send_extent);
    splits.recv_displs = scattered_displs(recv_counts, 2, &recv_extent);
  }
  constexpr float kUntouched = -1.0f;  // what recv holds where no block lands
  std::vector<float> send(send_extent, -7.0f), want(recv_extent, kUntouched);
  for (int p = 0; p < world; ++p) {
    for (size_t i = 0; i < send_counts[p]; ++i) send[splits.send_displs[p] + i] = block_value(me, p, i);
    for (size_t i = 0; i < recv_counts[p]; ++i) want[splits.recv_displs[p] + i] = block_value(p, me, i);
  }
  const size_t element = dtype_nbytes(dtype);
  std::vector<char> send_bytes(send_extent * element), recv_bytes(recv_extent * element);
  auto store = [&](std::vector<char>& bytes, size_t i, float v) {
    if (dtype == DType::kBF16) {
      reinterpret_cast<BFloat16*>(bytes.data())[i] = float_to_bf16(v);
    } else if (dtype == DType::kF64) {
      reinterpret_cast<double*>(bytes.data())[i] = v;
    } else {
      reinterpret_cast<float*>(bytes.data())[i] = v;
    }
  };
  auto load = [&](const std::vector<char>& bytes, size_t i) -> float {
    if (dtype == DType::kBF16) return bf16_to_float(reinterpret_cast<const BFloat16*>(bytes.data())[i]);
    if (dtype == DType::kF64) return static_cast<float>(reinterpret_cast<const double*>(bytes.data())[i]);
    return reinterpret_cast<const float*>(bytes.data())[i];
  };
  for (size_t i = 0; i < send_extent; ++i) store(send_bytes, i, send[i]);
  for (size_t i = 0; i < recv_extent; ++i) store(recv_bytes, i, kUntouched);
  comm.all_to_all(send_bytes.data(), recv_bytes.data(), splits, dtype, stream)->synchronize();
  std::vector<float> got(recv_extent);
  for (size_t i = 0; i < recv_extent; ++i) got[i] = load(recv_bytes, i);
  expect_equal(got, want, fmt::format("all_to_all({}, {}, {})", what, dtype_name(dtype), scattered ? "scattered" : "packed"),
               me);
}

inline void run_all_to_all_checks(partition::Communicator& comm, Stream& stream) {
  const int last = comm.world_size() - 1;
  auto even = [](int, int) { return size_t{5}; };
  // The last rank sends and receives nothing (not even to itself).
  auto last_idle = [last](int from, int to) { return from == last || to == last ? size_t{0} : size_t(3 + from); };
  for (bool scattered : {false, true}) {
    check_all_to_all_case(comm, stream, DType::kF32, even, scattered, "even");
    check_all_to_all_case(comm, stream, DType::kF32, uneven_count, scattered, "uneven");
    check_all_to_all_case(comm, stream, DType::kBF16, uneven_count, scattered, "uneven");
    check_all_to_all_case(comm, stream, DType::kF32, last_idle, scattered, "last rank idle");
  }
  check_all_to_all_case(comm, stream, DType::kF64, uneven_count, false, "uneven");
  // The even convenience, as callers write it.
  const size_t numel = 7;
  std::vector<float> send(numel * comm.world_size()), recv(send.size(), -1.0f), want(send.size());
  for (int p = 0; p <= last; ++p) {
    for (size_t i = 0; i < numel; ++i) {
      send[p * numel + i] = block_value(comm.rank(), p, i);
      want[p * numel + i] = block_value(p, comm.rank(), i);
    }
  }
  comm.all_to_all(send.data(), recv.data(), partition::AllToAllSplits::even(comm.world_size(), numel), DType::kF32,
                  stream)
      ->synchronize();
  expect_equal(recv, want, "all_to_all(AllToAllSplits::even)", comm.rank());
}

}  // namespace strata::test
