// strata-adam, the per-parameter CPU-side path of a ZeRO-3 offloaded step with
// bf16 gradients and a bf16 parameter copy, three ways in alternation:
//   strata         land the bf16 gradient (2 B/param), one adam_step that reads
//                  it and writes the copy in the same pass;
//   deepspeed-way  the same work done as DeepSpeed does it, written by us with
//                  the same kernel and threads: land into an fp32 gradient
//                  buffer, adam_step over fp32 gradients, a separate copy pass;
//   deepspeed      DeepSpeed's own: the same fp32 landing, then
//                  DeepSpeedCPUAdam.step() and torch copy_ to bf16 (coprocess).
// The landing stands in for the device-to-host transfer, which on a GPU machine
// a DMA writes into host memory: a pass that writes the landed gradient with
// non-temporal stores from a cache-resident block of bf16 values, the same
// pass (2 or 4 B/param) for every way — the DMA is nobody's code.
#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "bench/common/pattern.h"
#include "bench/common/stats.h"
#include "bench/strata-adam/adam_bench.h"
#include "bench/strata-adam/deepspeed_adam.h"
#include "bench/strata-adam/stream_passes.h"
#include "core/error.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr float kLr = 1e-3f, kWeightDecay = 0.01f;
// bf16 gradient values the landings repeat: 32 KiB, stays in L1/L2.
constexpr size_t kBlockNumel = 16384;

double timed_step(const kernels::AdamCoefficients& c, const kernels::AdamBuffers& b, int threads) {
  const auto start = Clock::now();
  kernels::adam_step(c, b, std::nullopt, threads);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Parts {
  std::vector<double> total, land, adam, copy;
  void add(double l, double a, double c) {
    land.push_back(l);
    adam.push_back(a);
    copy.push_back(c);
    total.push_back(l + a + c);
  }
};

PathRow row_of(std::string name, std::string isa, size_t numel, double bytes_per_param, const Parts& parts) {
  PathRow r;
  r.name = std::move(name);
  r.isa = std::move(isa);
  r.numel = numel;
  r.seconds = median(parts.total);
  r.land_seconds = median(parts.land);
  r.adam_seconds = median(parts.adam);
  r.copy_seconds = median(parts.copy);
  r.params_per_s = static_cast<double>(numel) / r.seconds;
  r.bytes = bytes_per_param * static_cast<double>(numel);
  return r;
}

}  // namespace

PathResult run_path(size_t numel, int threads, int iters, bool adamw, const std::string& python) {
  PathResult out;
  std::unique_ptr<DeepSpeedAdam> ds;
  if (python.empty()) {
    out.deepspeed_skipped = "not asked for (--vs-deepspeed)";
  } else {
    ds = std::make_unique<DeepSpeedAdam>(python, threads);
    if (!ds->available()) {
      out.deepspeed_skipped = ds->why();
      ds.reset();
    } else {
      try {
        ds->setup(numel, kLr, kWeightDecay, adamw);
        out.deepspeed_versions = ds->versions();
      } catch (const std::exception& e) {
        out.deepspeed_skipped = e.what();
        ds.reset();
      }
    }
  }

  HostArray p(numel * 4), m(numel * 4), v(numel * 4), g32(numel * 4), g16(numel * 2), copy16(numel * 2);
  std::vector<uint16_t> block(kBlockNumel);
  for (size_t i = 0; i < kBlockNumel; ++i) block[i] = float_to_bf16(pseudo(i, 13)).bits;
  fill_pseudo(p.as<float>(), numel, 11, threads);  // first touches, by the same threads
  fill_pseudo(m.as<float>(), numel, 0, threads);
  fill_pseudo(v.as<float>(), numel, 0, threads);
  land_bf16_to_f32(block.data(), kBlockNumel, g32.as<float>(), numel, threads);
  land16(block.data(), kBlockNumel, g16.as<uint16_t>(), numel, threads);
  copy_f32_to_bf16(p.as<float>(), copy16.as<uint16_t>(), numel, threads);

  kernels::AdamConfig config;
  config.lr = kLr;
  config.weight_decay = kWeightDecay;
  config.adamw = adamw;
  int64_t step = 0;
  const kernels::AdamBuffers fused{p.as<float>(), m.as<float>(), v.as<float>(), g16.as<void>(),
                                   DType::kBF16, copy16.as<void>(), DType::kBF16, numel};
  const kernels::AdamBuffers plain{p.as<float>(), m.as<float>(), v.as<float>(), g32.as<void>(),
                                   DType::kF32, nullptr, DType::kBF16, numel};
  // Let the default ISA's timed trials (kernels/optimizer.h) happen before the rows.
  for (int trial = 0; trial < 6 && kernels::default_isa_info().basis == "calibrating"; ++trial) {
    kernels::adam_step(kernels::adam_coefficients(config, ++step), fused, std::nullopt, threads);
  }
  const std::string isa(kernels::isa_name(kernels::default_isa()));

  // One untimed pass of each way, checked on samples.
  std::string problems;
  std::vector<size_t> sample;
  for (size_t i = 0; i < numel; i += std::max<size_t>(1, numel / 4096)) sample.push_back(i);
  sample.push_back(numel - 1);
  const auto copy_matches = [&] {
    size_t bad = 0;
    for (size_t i : sample) bad += copy16.as<uint16_t>()[i] != float_to_bf16(p.as<float>()[i]).bits;
    return bad;
  };
  land16(block.data(), kBlockNumel, g16.as<uint16_t>(), numel, threads);
  kernels::adam_step(kernels::adam_coefficients(config, ++step), fused, std::nullopt, threads);
  size_t bad_strata = copy_matches();
  for (size_t i : sample) bad_strata += g16.as<uint16_t>()[i] != block[i % kBlockNumel];
  land_bf16_to_f32(block.data(), kBlockNumel, g32.as<float>(), numel, threads);
  kernels::adam_step(kernels::adam_coefficients(config, ++step), plain, std::nullopt, threads);
  copy_f32_to_bf16(p.as<float>(), copy16.as<uint16_t>(), numel, threads);
  size_t bad_way = copy_matches();
  for (size_t i : sample) {
    bad_way += g32.as<float>()[i] != bf16_to_float(BFloat16{block[i % kBlockNumel]});
  }

  // Alternating passes: every way sees the same neighbours on a shared machine.
  Parts strata_parts, way_parts, ds_parts;
  bool ds_correct = true;
  for (int it = 0; it < iters; ++it) {
    {
      const double land = land16(block.data(), kBlockNumel, g16.as<uint16_t>(), numel, threads);
      const double adam = timed_step(kernels::adam_coefficients(config, ++step), fused, threads);
      strata_parts.add(land, adam, 0.0);
    }
    double way_land = 0;
    {
      way_land = land_bf16_to_f32(block.data(), kBlockNumel, g32.as<float>(), numel, threads);
      const double adam = timed_step(kernels::adam_coefficients(config, ++step), plain, threads);
      const double copy = copy_f32_to_bf16(p.as<float>(), copy16.as<uint16_t>(), numel, threads);
      way_parts.add(way_land, adam, copy);
    }
    if (ds) {
      // DeepSpeed's gradient lands the same way (its fp32 buffer, 4 B/param):
      // the landing is the transfer's, not DeepSpeed's code, so its time is
      // this round's fp32 landing.
      const DeepSpeedPass r = ds->pass();
      ds_parts.add(way_land, r.step_seconds, r.copy_seconds);
      ds_correct &= r.correct;
    }
  }

  // Bytes counted per parameter (PERFORMANCE.md): the landing's writes (2, or 4
  // into fp32); Adam as adam_bytes_per_element; the separate copy read 4 + write 2.
  PathRow s = row_of("strata", isa, numel, 2.0 + adam_bytes_per_element(DType::kBF16, DType::kBF16), strata_parts);
  PathRow w = row_of("deepspeed-way", isa, numel,
                     4.0 + adam_bytes_per_element(DType::kF32, std::nullopt) + 6.0, way_parts);
  s.correct = bad_strata == 0;
  s.check_detail = fmt::format("{} samples, {} mismatches (landed gradient, bf16 copy)", sample.size(), bad_strata);
  w.correct = bad_way == 0;
  w.check_detail = fmt::format("{} samples, {} mismatches (fp32 gradient, bf16 copy)", sample.size(), bad_way);
  out.rows = {s, w};
  if (ds) {
    PathRow d = row_of("deepspeed", "", numel, w.bytes / static_cast<double>(numel), ds_parts);
    d.correct = ds_correct;
    d.check_detail = ds_correct ? "its copy is the bf16 rounding of its master (sampled)"
                                : "its copy is not the bf16 rounding of its master";
    out.rows.push_back(d);
  }
  // Medians of the rounds' ratios (each round ran the ways back to back, so a
  // neighbour's load that drifts over the run cancels), not ratios of medians.
  const Parts* parts[] = {&strata_parts, &way_parts, &ds_parts};
  const auto pair_median = [](const Parts& num, const Parts& den) {
    std::vector<double> ratios;
    for (size_t i = 0; i < num.total.size() && i < den.total.size(); ++i) {
      ratios.push_back(num.total[i] / den.total[i]);
    }
    return median(ratios);
  };
  for (size_t k = 0; k < out.rows.size(); ++k) {
    out.rows[k].ratio_to_deepspeed_way = pair_median(way_parts, *parts[k]);
    if (ds) out.rows[k].ratio_to_deepspeed = pair_median(ds_parts, *parts[k]);
  }
  return out;
}

}  // namespace strata::bench
