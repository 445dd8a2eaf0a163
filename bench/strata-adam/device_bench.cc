// The optimizer on the accelerator (offload_optimizer.device none): one
// Ops::adam_step over numel parameters in accelerator memory (fp32 gradient,
// bf16 copy — what DeviceOptimizer runs), timed in alternation with a
// device-to-device copy that is the row's anchor, and checked against the CPU
// kernel on the same inputs.
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "bench/common/stats.h"
#include "bench/strata-adam/adam_bench.h"
#include "kernels/ops.h"
#include "core/accelerator.h"
#include "core/error.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

DeviceStepResult run_device_step(const std::string& accelerator_kind, size_t numel, int iters, bool adamw) {
  STRATA_CHECK(numel > 0 && iters > 0, kBadArgument, "device step: numel and iters must be > 0");
  auto accelerator = make_accelerator(accelerator_kind);
  auto stream = accelerator->create_stream();
  auto ops = ops::make_ops(*accelerator);
  auto ctx = ops->make_context(*stream);
  DeviceStepResult r;
  r.accelerator = accelerator->name();
  r.numel = numel;

  const size_t f32 = numel * sizeof(float);
  const Shape shape{static_cast<int64_t>(numel)};
  Tensor p = accelerator->allocate_tensor(DType::kF32, shape), m = accelerator->allocate_tensor(DType::kF32, shape),
         v = accelerator->allocate_tensor(DType::kF32, shape), g = accelerator->allocate_tensor(DType::kF32, shape),
         copy = accelerator->allocate_tensor(DType::kBF16, shape),
         anchor = accelerator->allocate_tensor(DType::kF32, shape);

  // Inputs: a mid-training state (non-zero moments), uploaded once.
  std::vector<float> hp(numel), hm(numel), hv(numel), hg(numel);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (size_t i = 0; i < numel; ++i) {
    hp[i] = d(gen);
    hm[i] = 0.1f * d(gen);
    hv[i] = 0.01f * std::abs(d(gen));
    hg[i] = d(gen);
  }
  accelerator->copy_async(p.data(), hp.data(), f32, CopyKind::kHostToDevice, *stream);
  accelerator->copy_async(m.data(), hm.data(), f32, CopyKind::kHostToDevice, *stream);
  accelerator->copy_async(v.data(), hv.data(), f32, CopyKind::kHostToDevice, *stream);
  accelerator->copy_async(g.data(), hg.data(), f32, CopyKind::kHostToDevice, *stream);
  stream->synchronize();

  kernels::AdamConfig config;
  config.lr = 1e-3f;
  config.weight_decay = 0.01f;
  config.adamw = adamw;
  const auto step = [&](int64_t n) {
    ops->adam_step(*ctx, kernels::adam_coefficients(config, n, 0.5f), p.view(), m.view(), v.view(), g.view(),
                   copy.view());
  };

  // Correctness: step 1 on the device against the CPU kernel on the same inputs.
  step(1);
  std::vector<float> dp(numel), dm(numel), dv(numel);
  std::vector<uint16_t> dcopy(numel), hcopy(numel);
  accelerator->copy_async(dp.data(), p.data(), f32, CopyKind::kDeviceToHost, *stream);
  accelerator->copy_async(dm.data(), m.data(), f32, CopyKind::kDeviceToHost, *stream);
  accelerator->copy_async(dv.data(), v.data(), f32, CopyKind::kDeviceToHost, *stream);
  accelerator->copy_async(dcopy.data(), copy.data(), numel * 2, CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  kernels::AdamBuffers host;
  host.param = hp.data();
  host.exp_avg = hm.data();
  host.exp_avg_sq = hv.data();
  host.grad = hg.data();
  host.param16 = hcopy.data();
  host.numel = numel;
  kernels::adam_step(kernels::adam_coefficients(config, 1, 0.5f), host);
  size_t mismatches = 0;
  for (size_t i = 0; i < numel; ++i) {
    mismatches += std::memcmp(&dp[i], &hp[i], 4) != 0 || std::memcmp(&dm[i], &hm[i], 4) != 0 ||
                  std::memcmp(&dv[i], &hv[i], 4) != 0 || dcopy[i] != hcopy[i];
  }
  r.correct = mismatches == 0;
  r.check_detail = r.correct ? "bit-identical to the CPU kernel (" +
                                   std::string(kernels::isa_name(kernels::default_isa())) + ")"
                             : std::to_string(mismatches) + " of " + std::to_string(numel) +
                                   " elements differ from the CPU kernel (" +
                                   std::string(kernels::isa_name(kernels::default_isa())) + ")";

  // Timing: Adam and the anchor copy alternately, each to completion.
  std::vector<double> adam_s, copy_s, ratios;
  for (int i = 0; i < iters + 1; ++i) {
    auto t0 = Clock::now();
    step(2 + i);
    stream->synchronize();
    const double a = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    accelerator->copy_async(anchor.data(), g.data(), f32, CopyKind::kDeviceToDevice, *stream);
    stream->synchronize();
    const double c = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i == 0) continue;  // warm-up pair
    adam_s.push_back(a);
    copy_s.push_back(c);
    // The anchor moves 8 bytes per element (read 4, write 4); Adam moves
    // bytes_per_element: at the copy's bandwidth it would take that / 8 times as long.
    ratios.push_back(c * (adam_bytes_per_element(DType::kF32, DType::kBF16) / 8.0) / a);
  }
  r.bytes = adam_bytes_per_element(DType::kF32, DType::kBF16) * static_cast<double>(numel);
  r.seconds = median(adam_s);
  r.params_per_s = static_cast<double>(numel) / r.seconds;
  r.gb_per_s = r.bytes / r.seconds / 1e9;
  r.copy_seconds = median(copy_s);
  r.copy_gb_per_s = 8.0 * static_cast<double>(numel) / r.copy_seconds / 1e9;
  r.ratio = median(ratios);
  return r;
}

}  // namespace strata::bench
