// AVX2 + FMA + F16C variant of the CPU optimizer kernels (compiled with
// -mavx2 -mfma -mf16c; called only after cpu_features() reports AVX2).
// 8 elements per iteration. The last < 8 elements go through the same vector
// update on a zero-padded copy (not the scalar formula, which rounds without
// FMA), so every element is bit-identical to the AVX-512 kernel's: the
// dispatcher may pick either by speed alone (adam.cc).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/cpu/adam_impl.h"

namespace strata::kernels::detail {
namespace {

template <DType G>
inline __m256 load8(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else if constexpr (G == DType::kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_cvtph_ps(h);
  }
}

// Round-to-nearest-even to bf16, NaN kept quiet, as float_to_bf16 does.
inline __m128i to_bf16x8(__m256 value) {
  const __m256i x = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, is_nan);
  // Every lane is < 2^16, so unsigned-saturating pack is exact; fix the lane order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  return _mm256_castsi256_si128(packed);
}

template <DType P>
inline __m128i to16(__m256 value) {
  if constexpr (P == DType::kBF16) {
    return to_bf16x8(value);
  } else {
    return _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

struct Vec {
  __m256 grad_scale, l2, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, inv_bias2_sqrt,
      eps, neg_step_size;
  explicit Vec(const AdamCoefficients& c)
      : grad_scale(_mm256_set1_ps(c.grad_scale)), l2(_mm256_set1_ps(c.l2)),
        decay(_mm256_set1_ps(c.decay)), beta1(_mm256_set1_ps(c.beta1)),
        beta2(_mm256_set1_ps(c.beta2)), one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        inv_bias2_sqrt(_mm256_set1_ps(c.inv_bias2_sqrt)), eps(_mm256_set1_ps(c.eps)),
        neg_step_size(_mm256_set1_ps(-c.step_size)) {}
};

// Operation for operation the same as update16 in adam_avx512.cc.
inline void update8(const Vec& k, __m256& p, __m256& m, __m256& v, __m256 g) {
  g = _mm256_fmadd_ps(g, k.grad_scale, _mm256_mul_ps(k.l2, p));
  p = _mm256_mul_ps(p, k.decay);
  m = _mm256_fmadd_ps(k.beta1, m, _mm256_mul_ps(k.one_minus_beta1, g));
  v = _mm256_fmadd_ps(k.beta2, v, _mm256_mul_ps(k.one_minus_beta2, _mm256_mul_ps(g, g)));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.inv_bias2_sqrt, k.eps);
  p = _mm256_fmadd_ps(k.neg_step_size, _mm256_div_ps(m, denom), p);
}

// The last n < 8 elements at i: copied into zero-padded vectors, updated like
// the others, copied back.
template <DType G, DType P>
void adam_tail8(const Vec& k, const AdamBuffers& b, size_t i, size_t n) {
  constexpr size_t kGradBytes = G == DType::kF32 ? 4 : 2;
  alignas(32) float p8[8] = {}, m8[8] = {}, v8[8] = {};
  alignas(32) unsigned char g8[8 * kGradBytes] = {};
  alignas(16) uint16_t c8[8];
  std::memcpy(p8, b.param + i, n * 4);
  std::memcpy(m8, b.exp_avg + i, n * 4);
  std::memcpy(v8, b.exp_avg_sq + i, n * 4);
  std::memcpy(g8, static_cast<const unsigned char*>(b.grad) + i * kGradBytes, n * kGradBytes);
  __m256 p = _mm256_load_ps(p8), m = _mm256_load_ps(m8), v = _mm256_load_ps(v8);
  update8(k, p, m, v, load8<G>(g8, 0));
  _mm256_store_ps(p8, p);
  _mm256_store_ps(m8, m);
  _mm256_store_ps(v8, v);
  std::memcpy(b.param + i, p8, n * 4);
  std::memcpy(b.exp_avg + i, m8, n * 4);
  std::memcpy(b.exp_avg_sq + i, v8, n * 4);
  if constexpr (P != DType::kF32) {
    _mm_store_si128(reinterpret_cast<__m128i*>(c8), to16<P>(p));
    std::memcpy(static_cast<uint16_t*>(b.param16) + i, c8, n * 2);
  }
}

// G: gradient dtype; P: param16 dtype (kF32 means no 16-bit copy); Stream:
// store the copy non-temporally (see stream_param16 in adam_impl.h).
template <DType G, DType P, bool Stream>
void adam_avx2(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  const Vec k(c);
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 p = _mm256_loadu_ps(b.param + i);
    __m256 m = _mm256_loadu_ps(b.exp_avg + i);
    __m256 v = _mm256_loadu_ps(b.exp_avg_sq + i);
    update8(k, p, m, v, load8<G>(b.grad, i));
    _mm256_storeu_ps(b.param + i, p);
    _mm256_storeu_ps(b.exp_avg + i, m);
    _mm256_storeu_ps(b.exp_avg_sq + i, v);
    if constexpr (P != DType::kF32) {
      auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.param16) + i);
      if constexpr (Stream) {
        _mm_stream_si128(out, to16<P>(p));
      } else {
        _mm_storeu_si128(out, to16<P>(p));
      }
    }
  }
  if (i < end) adam_tail8<G, P>(k, b, i, end - i);
  // Non-temporal stores are weakly ordered: fence before the caller (or the
  // other threads after the OpenMP barrier) may read the copy.
  if constexpr (Stream) _mm_sfence();
}

template <DType G, DType P>
void adam_avx2_for_copy(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  if (stream_param16(b, 16)) {
    adam_avx2<G, P, true>(c, b, begin, end);
  } else {
    adam_avx2<G, P, false>(c, b, begin, end);
  }
}

template <DType G>
void adam_avx2_for_grad(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  if (b.param16 == nullptr) {
    adam_avx2<G, DType::kF32, false>(c, b, begin, end);
  } else if (b.param16_dtype == DType::kBF16) {
    adam_avx2_for_copy<G, DType::kBF16>(c, b, begin, end);
  } else {
    adam_avx2_for_copy<G, DType::kF16>(c, b, begin, end);
  }
}

template <DType G>
double sum_sq_avx2(const void* grad, size_t begin, size_t end, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 x = _mm256_mul_ps(load8<G>(grad, i), s);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + sum_sq_range_scalar(grad, G, i, end, scale);
}

}  // namespace

void adam_range_avx2(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  switch (b.grad_dtype) {
    case DType::kF32: return adam_avx2_for_grad<DType::kF32>(c, b, begin, end);
    case DType::kBF16: return adam_avx2_for_grad<DType::kBF16>(c, b, begin, end);
    case DType::kF16: return adam_avx2_for_grad<DType::kF16>(c, b, begin, end);
    default: break;
  }
}

double sum_sq_range_avx2(const void* grad, DType dtype, size_t begin, size_t end, float scale) {
  switch (dtype) {
    case DType::kF32: return sum_sq_avx2<DType::kF32>(grad, begin, end, scale);
    case DType::kBF16: return sum_sq_avx2<DType::kBF16>(grad, begin, end, scale);
    case DType::kF16: return sum_sq_avx2<DType::kF16>(grad, begin, end, scale);
    default: break;
  }
  return 0.0;
}

}  // namespace strata::kernels::detail
