// Checks of every collective on integer-valued data (exact in fp32 and bf16,
// so results are compared for equality), shared by the in-process (threads)
// tests and the rank program started as processes under `strata run`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "partition/communicator.h"
#include "core/error.h"

namespace strata::test {

// Element i of rank r's input: small integers, distinct per rank and position.
inline float input_value(int rank, size_t i) { return static_cast<float>((rank + 1) * 3 + static_cast<int>(i % 11)); }

inline void expect_equal(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                         int rank) {
  STRATA_CHECK(got.size() == want.size(), kInternal, "{} on rank {}: size {} != {}", what, rank, got.size(),
               want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    STRATA_CHECK(got[i] == want[i], kInternal, "{} on rank {}: element {} is {}, expected {}", what, rank, i, got[i],
                 want[i]);
  }
}

// Runs allgather, reduce-scatter (sum, average), allreduce (sum, average, in
// place), broadcast from every root and barrier with `numel` elements (fp32,
// and bf16 for reduce-scatter/allreduce); throws Error(kInternal) naming the
// first mismatch.
inline void run_collective_checks(partition::Communicator& comm, Stream& stream, size_t numel) {
  const int world = comm.world_size(), me = comm.rank();
  std::vector<float> mine(numel);
  for (size_t i = 0; i < numel; ++i) mine[i] = input_value(me, i);

  std::vector<float> gathered(numel * world, -1.0f), want(numel * world);
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < numel; ++i) want[r * numel + i] = input_value(r, i);
  }
  comm.allgather(mine.data(), gathered.data(), numel, DType::kF32, stream)->synchronize();
  expect_equal(gathered, want, "allgather", me);

  // Reduce-scatter input: block b of rank r holds input_value(r, b * numel + i).
  std::vector<float> rs_in(numel * world), rs_out(numel, -1.0f), rs_want(numel, 0.0f);
  for (size_t j = 0; j < rs_in.size(); ++j) rs_in[j] = input_value(me, j);
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < numel; ++i) rs_want[i] += input_value(r, me * numel + i);
  }
  comm.reduce_scatter(rs_in.data(), rs_out.data(), numel, DType::kF32, partition::ReduceOp::kSum, stream)
      ->synchronize();
  expect_equal(rs_out, rs_want, "reduce_scatter(sum)", me);
  std::vector<float> rs_avg_want = rs_want;
  for (float& v : rs_avg_want) v /= static_cast<float>(world);
  comm.reduce_scatter(rs_in.data(), rs_out.data(), numel, DType::kF32, partition::ReduceOp::kAverage, stream)
      ->synchronize();
  expect_equal(rs_out, rs_avg_want, "reduce_scatter(average)", me);

  std::vector<float> ar_want(numel, 0.0f), ar_out(numel, -1.0f);
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < numel; ++i) ar_want[i] += input_value(r, i);
  }
  comm.allreduce(mine.data(), ar_out.data(), numel, DType::kF32, partition::ReduceOp::kSum, stream)->synchronize();
  expect_equal(ar_out, ar_want, "allreduce(sum)", me);
  std::vector<float> in_place = mine;
  comm.allreduce(in_place.data(), in_place.data(), numel, DType::kF32, partition::ReduceOp::kAverage, stream)
      ->synchronize();
  std::vector<float> ar_avg_want = ar_want;
  for (float& v : ar_avg_want) v /= static_cast<float>(world);
  expect_equal(in_place, ar_avg_want, "allreduce(average, in place)", me);

  // bf16: the same integers are exact (all sums stay below 256).
  std::vector<BFloat16> bf_in(numel * world), bf_out(numel);
  for (size_t j = 0; j < bf_in.size(); ++j) bf_in[j] = float_to_bf16(rs_in[j]);
  comm.reduce_scatter(bf_in.data(), bf_out.data(), numel, DType::kBF16, partition::ReduceOp::kSum, stream)
      ->synchronize();
  std::vector<float> bf_got(numel);
  for (size_t i = 0; i < numel; ++i) bf_got[i] = bf16_to_float(bf_out[i]);
  expect_equal(bf_got, rs_want, "reduce_scatter(sum, bf16)", me);
  comm.allreduce(bf_in.data(), bf_out.data(), numel, DType::kBF16, partition::ReduceOp::kSum, stream)->synchronize();
  for (size_t i = 0; i < numel; ++i) bf_got[i] = bf16_to_float(bf_out[i]);
  expect_equal(bf_got, ar_want, "allreduce(sum, bf16)", me);

  for (int root = 0; root < world; ++root) {
    std::vector<float> data(numel);
    for (size_t i = 0; i < numel; ++i) data[i] = input_value(me, i);
    comm.broadcast(data.data(), numel, DType::kF32, root, stream)->synchronize();
    std::vector<float> root_data(numel);
    for (size_t i = 0; i < numel; ++i) root_data[i] = input_value(root, i);
    expect_equal(data, root_data, fmt::format("broadcast(root {})", root), me);
  }
  comm.barrier(stream)->synchronize();
}

}  // namespace strata::test
