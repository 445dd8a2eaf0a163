// DeviceOptimizer (the optimizer on the accelerator), on the cpu accelerator:
// a shard larger than one checkpoint chunk saves and restores exactly across
// the chunk boundary, and the restored optimizer steps on bit for bit.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "core/accelerator.h"
#include "offload/device_optimizer.h"

using namespace strata;
using offload::DeviceOptimizer;

TEST_CASE("device optimizer: save and restore over several chunks, then the same next step", "[engine][device]") {
  auto acc = make_cpu_accelerator();
  auto stream = acc->create_stream();
  auto ops = ops::make_ops(*acc);
  const size_t numel = DeviceOptimizer::kStateChunkNumel + 5;  // two chunks, the second short
  const Shape shape{static_cast<int64_t>(numel)};
  Tensor params = acc->allocate_tensor(DType::kBF16, shape), grad = acc->allocate_tensor(DType::kF32, shape);
  std::mt19937 gen(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> values(numel);
  for (float& x : values) x = d(gen);
  convert(values.data(), DType::kF32, params.data(), DType::kBF16, numel);
  for (size_t i = 0; i < numel; ++i) static_cast<float*>(grad.data())[i] = d(gen);

  kernels::AdamConfig adam;
  adam.lr = 1e-2f;
  DeviceOptimizer first(*acc, *ops, *stream, numel, size_t{1} << 20, adam);
  first.initialize(params.data(), DType::kBF16);
  first.step(static_cast<float*>(grad.data()), 0.5f, params.data(), DType::kBF16);

  std::vector<float> master(numel), exp_avg(numel), exp_avg_sq(numel);
  size_t covered = 0;
  first.save([&](size_t at, size_t count, const float* m, const float* a, const float* s) {
    CHECK(at == covered);  // in order, no gap
    std::memcpy(master.data() + at, m, count * sizeof(float));
    std::memcpy(exp_avg.data() + at, a, count * sizeof(float));
    std::memcpy(exp_avg_sq.data() + at, s, count * sizeof(float));
    covered += count;
  });
  REQUIRE(covered == numel);

  DeviceOptimizer second(*acc, *ops, *stream, numel, size_t{1} << 20, adam);
  second.restore(
      [&](size_t at, size_t count, float* m, float* a, float* s) {
        std::memcpy(m, master.data() + at, count * sizeof(float));
        std::memcpy(a, exp_avg.data() + at, count * sizeof(float));
        std::memcpy(s, exp_avg_sq.data() + at, count * sizeof(float));
      },
      first.step_count());
  CHECK(second.step_count() == 1);

  // The next step from either gives the same bits, in the fp32 copy too.
  Tensor out_first = acc->allocate_tensor(DType::kF32, shape), out_second = acc->allocate_tensor(DType::kF32, shape);
  first.step(static_cast<float*>(grad.data()), 0.5f, out_first.data(), DType::kF32);
  second.step(static_cast<float*>(grad.data()), 0.5f, out_second.data(), DType::kF32);
  CHECK(std::memcmp(out_first.data(), out_second.data(), out_first.nbytes()) == 0);
  // And the step moved the weights: the comparison is not of no-ops.
  CHECK(std::memcmp(out_first.data(), master.data(), out_first.nbytes()) != 0);
}
