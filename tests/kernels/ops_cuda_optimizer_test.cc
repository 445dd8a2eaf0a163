// The cuda optimizer ops (offload_optimizer none on a GPU): adam_step bit for
// bit against the host's AVX2 Adam kernel (every copy dtype, aligned and not,
// several steps), param as its own fp32 copy, grad_sum_sq against a long
// double sum (deterministic, aligned = misaligned, non-finite propagated,
// out overwritten), and argument errors before anything is enqueued.
// SKIPPED without a GPU.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "tests/kernels/cuda_ops_fixture.h"
#include "tests/kernels/optimizer_op_checks.h"
#include "tests/support/tolerances.h"

using namespace strata;
using namespace strata::ops;
using namespace strata::test;

namespace {

// Elements [offset, offset + n) of t as a 1-D view.
TensorView slice(TensorView t, int64_t offset, int64_t n) {
  t.data = static_cast<char*>(t.data) + offset * static_cast<int64_t>(dtype_nbytes(t.desc.dtype));
  t.desc.shape = {n};
  return t;
}

// A device fp32 view holding v's bits, `offset` elements into its allocation
// (offset 1: not 16-byte aligned, so the kernels take one element at a time).
// One spare element follows, so that even an empty view has memory behind it.
TensorView device_floats(Fixture& f, const std::vector<float>& v, int64_t offset = 0) {
  std::vector<float> padded(static_cast<size_t>(offset) + v.size() + 1, 0.0f);
  std::copy(v.begin(), v.end(), padded.begin() + offset);
  const TensorView whole =
      f.upload(padded.data(), DType::kF32, {static_cast<int64_t>(padded.size())});
  return slice(whole, offset, static_cast<int64_t>(v.size()));
}

// The index of the first element whose bytes differ (elements of `elem`
// bytes), or -1: a failure names one element instead of printing megabytes.
int64_t first_mismatch(const std::vector<unsigned char>& got, const void* want, size_t elem) {
  const auto* w = static_cast<const unsigned char*>(want);
  for (size_t i = 0; i < got.size(); i += elem) {
    if (std::memcmp(got.data() + i, w + i, elem) != 0) return static_cast<int64_t>(i / elem);
  }
  return -1;
}

std::vector<float> as_floats(const std::vector<unsigned char>& bytes) {
  std::vector<float> out(bytes.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// An fp64 [1] output holding a stale value that an op must overwrite.
TensorView stale_out(Fixture& f) {
  Vec stale{12345.0};
  return f.tensor(stale, DType::kF64, {1});
}

}  // namespace

TEST_CASE("cuda ops: adam_step gives the bits of the host AVX2 kernel with every copy dtype",
          "[ops][cuda][adam]") {
  // The ops contract names kernels::adam_step's AVX2 kernel (AVX-512 gives the
  // same bits) as the result, compared bit for bit. A host without AVX2 has
  // only the scalar kernel, which rounds without FMA: there the device is held
  // to the SIMD-vs-scalar bounds of tests/support/tolerances.h (section 1) (~1e-6
  // relative: a few ulp), and its copy to the rounding of its own fp32 result.
  const bool bitwise = kernels::isa_supported(kernels::CpuIsa::kAvx2);
  const std::optional<kernels::CpuIsa> isa =
      bitwise ? std::optional{kernels::CpuIsa::kAvx2} : std::nullopt;
  if (!bitwise) WARN("no AVX2 on this host: adam_step is compared within tolerances, not bitwise");
  // 1 and 7: less than one AVX2 vector (the host pads a tail); 1000 and
  // 2^20 + 3: the device's float4 path and a tail; offset 1: no array is
  // 16-byte aligned, so the device takes every element alone.
  for (const auto& [n, offset] : {std::pair<int64_t, int64_t>{1, 0},
                                  {7, 0},
                                  {1000, 0},
                                  {(int64_t{1} << 20) + 3, 0},
                                  {1000, 1}}) {
    Fixture f;  // per size: the big one's tensors are freed before the next
    for (const bool adamw : {true, false}) {
      for (const std::optional<DType> copy :
           {std::optional<DType>{}, std::optional{DType::kF32}, std::optional{DType::kF16},
            std::optional{DType::kBF16}}) {
        INFO("n " << n << " offset " << offset << (adamw ? " adamw" : " adam (L2)") << " copy "
                  << (copy ? dtype_name(*copy) : "none"));
        const auto count = static_cast<size_t>(n);
        kernels::AdamConfig config;
        config.lr = 1e-2f;
        config.weight_decay = 0.05f;
        config.adamw = adamw;
        // State as after some training: moments not zero, so every term counts.
        std::vector<float> p = normal_floats(count, 1, 1.0f), m = normal_floats(count, 2, 0.1f),
                           v = normal_floats(count, 3, 0.01f);
        for (float& x : v) x *= x;
        const std::vector<float> p0 = p;
        auto d_p = device_floats(f, p, offset), d_m = device_floats(f, m, offset),
             d_v = device_floats(f, v, offset);
        TensorView d_copy;
        if (copy) d_copy = slice(f.zeros(*copy, {offset + n + 1}), offset, n);
        std::vector<uint16_t> ref16(count, 0);
        for (int step = 1; step <= 3; ++step) {
          INFO("step " << step);
          const std::vector<float> g =
              normal_floats(count, 10u + static_cast<uint32_t>(step), 2.0f, true);
          // grad_scale not a power of two, so the scaling FMA rounds.
          const auto coeffs = kernels::adam_coefficients(config, step, 0.37f);
          f.ops->adam_step(*f.ctx, coeffs, d_p, d_m, d_v, device_floats(f, g, offset), d_copy);
          kernels::AdamBuffers b;
          b.param = p.data();
          b.exp_avg = m.data();
          b.exp_avg_sq = v.data();
          b.grad = g.data();
          b.numel = count;
          if (copy && *copy != DType::kF32) {
            b.param16 = ref16.data();
            b.param16_dtype = *copy;
          }
          kernels::adam_step(coeffs, b, isa);
          const auto got_p = f.bytes(d_p), got_m = f.bytes(d_m), got_v = f.bytes(d_v);
          const auto got_copy = copy ? f.bytes(d_copy) : std::vector<unsigned char>{};
          if (bitwise) {
            CHECK(first_mismatch(got_p, p.data(), 4) == -1);
            CHECK(first_mismatch(got_m, m.data(), 4) == -1);
            CHECK(first_mismatch(got_v, v.data(), 4) == -1);
            if (copy == DType::kF32) CHECK(first_mismatch(got_copy, p.data(), 4) == -1);
            if (copy && *copy != DType::kF32) {
              CHECK(first_mismatch(got_copy, ref16.data(), 2) == -1);
            }
          } else {
            const std::vector<float> dp = as_floats(got_p), dm = as_floats(got_m),
                                     dv = as_floats(got_v);
            size_t bad = 0;
            for (size_t i = 0; i < count; ++i) {
              bad += !test::within(dp[i], p[i], test::kAdamParamTol);
              bad += !test::within(dm[i], m[i], test::kAdamExpAvgTol);
              bad += !test::within(dv[i], v[i], test::kAdamExpAvgSqTol);
              if (copy == DType::kF32) bad += std::memcmp(&got_copy[4 * i], &dp[i], 4) != 0;
              if (copy && *copy != DType::kF32) {
                const uint16_t want =
                    *copy == DType::kBF16 ? float_to_bf16(dp[i]).bits : float_to_half(dp[i]).bits;
                bad += std::memcmp(&got_copy[2 * i], &want, 2) != 0;
              }
            }
            CHECK(bad == 0);
          }
        }
        CHECK(p != p0);  // the update moved the parameter: the comparison is not of no-ops
      }
    }
  }
}

TEST_CASE("cuda ops: adam_step with param as its own fp32 copy updates it once",
          "[ops][cuda][adam]") {
  Fixture f;
  const std::vector<float> p = normal_floats(1000, 1, 1.0f), m = normal_floats(1000, 2, 0.1f),
                           g = normal_floats(1000, 3, 2.0f);
  std::vector<float> v = normal_floats(1000, 4, 0.01f);
  for (float& x : v) x *= x;
  auto p1 = device_floats(f, p), m1 = device_floats(f, m), v1 = device_floats(f, v);
  auto p2 = device_floats(f, p), m2 = device_floats(f, m), v2 = device_floats(f, v);
  auto d_g = device_floats(f, g);
  const auto coeffs = kernels::adam_coefficients({}, 1, 0.37f);
  f.ops->adam_step(*f.ctx, coeffs, p1, m1, v1, d_g, {});
  f.ops->adam_step(*f.ctx, coeffs, p2, m2, v2, d_g, p2);
  CHECK(f.bytes(p1) == f.bytes(p2));
  CHECK(f.bytes(m1) == f.bytes(m2));
  CHECK(f.bytes(p1) != f.bytes(device_floats(f, p)));  // it did move
}

TEST_CASE("cuda ops: grad_sum_sq sums fp32 products in double, deterministically, into out",
          "[ops][cuda][grad]") {
  Fixture f;
  const float scale = 0.37f;
  for (const int64_t n :
       {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, (int64_t{1} << 20) + 3}) {
    INFO("n " << n);
    const std::vector<float> g = normal_floats(static_cast<size_t>(n), 20, 3.0f, true);
    // The contract's sum: x = the fp32 product, squared and added in (here
    // long) double, so the reference's own rounding is far below 1e-12.
    long double exact = 0;
    for (const float x : g) {
      const auto xs = static_cast<double>(x * scale);
      exact += static_cast<long double>(xs * xs);
    }
    auto aligned = device_floats(f, g), misaligned = device_floats(f, g, 1);
    auto out = stale_out(f), again = stale_out(f), shifted = stale_out(f);
    f.ops->grad_sum_sq(*f.ctx, aligned, scale, out);
    f.ops->grad_sum_sq(*f.ctx, aligned, scale, again);
    f.ops->grad_sum_sq(*f.ctx, misaligned, scale, shifted);
    const double got = f.read(out)[0], want = static_cast<double>(exact);
    INFO("got " << got << " want " << want);
    CHECK(std::abs(got - want) <= 1e-12 * want);  // also: 12345 was overwritten, not added to
    if (n == 0) CHECK(got == 0.0);
    CHECK(f.bytes(out) == f.bytes(again));
    // The order is fixed by n, not by the address (float4 loads or not).
    CHECK(f.bytes(out) == f.bytes(shifted));
  }

  // Not finite when an element is not: Inf, NaN, and an fp32 product that
  // overflows (finite in double, so the product must be taken in fp32).
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [what, bad, s] :
       {std::tuple{"inf", inf, 1.0f}, {"nan", nan, 1.0f}, {"fp32 overflow", 1e30f, 1e10f}}) {
    INFO(what);
    std::vector<float> g = normal_floats(100000, 21, 1.0f);
    g[61717] = bad;
    auto out = stale_out(f);
    f.ops->grad_sum_sq(*f.ctx, device_floats(f, g), s, out);
    const double got = f.read(out)[0];
    CHECK_FALSE(std::isfinite(got));
    if (std::isnan(bad)) CHECK(std::isnan(got));
  }
}

TEST_CASE("cuda ops: adam_step and grad_sum_sq refuse bad arguments before enqueueing",
          "[ops][cuda][adam]") {
  Fixture f;
  const std::vector<float> ones(8, 1.0f);
  auto p = device_floats(f, ones), m = device_floats(f, ones), v = device_floats(f, ones),
       g = device_floats(f, ones);
  auto short_m = device_floats(f, std::vector<float>(7, 1.0f));
  auto g16 = f.zeros(DType::kBF16, {8});
  auto ints = f.ints(std::vector<int32_t>(8, 0));
  auto copy_short = f.zeros(DType::kBF16, {7});
  Tensor host = Tensor::host(DType::kF32, {8});  // not addressable by the kernels
  const auto coeffs = kernels::adam_coefficients({}, 1);
  const auto refused = [](auto&& call, const char* message) { expect_bad_argument(call, message); };
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, short_m, v, g, {}); }, "exp_avg");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, g16, {}); }, "grad");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, g, ints); }, "param_copy");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, g, copy_short); }, "param_copy");
  refused([&] { f.ops->adam_step(*f.ctx, coeffs, p, m, v, host.view(), {}); }, "device tensors");
  auto out = f.zeros(DType::kF64, {1}), out2 = f.zeros(DType::kF64, {2});
  auto out32 = f.zeros(DType::kF32, {1});
  refused([&] { f.ops->grad_sum_sq(*f.ctx, g16, 1.0f, out); }, "grad");
  refused([&] { f.ops->grad_sum_sq(*f.ctx, g, 1.0f, out32); }, "out");
  refused([&] { f.ops->grad_sum_sq(*f.ctx, g, 1.0f, out2); }, "out");
  refused([&] { f.ops->grad_sum_sq(*f.ctx, host.view(), 1.0f, out); }, "device tensors");
  f.stream->synchronize();  // nothing was enqueued that could fail
  // Nothing ran: the state is as it was.
  CHECK(f.read(p) == Vec(8, 1.0));
  CHECK(f.read(m) == Vec(8, 1.0));
  CHECK(f.read(v) == Vec(8, 1.0));
}
