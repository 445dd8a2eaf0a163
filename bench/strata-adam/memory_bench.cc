// strata-adam, in memory: the optimizer kernel timed per ISA and dtype mix,
// each step alternating with an Adam-shaped triad pass over the same arrays,
// checked against the scalar reference; and STREAM's triad as a reference.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "bench/common/pattern.h"
#include "bench/common/stats.h"
#include "bench/strata-adam/adam_bench.h"
#include "bench/strata-adam/stream_passes.h"
#include "core/error.h"
#include "core/host_memory.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

double adam_bytes_per_element(DType grad_dtype, std::optional<DType> copy_dtype) {
  return 24.0 + static_cast<double>(dtype_nbytes(grad_dtype)) +
         (copy_dtype ? static_cast<double>(dtype_nbytes(*copy_dtype)) : 0.0);
}

TriadResult run_stream_triad(size_t numel, int threads, int iters) {
  HostArray a(numel * 4), b(numel * 4), c(numel * 4);
  float* __restrict pa = a.as<float>();
  const float* __restrict pb = b.as<float>();
  const float* __restrict pc = c.as<float>();
  fill_pseudo(a.as<float>(), numel, 0, threads);
  fill_pseudo(b.as<float>(), numel, 1, threads);
  fill_pseudo(c.as<float>(), numel, 2, threads);
  const float s = 3.0f;
  TriadResult r;
  r.numel = numel;
  std::vector<double> times;
  for (int it = 0; it < iters + 1; ++it) {  // the first pass warms up
    const auto start = Clock::now();
    // Vectorised (SSE2 baseline), static split like STREAM's.
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (size_t i = 0; i < numel; ++i) pa[i] = pb[i] + s * pc[i];
    const double t = seconds_since(start);
    if (it > 0) times.push_back(t);
  }
  r.seconds = median(times);
  r.gb_per_s = 3.0 * 4.0 * static_cast<double>(numel) / r.seconds / 1e9;
  r.correct = true;
  for (size_t i = 0; i < numel; i += std::max<size_t>(1, numel / 4099)) {
    r.correct &= pa[i] == pb[i] + s * pc[i];
  }
  return r;
}

std::vector<KernelRow> run_kernel_cases(const std::vector<KernelCase>& cases, size_t numel,
                                        int threads, int iters, bool adamw) {
  HostArray p(numel * 4), m(numel * 4), v(numel * 4), g32(numel * 4), g16(numel * 2), copy(numel * 2);
  fill_pseudo(p.as<float>(), numel, 11, threads);
  fill_pseudo(m.as<float>(), numel, 0, threads);
  fill_pseudo(v.as<float>(), numel, 0, threads);
  fill_pseudo(g32.as<float>(), numel, 12, threads);
  // First touch of the 16-bit arrays by the same threads (values come later).
  const std::vector<uint16_t> zeros(64, 0);
  land16(zeros.data(), zeros.size(), g16.as<uint16_t>(), numel, threads);
  land16(zeros.data(), zeros.size(), copy.as<uint16_t>(), numel, threads);

  // Samples checked against the scalar reference: spread over the array plus the tail.
  std::vector<size_t> sample;
  for (size_t i = 0; i < numel; i += std::max<size_t>(1, numel / 4096)) sample.push_back(i);
  for (size_t i = numel > 67 ? numel - 67 : 0; i < numel; ++i) sample.push_back(i);
  std::sort(sample.begin(), sample.end());
  sample.erase(std::unique(sample.begin(), sample.end()), sample.end());

  kernels::AdamConfig config;
  config.weight_decay = 0.01f;
  config.adamw = adamw;
  int64_t step = 0;
  DType g16_dtype = DType::kF32;  // what g16 holds now
  std::vector<KernelRow> rows;
  for (const KernelCase& kc : cases) {
    const void* grad = g32.as<void>();
    if (kc.grad_dtype != DType::kF32) {
      if (g16_dtype != kc.grad_dtype) {
        convert(g32.as<void>(), DType::kF32, g16.as<void>(), kc.grad_dtype, numel);
        g16_dtype = kc.grad_dtype;
      }
      grad = g16.as<void>();
    }
    kernels::AdamBuffers b{p.as<float>(), m.as<float>(), v.as<float>(), grad, kc.grad_dtype,
                           kc.copy_dtype ? copy.as<void>() : nullptr,
                           kc.copy_dtype.value_or(DType::kBF16), numel};
    KernelRow row;
    if (!kc.isa && kernels::default_isa_info().basis == "calibrating") {
      // The default ISA is decided by timing the first large updates that ask
      // for none (kernels/optimizer.h): let those happen before the row.
      for (int trial = 0; trial < 6 && kernels::default_isa_info().basis == "calibrating"; ++trial) {
        kernels::adam_step(kernels::adam_coefficients(config, ++step, 0.5f), b, std::nullopt, threads);
      }
    }
    row.default_isa = !kc.isa.has_value();
    row.isa = std::string(kernels::isa_name(kc.isa.value_or(kernels::default_isa())));
    row.grad_dtype = std::string(dtype_name(kc.grad_dtype));
    row.copy_dtype = kc.copy_dtype ? std::string(dtype_name(*kc.copy_dtype)) : "none";
    row.numel = numel;
    row.threads = threads;

    // Check step: gather the samples, run, compare with the scalar formula on the gathered copy.
    const size_t ns = sample.size();
    std::vector<float> sp(ns), sm(ns), sv(ns), sg32(ns);
    std::vector<uint16_t> sg16(ns), scopy(ns);
    for (size_t j = 0; j < ns; ++j) {
      const size_t i = sample[j];
      sp[j] = b.param[i];
      sm[j] = b.exp_avg[i];
      sv[j] = b.exp_avg_sq[i];
      if (kc.grad_dtype == DType::kF32) sg32[j] = g32.as<float>()[i];
      else sg16[j] = g16.as<uint16_t>()[i];
    }
    const auto coeffs = kernels::adam_coefficients(config, ++step, 0.5f);
    kernels::adam_step(coeffs, b, kc.isa, threads);
    kernels::AdamBuffers ref{sp.data(), sm.data(), sv.data(),
                             kc.grad_dtype == DType::kF32 ? static_cast<const void*>(sg32.data())
                                                          : static_cast<const void*>(sg16.data()),
                             kc.grad_dtype, kc.copy_dtype ? scopy.data() : nullptr,
                             kc.copy_dtype.value_or(DType::kBF16), ns};
    kernels::adam_step(coeffs, ref, kernels::CpuIsa::kScalar, 1);
    size_t bad = 0;
    double worst = 0;
    for (size_t j = 0; j < ns; ++j) {
      const size_t i = sample[j];
      // One step: only FMA contraction separates the variants.
      const double err = std::abs(static_cast<double>(b.param[i]) - sp[j]) / (1e-6 + 1e-6 * std::abs(sp[j]));
      worst = std::max(worst, err);
      bad += err > 1.0;
      bad += std::abs(b.exp_avg_sq[i] - sv[j]) > 1e-6 * std::abs(sv[j]) + 1e-12;
      if (kc.copy_dtype) {
        const float x = b.param[i];
        const uint16_t expect = *kc.copy_dtype == DType::kBF16 ? float_to_bf16(x).bits : float_to_half(x).bits;
        bad += copy.as<uint16_t>()[i] != expect;
      }
    }
    // The row's triad, untimed once: it must leave p, m, v as they were.
    for (size_t j = 0; j < ns; ++j) {
      const size_t i = sample[j];
      sp[j] = b.param[i];
      sm[j] = b.exp_avg[i];
      sv[j] = b.exp_avg_sq[i];
    }
    adam_shaped_triad(b, threads);
    const bool triad_ok = adam_shaped_triad_check(b, sample.data(), ns, sp.data(), sm.data(), sv.data());
    row.correct = bad == 0 && triad_ok;
    row.check_detail = fmt::format("{} samples, {} mismatches, worst param error {:.3f} of tolerance{}",
                                   ns, bad, worst, triad_ok ? "" : "; the triad changed the state");

    // Alternating, so both see the same neighbours on a shared machine (this
    // VM's bandwidth moves by 1.5x within minutes).
    std::vector<double> times, triad_times;
    for (int it = 0; it < iters; ++it) {
      triad_times.push_back(adam_shaped_triad(b, threads));
      const auto c = kernels::adam_coefficients(config, ++step, 0.5f);
      const auto start = Clock::now();
      kernels::adam_step(c, b, kc.isa, threads);
      times.push_back(seconds_since(start));
    }
    row.seconds = median(times);
    row.triad_seconds = median(triad_times);
    row.params_per_s = static_cast<double>(numel) / row.seconds;
    row.bytes = adam_bytes_per_element(kc.grad_dtype, kc.copy_dtype) * static_cast<double>(numel);
    row.gb_per_s = row.bytes / row.seconds / 1e9;
    row.triad_gb_per_s = row.bytes / row.triad_seconds / 1e9;
    // The median of the pairs' ratios, not the ratio of the medians: each pair
    // ran back to back, so a neighbour's load that drifts over the row cancels.
    std::vector<double> pair_ratios;
    for (size_t i = 0; i < times.size(); ++i) pair_ratios.push_back(triad_times[i] / times[i]);
    row.ratio = median(pair_ratios);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace strata::bench
