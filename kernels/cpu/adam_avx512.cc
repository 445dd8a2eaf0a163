// AVX-512 (F/BW/VL/DQ) variant of the CPU optimizer kernels, called only after
// cpu_features() reports AVX-512. 16 elements per iteration.
//
// The main loop uses plain (unmasked) 512-bit loads and stores, exactly the
// memory operations of the AVX2 kernel at twice the width; only the last < 16
// elements of a range go through masked loads and stores. The first version
// masked every access (mask all-ones in the loop): on Intel that costs nothing
// measurable, but it was the one way this kernel's memory operations differed
// from those of the AVX2 kernel, which an AMD Zen 5 ran 33% faster (untested
// here; the dispatcher also picks between the two by timing). The update is the
// same operation sequence as adam_avx2.cc, so both produce bit-identical results
// (the dispatcher's timed choice relies on it; tests/kernels/avx512_test.cc
// checks).
//
// GCC 12's AVX-512 headers self-initialise "undefined" vectors (__Y = __Y),
// which -Wmaybe-uninitialized reports at every use (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/adam_impl.h"

namespace strata::kernels::detail {
namespace {

template <DType G>
inline __m512 load16(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <DType G>
inline __m512 load16_masked(const void* grad, size_t i, __mmask16 mask) {
  if constexpr (G == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round-to-nearest-even to bf16, NaN kept quiet, as float_to_bf16 does.
inline __m256i to_bf16x16(__m512 value) {
  const __m512i x = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __m512i magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, is_nan, quiet));
}

template <DType P>
inline __m256i to16(__m512 value) {
  if constexpr (P == DType::kBF16) {
    return to_bf16x16(value);
  } else {
    return _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

struct Vec {
  __m512 grad_scale, l2, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, inv_bias2_sqrt,
      eps, neg_step_size;
  explicit Vec(const AdamCoefficients& c)
      : grad_scale(_mm512_set1_ps(c.grad_scale)), l2(_mm512_set1_ps(c.l2)),
        decay(_mm512_set1_ps(c.decay)), beta1(_mm512_set1_ps(c.beta1)),
        beta2(_mm512_set1_ps(c.beta2)), one_minus_beta1(_mm512_set1_ps(c.one_minus_beta1)),
        one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
        inv_bias2_sqrt(_mm512_set1_ps(c.inv_bias2_sqrt)), eps(_mm512_set1_ps(c.eps)),
        neg_step_size(_mm512_set1_ps(-c.step_size)) {}
};

// Operation for operation the same as update8 in adam_avx2.cc.
inline void update16(const Vec& k, __m512& p, __m512& m, __m512& v, __m512 g) {
  g = _mm512_fmadd_ps(g, k.grad_scale, _mm512_mul_ps(k.l2, p));
  p = _mm512_mul_ps(p, k.decay);
  m = _mm512_fmadd_ps(k.beta1, m, _mm512_mul_ps(k.one_minus_beta1, g));
  v = _mm512_fmadd_ps(k.beta2, v, _mm512_mul_ps(k.one_minus_beta2, _mm512_mul_ps(g, g)));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), k.inv_bias2_sqrt, k.eps);
  p = _mm512_fmadd_ps(k.neg_step_size, _mm512_div_ps(m, denom), p);
}

// G: gradient dtype; P: param16 dtype (kF32 means no 16-bit copy); Stream:
// store the copy non-temporally (see stream_param16 in adam_impl.h).
template <DType G, DType P, bool Stream>
void adam_avx512(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  const Vec k(c);
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 p = _mm512_loadu_ps(b.param + i);
    __m512 m = _mm512_loadu_ps(b.exp_avg + i);
    __m512 v = _mm512_loadu_ps(b.exp_avg_sq + i);
    update16(k, p, m, v, load16<G>(b.grad, i));
    _mm512_storeu_ps(b.param + i, p);
    _mm512_storeu_ps(b.exp_avg + i, m);
    _mm512_storeu_ps(b.exp_avg_sq + i, v);
    if constexpr (P != DType::kF32) {
      auto* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.param16) + i);
      if constexpr (Stream) {
        _mm256_stream_si256(out, to16<P>(p));
      } else {
        _mm256_storeu_si256(out, to16<P>(p));
      }
    }
  }
  if (i < end) {  // < 16 left: the same update through masked loads and stores
    const __mmask16 mask = static_cast<__mmask16>((1u << (end - i)) - 1u);
    __m512 p = _mm512_maskz_loadu_ps(mask, b.param + i);
    __m512 m = _mm512_maskz_loadu_ps(mask, b.exp_avg + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, b.exp_avg_sq + i);
    update16(k, p, m, v, load16_masked<G>(b.grad, i, mask));
    _mm512_mask_storeu_ps(b.param + i, mask, p);
    _mm512_mask_storeu_ps(b.exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(b.exp_avg_sq + i, mask, v);
    if constexpr (P != DType::kF32) {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(b.param16) + i, mask, to16<P>(p));
    }
  }
  // Non-temporal stores are weakly ordered: fence before the caller (or the
  // other threads after the OpenMP barrier) may read the copy.
  if constexpr (Stream) _mm_sfence();
}

template <DType G, DType P>
void adam_avx512_for_copy(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  if (stream_param16(b, 32)) {
    adam_avx512<G, P, true>(c, b, begin, end);
  } else {
    adam_avx512<G, P, false>(c, b, begin, end);
  }
}

template <DType G>
void adam_avx512_for_grad(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  if (b.param16 == nullptr) {
    adam_avx512<G, DType::kF32, false>(c, b, begin, end);
  } else if (b.param16_dtype == DType::kBF16) {
    adam_avx512_for_copy<G, DType::kBF16>(c, b, begin, end);
  } else {
    adam_avx512_for_copy<G, DType::kF16>(c, b, begin, end);
  }
}

template <DType G>
double sum_sq_avx512(const void* grad, size_t begin, size_t end, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (size_t i = begin; i < end; i += 16) {
    const size_t left = end - i;
    const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
    const __m512 x = _mm512_mul_ps(load16_masked<G>(grad, i, mask), s);  // masked lanes are 0
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}

}  // namespace

void adam_range_avx512(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end) {
  switch (b.grad_dtype) {
    case DType::kF32: return adam_avx512_for_grad<DType::kF32>(c, b, begin, end);
    case DType::kBF16: return adam_avx512_for_grad<DType::kBF16>(c, b, begin, end);
    case DType::kF16: return adam_avx512_for_grad<DType::kF16>(c, b, begin, end);
    default: break;
  }
}

double sum_sq_range_avx512(const void* grad, DType dtype, size_t begin, size_t end, float scale) {
  switch (dtype) {
    case DType::kF32: return sum_sq_avx512<DType::kF32>(grad, begin, end, scale);
    case DType::kBF16: return sum_sq_avx512<DType::kBF16>(grad, begin, end, scale);
    case DType::kF16: return sum_sq_avx512<DType::kF16>(grad, begin, end, scale);
    default: break;
  }
  return 0.0;
}

}  // namespace strata::kernels::detail
