// CPU optimizer kernels: ISA dispatch, the scalar reference against a
// hand-written PyTorch-order formula, AVX2 against the scalar reference, and
// the gradient statistics / clipping scale.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "kernels/optimizer.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "tests/kernels/adam_checks.h"

using namespace strata;
using kernels::CpuIsa;

TEST_CASE("isa names parse and dispatch follows cpu_features", "[kernels][adam]") {
  CHECK(kernels::parse_isa("scalar") == CpuIsa::kScalar);
  CHECK(kernels::parse_isa("avx2") == CpuIsa::kAvx2);
  CHECK(kernels::parse_isa("avx512") == CpuIsa::kAvx512);
  CHECK_THROWS_AS(kernels::parse_isa("sse9"), Error);
  CHECK(kernels::isa_supported(CpuIsa::kAvx512) == cpu_features().avx512f);
  CHECK(kernels::isa_supported(CpuIsa::kAvx2) == (cpu_features().avx2 && cpu_features().f16c));
  CHECK(kernels::isa_supported(kernels::default_isa()));
  if (std::getenv("STRATA_ISA") == nullptr) {
    const auto all = kernels::supported_isas();
    // The widest until large updates have been timed (none have in this test).
    CHECK(kernels::default_isa() == all.back());
  }
  if (!kernels::isa_supported(CpuIsa::kAvx512)) {
    // Asking for what the CPU lacks is an error, not a crash.
    float p = 0, m = 0, v = 0, g = 0;
    kernels::AdamBuffers b{&p, &m, &v, &g, DType::kF32, nullptr, DType::kBF16, 1};
    const auto c = kernels::adam_coefficients({}, 1);
    CHECK_THROWS_WITH(kernels::adam_step(c, b, CpuIsa::kAvx512), Catch::Contains("not supported"));
  }
}

TEST_CASE("scalar Adam and AdamW follow PyTorch's formulas over many steps", "[kernels][adam]") {
  // Written out independently in double, the way torch.optim.Adam(W) computes:
  // bias corrections, eps after the square root, decoupled or L2 decay.
  for (const bool adamw : {true, false}) {
    kernels::AdamConfig config;
    config.lr = 3e-3f;
    config.beta1 = 0.8f;
    config.beta2 = 0.95f;
    config.eps = 1e-6f;
    config.weight_decay = 0.1f;
    config.adamw = adamw;
    const size_t numel = 37;
    test::OptimState s = test::make_state(numel, 3);
    std::vector<double> p(s.param.begin(), s.param.end()), m(numel, 0.0), v(numel, 0.0);
    for (int step = 1; step <= 50; ++step) {
      const auto grad = test::make_grad(numel, DType::kF32, 900u + static_cast<uint32_t>(step), 1.0f);
      const float* g = reinterpret_cast<const float*>(grad.data());
      kernels::adam_step(kernels::adam_coefficients(config, step),
                         test::buffers_of(s, grad.data(), DType::kF32, false, DType::kBF16),
                         CpuIsa::kScalar);
      const double b1 = config.beta1, b2 = config.beta2, lr = config.lr, wd = config.weight_decay;
      for (size_t i = 0; i < numel; ++i) {
        double gi = g[i];
        if (adamw) p[i] *= 1.0 - lr * wd; else gi += wd * p[i];
        m[i] = b1 * m[i] + (1 - b1) * gi;
        v[i] = b2 * v[i] + (1 - b2) * gi * gi;
        const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
        p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + config.eps);
      }
    }
    for (size_t i = 0; i < numel; ++i) {
      CAPTURE(adamw, i);
      REQUIRE(std::abs(s.param[i] - p[i]) <= 1e-5 * std::abs(p[i]) + 1e-6);
      REQUIRE(std::abs(s.exp_avg[i] - m[i]) <= 1e-5 * std::abs(m[i]) + 1e-7);
      REQUIRE(std::abs(s.exp_avg_sq[i] - v[i]) <= 1e-5 * std::abs(v[i]) + 1e-9);
    }
  }
}

TEST_CASE("avx2 Adam matches the scalar reference for every dtype mix and tail", "[kernels][adam][avx2]") {
  REQUIRE(kernels::isa_supported(CpuIsa::kAvx2));  // every x86-64 CI machine of ours has AVX2
  test::check_isa_against_scalar(CpuIsa::kAvx2);
}

TEST_CASE("avx2 gradient statistics match the scalar reference and find Inf/NaN", "[kernels][grad]") {
  REQUIRE(kernels::isa_supported(CpuIsa::kAvx2));
  test::check_grad_stats_against_scalar(CpuIsa::kAvx2);
  test::check_grad_stats_against_scalar(CpuIsa::kScalar);
}

TEST_CASE("adam_step results do not depend on the thread count", "[kernels][adam]") {
  const size_t numel = 300001;
  test::OptimState one = test::make_state(numel, 11), many = test::make_state(numel, 11);
  const auto grad = test::make_grad(numel, DType::kBF16, 12, 1.0f);
  const auto c = kernels::adam_coefficients({}, 3, 0.7f);
  kernels::adam_step(c, test::buffers_of(one, grad.data(), DType::kBF16, true, DType::kBF16), std::nullopt, 1);
  kernels::adam_step(c, test::buffers_of(many, grad.data(), DType::kBF16, true, DType::kBF16), std::nullopt, 7);
  // Double parentheses: a failure reports false instead of printing every element.
  REQUIRE((one.param == many.param));
  REQUIRE((one.exp_avg == many.exp_avg));
  REQUIRE((one.exp_avg_sq == many.exp_avg_sq));
  REQUIRE((one.param16 == many.param16));
}

TEST_CASE("the default ISA is timed on the first large updates, then fixed", "[kernels][adam]") {
  const auto before = kernels::default_isa_info();
  const bool both = kernels::isa_supported(CpuIsa::kAvx512) && kernels::isa_supported(CpuIsa::kAvx2);
  if (std::getenv("STRATA_ISA") != nullptr) {
    CHECK(before.basis == "STRATA_ISA");
  } else if (!both) {
    CHECK(before.basis == "widest supported");
  } else {
    CHECK(before.basis == "calibrating");
  }
  const size_t numel = size_t{1} << 20;  // the smallest update that is timed
  test::OptimState s = test::make_state(numel, 21);
  const auto grad = test::make_grad(numel, DType::kBF16, 22, 1.0f);
  for (int step = 1; step <= 6; ++step) {
    kernels::adam_step(kernels::adam_coefficients({}, step),
                       test::buffers_of(s, grad.data(), DType::kBF16, true, DType::kBF16));
  }
  const auto after = kernels::default_isa_info();
  CHECK(after.isa == kernels::default_isa());
  CHECK(kernels::isa_supported(after.isa));
  if (before.basis == "calibrating") {
    CHECK(after.basis == "calibrated");
    CHECK(after.trials == 6);
    CHECK((after.isa == CpuIsa::kAvx512 || after.isa == CpuIsa::kAvx2));
    CHECK(after.avx512_ns_per_param > 0);
    CHECK(after.avx2_ns_per_param > 0);
  } else {
    CHECK(after.basis == before.basis);
    CHECK(after.trials == 0);
  }
  // Once decided, the choice no longer changes.
  kernels::adam_step(kernels::adam_coefficients({}, 7),
                     test::buffers_of(s, grad.data(), DType::kBF16, true, DType::kBF16));
  CHECK(kernels::default_isa_info().trials == after.trials);
  CHECK(kernels::default_isa() == after.isa);
  // Which ISA each trial used cannot show in the result: the same steps with
  // AVX2 alone give the same bits (AVX2 and AVX-512 are bit-identical).
  test::OptimState ref = test::make_state(numel, 21);
  const CpuIsa fixed = before.basis == "calibrating" ? CpuIsa::kAvx2 : kernels::default_isa();
  for (int step = 1; step <= 7; ++step) {
    kernels::adam_step(kernels::adam_coefficients({}, step),
                       test::buffers_of(ref, grad.data(), DType::kBF16, true, DType::kBF16), fixed);
  }
  // Double parentheses: a failure reports false instead of printing every element.
  CHECK((ref.param == s.param));
  CHECK((ref.exp_avg == s.exp_avg));
  CHECK((ref.exp_avg_sq == s.exp_avg_sq));
  CHECK((ref.param16 == s.param16));
}

TEST_CASE("combined gradient scale unscales and clips like clip_grad_norm_", "[kernels][grad]") {
  // Gradient [3, 4] * loss scale 8: norm 5 after unscaling.
  const std::vector<float> g{24.0f, 32.0f};
  const auto stats = kernels::grad_stats(g.data(), DType::kF32, g.size());
  CHECK(stats.norm() == Approx(40.0));
  CHECK(kernels::combined_grad_scale(stats, 8.0f, 0.0f) == Approx(1.0f / 8.0f));
  CHECK(kernels::combined_grad_scale(stats, 8.0f, 10.0f) == Approx(1.0f / 8.0f));  // no clip
  CHECK(kernels::combined_grad_scale(stats, 8.0f, 1.0f) == Approx(1.0 / 8.0 / (5.0 + 1e-6)));
  const auto merged = kernels::merge(stats, kernels::GradStats{0.0, false});
  CHECK_FALSE(merged.finite);
  CHECK(kernels::combined_grad_scale(merged, 8.0f, 1.0f) == 0.0f);
  CHECK_THROWS_AS(kernels::combined_grad_scale(stats, 0.0f, 1.0f), Error);
}

TEST_CASE("scale_inplace unscales each dtype", "[kernels][grad]") {
  std::vector<float> f{2.0f, -4.0f, 6.0f};
  kernels::scale_inplace(f.data(), DType::kF32, f.size(), 0.5f);
  CHECK(f == std::vector<float>{1.0f, -2.0f, 3.0f});
  std::vector<BFloat16> b{float_to_bf16(3.0f), float_to_bf16(-0.5f)};
  kernels::scale_inplace(b.data(), DType::kBF16, b.size(), 0.25f);
  CHECK(bf16_to_float(b[0]) == 0.75f);
  CHECK(bf16_to_float(b[1]) == -0.125f);
  std::vector<Half> h{float_to_half(1024.0f)};
  kernels::scale_inplace(h.data(), DType::kF16, h.size(), 1.0f / 1024.0f);
  CHECK(half_to_float(h[0]) == 1.0f);
}

TEST_CASE("invalid hyper-parameters and buffers are rejected", "[kernels][adam]") {
  kernels::AdamConfig bad;
  bad.beta1 = 1.0f;
  CHECK_THROWS_WITH(kernels::adam_coefficients(bad, 1), Catch::Contains("betas[0]"));
  CHECK_THROWS_WITH(kernels::adam_coefficients({}, 0), Catch::Contains("1-based"));
  kernels::AdamBuffers b;
  b.numel = 4;
  CHECK_THROWS_AS(kernels::adam_step(kernels::adam_coefficients({}, 1), b), Error);
}
