// Shared checks of a SIMD optimizer variant against the scalar reference, used
// by kernels_tests (AVX2) and kernels_avx512_tests (only where AVX-512 runs).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/optimizer.h"
#include "core/dtype.h"
#include "tests/support/tolerances.h"

namespace strata::test {

// Lengths that hit every tail: below one vector, around 8 and 16, around the
// 64-element chunk alignment, and one big enough for the multi-thread split.
inline std::vector<size_t> tail_lengths() {
  return {0, 1, 3, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 63, 64, 65, 127, 129, 1000, 70001};
}

struct OptimState {
  std::vector<float> param, exp_avg, exp_avg_sq;
  std::vector<uint16_t> param16;
};

inline OptimState make_state(size_t numel, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  OptimState s;
  s.param.resize(numel);
  for (float& x : s.param) x = dist(rng);
  s.exp_avg.assign(numel, 0.0f);
  s.exp_avg_sq.assign(numel, 0.0f);
  s.param16.assign(numel, 0);
  return s;
}

// Gradient for step `step` stored as `dtype` (a different draw each step).
inline std::vector<uint8_t> make_grad(size_t numel, DType dtype, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> g(numel);
  for (float& x : g) x = dist(rng);
  // Some exact zeros: v stays 0 there, the eps path of the denominator.
  for (size_t i = 0; i < numel; i += 13) g[i] = 0.0f;
  std::vector<uint8_t> out(numel * dtype_nbytes(dtype) + 1);
  convert(g.data(), DType::kF32, out.data(), dtype, numel);
  return out;
}

inline kernels::AdamBuffers buffers_of(OptimState& s, const void* grad, DType grad_dtype,
                                       bool with_copy, DType param16_dtype) {
  kernels::AdamBuffers b;
  b.param = s.param.data();
  b.exp_avg = s.exp_avg.data();
  b.exp_avg_sq = s.exp_avg_sq.data();
  b.grad = grad;
  b.grad_dtype = grad_dtype;
  b.param16 = with_copy ? s.param16.data() : nullptr;
  b.param16_dtype = param16_dtype;
  b.numel = s.param.size();
  return b;
}

inline uint16_t round16(float x, DType dtype) {
  return dtype == DType::kBF16 ? float_to_bf16(x).bits : float_to_half(x).bits;
}

// Runs kAdamSteps steps with `isa` and with the scalar reference on the same
// inputs; compares p, m, v within the table's tolerances and checks that the
// 16-bit copy is exactly the rounding of the variant's own fp32 result.
inline void check_isa_against_scalar(kernels::CpuIsa isa) {
  for (const bool adamw : {true, false}) {
    for (const DType grad_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const int copy : {0, 1, 2}) {  // none, bf16, fp16
        const DType copy_dtype = copy == 2 ? DType::kF16 : DType::kBF16;
        for (const size_t numel : tail_lengths()) {
          CAPTURE(kernels::isa_name(isa), adamw, dtype_name(grad_dtype), copy, numel);
          kernels::AdamConfig config;
          config.lr = 1e-2f;
          config.weight_decay = 0.05f;
          config.adamw = adamw;
          OptimState ref = make_state(numel, 7), simd = make_state(numel, 7);
          for (int step = 1; step <= kAdamSteps; ++step) {
            const auto grad = make_grad(numel, grad_dtype, 100u + static_cast<uint32_t>(step), 4.0f);
            const auto c = kernels::adam_coefficients(config, step, 0.5f);
            kernels::adam_step(c, buffers_of(ref, grad.data(), grad_dtype, copy != 0, copy_dtype),
                               kernels::CpuIsa::kScalar);
            kernels::adam_step(c, buffers_of(simd, grad.data(), grad_dtype, copy != 0, copy_dtype),
                               isa);
          }
          size_t bad = 0;
          double worst_p = 0, worst_m = 0, worst_v = 0;  // worst |diff| / allowed
          for (size_t i = 0; i < numel; ++i) {
            worst_p = std::max(worst_p, excess(simd.param[i], ref.param[i], kAdamParamTol));
            worst_m = std::max(worst_m, excess(simd.exp_avg[i], ref.exp_avg[i], kAdamExpAvgTol));
            worst_v = std::max(worst_v, excess(simd.exp_avg_sq[i], ref.exp_avg_sq[i], kAdamExpAvgSqTol));
            if (copy != 0) bad += simd.param16[i] != round16(simd.param[i], copy_dtype);
            if (copy != 0) bad += ref.param16[i] != round16(ref.param[i], copy_dtype);
            if (copy == 0) bad += simd.param16[i] != 0;  // nothing written without a copy
          }
          CAPTURE(worst_p, worst_m, worst_v);
          REQUIRE(worst_p <= 1.0);
          REQUIRE(worst_m <= 1.0);
          REQUIRE(worst_v <= 1.0);
          REQUIRE(bad == 0);
        }
      }
    }
  }
}

// Runs kAdamSteps steps with isa `a` and isa `b` on the same inputs and
// requires every output bit to match: the dispatcher chooses between AVX2 and
// AVX-512 by speed, so nothing else may differ. Buffers start `offset`
// elements into their allocation (unaligned vector accesses).
inline void check_isas_bit_identical(kernels::CpuIsa a, kernels::CpuIsa b, size_t offset) {
  for (const bool adamw : {true, false}) {
    for (const DType grad_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const int copy : {0, 1, 2}) {  // none, bf16, fp16
        const DType copy_dtype = copy == 2 ? DType::kF16 : DType::kBF16;
        for (const size_t numel : tail_lengths()) {
          CAPTURE(kernels::isa_name(a), kernels::isa_name(b), offset, adamw, dtype_name(grad_dtype), copy, numel);
          kernels::AdamConfig config;
          config.lr = 1e-2f;
          config.weight_decay = 0.05f;
          config.adamw = adamw;
          OptimState sa = make_state(numel + offset, 9), sb = make_state(numel + offset, 9);
          for (int step = 1; step <= kAdamSteps; ++step) {
            const auto grad = make_grad(numel + offset, grad_dtype, 300u + static_cast<uint32_t>(step), 4.0f);
            const auto c = kernels::adam_coefficients(config, step, 0.5f);
            for (auto [state, isa] : {std::pair{&sa, a}, std::pair{&sb, b}}) {
              auto buffers = buffers_of(*state, grad.data(), grad_dtype, copy != 0, copy_dtype);
              buffers.param += offset;
              buffers.exp_avg += offset;
              buffers.exp_avg_sq += offset;
              buffers.grad = grad.data() + offset * dtype_nbytes(grad_dtype);
              if (buffers.param16 != nullptr) buffers.param16 = state->param16.data() + offset;
              buffers.numel = numel;
              kernels::adam_step(c, buffers, isa);
            }
          }
          // Double parentheses: a failure reports false, not every element.
          REQUIRE((sa.param == sb.param));
          REQUIRE((sa.exp_avg == sb.exp_avg));
          REQUIRE((sa.exp_avg_sq == sb.exp_avg_sq));
          REQUIRE((sa.param16 == sb.param16));
        }
      }
    }
  }
}

inline void check_grad_stats_against_scalar(kernels::CpuIsa isa) {
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const size_t numel : tail_lengths()) {
      CAPTURE(kernels::isa_name(isa), dtype_name(dtype), numel);
      const auto grad = make_grad(numel, dtype, 5, 3.0f);
      const auto ref = kernels::grad_stats(grad.data(), dtype, numel, 0.25f, kernels::CpuIsa::kScalar);
      const auto got = kernels::grad_stats(grad.data(), dtype, numel, 0.25f, isa);
      REQUIRE(got.finite);
      REQUIRE(within(got.sum_sq, ref.sum_sq, kGradSumSqTol));
      if (numel == 0) continue;
      // One Inf or NaN anywhere (including the last, tail element) is found.
      for (const size_t at : {size_t{0}, numel / 2, numel - 1}) {
        for (const float bad : {INFINITY, -INFINITY, NAN}) {
          auto poisoned = grad;
          const auto bits_f32 = bad;
          if (dtype == DType::kF32) {
            std::memcpy(poisoned.data() + at * 4, &bits_f32, 4);
          } else {
            const uint16_t b = round16(bad, dtype);
            std::memcpy(poisoned.data() + at * 2, &b, 2);
          }
          REQUIRE_FALSE(kernels::grad_stats(poisoned.data(), dtype, numel, 1.0f, isa).finite);
        }
      }
    }
  }
}

}  // namespace strata::test
