// The memory passes of strata-adam. Each has an AVX2 body (so that it runs at
// memory speed, like the kernels and torch's copies it stands beside) and a
// plain loop for CPUs without AVX2. Stores are normal except the landings'
// (a DMA's stand-in) and the triad's copy (the kernel's non-temporal rule).
#include "bench/strata-adam/stream_passes.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <utility>

#include "bench/common/pattern.h"
#include "kernels/cpu/adam_impl.h"
#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/error.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

// adam_step's split (kernels/cpu/adam.cc): chunks of whole 64-element blocks,
// the remainder spread over the first threads; one thread below 2^16 elements.
std::pair<size_t, size_t> chunk_range(size_t numel, int index, int count) {
  constexpr size_t kBlock = 64;
  const size_t blocks = (numel + kBlock - 1) / kBlock;
  const size_t per = blocks / static_cast<size_t>(count), extra = blocks % static_cast<size_t>(count);
  const size_t i = static_cast<size_t>(index);
  const size_t first = i * per + std::min(i, extra);
  const size_t last = first + per + (i < extra ? 1 : 0);
  return {std::min(numel, first * kBlock), std::min(numel, last * kBlock)};
}

int thread_count(size_t numel, int threads) {
  constexpr size_t kMinParallel = size_t{1} << 16;
  if (numel < kMinParallel) return 1;
  const size_t most = numel / (kMinParallel / 4);
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(threads), most)));
}

// Runs body(begin, end) on every chunk in parallel; returns the seconds taken.
template <typename Body>
double timed_split(size_t numel, int threads, Body body) {
  const int count = thread_count(numel, threads);
  const auto start = Clock::now();
#pragma omp parallel num_threads(count)
  {
    const auto [begin, end] = chunk_range(numel, omp_get_thread_num(), omp_get_num_threads());
    body(begin, end);
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool have_avx2() { return cpu_features().avx2; }

// A zero the compiler cannot fold: the triad must really read every stream.
std::atomic<uint32_t> g_zero{0};

template <size_t GradBytes, bool Copy, bool Stream>
__attribute__((target("avx2"))) void triad_avx2(const kernels::AdamBuffers& b, size_t begin,
                                                 size_t end, uint32_t zero) {
  auto* p = reinterpret_cast<uint32_t*>(b.param);
  auto* m = reinterpret_cast<uint32_t*>(b.exp_avg);
  auto* v = reinterpret_cast<uint32_t*>(b.exp_avg_sq);
  auto* c = static_cast<uint16_t*>(b.param16);
  const __m256i z = _mm256_set1_epi32(static_cast<int>(zero));
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256i g;
    if constexpr (GradBytes == 4) {
      g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint32_t*>(b.grad) + i));
    } else {
      g = _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(b.grad) + i)));
    }
    const __m256i gz = _mm256_and_si256(g, z);
    const __m256i pv = _mm256_or_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), gz);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), pv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + i),
                        _mm256_or_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + i)), gz));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i),
                        _mm256_or_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), gz));
    if constexpr (Copy) {
      const __m256i hi = _mm256_srli_epi32(pv, 16);  // < 2^16: the unsigned pack is exact
      const __m128i packed =
          _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08));
      if constexpr (Stream) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(c + i), packed);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), packed);
      }
    }
  }
  for (; i < end; ++i) {
    const uint32_t g = GradBytes == 4 ? static_cast<const uint32_t*>(b.grad)[i]
                                      : static_cast<const uint16_t*>(b.grad)[i];
    p[i] |= g & zero;
    m[i] |= g & zero;
    v[i] |= g & zero;
    if constexpr (Copy) c[i] = static_cast<uint16_t>(p[i] >> 16);
  }
  if constexpr (Stream) _mm_sfence();
}

void triad_plain(const kernels::AdamBuffers& b, size_t begin, size_t end, uint32_t zero) {
  auto* p = reinterpret_cast<uint32_t*>(b.param);
  auto* m = reinterpret_cast<uint32_t*>(b.exp_avg);
  auto* v = reinterpret_cast<uint32_t*>(b.exp_avg_sq);
  auto* c = static_cast<uint16_t*>(b.param16);
  const bool wide = dtype_nbytes(b.grad_dtype) == 4;
  for (size_t i = begin; i < end; ++i) {
    const uint32_t g = wide ? static_cast<const uint32_t*>(b.grad)[i] : static_cast<const uint16_t*>(b.grad)[i];
    p[i] |= g & zero;
    m[i] |= g & zero;
    v[i] |= g & zero;
    if (c != nullptr) c[i] = static_cast<uint16_t>(p[i] >> 16);
  }
}

using TriadChunk = void (*)(const kernels::AdamBuffers&, size_t, size_t, uint32_t);

template <size_t GradBytes>
TriadChunk triad_for_copy(const kernels::AdamBuffers& b) {
  if (b.param16 == nullptr) return triad_avx2<GradBytes, false, false>;
  // The kernels' own rule (the AVX2 kernel's alignment; bench arrays are page-aligned).
  if (kernels::detail::stream_param16(b, 16)) return triad_avx2<GradBytes, true, true>;
  return triad_avx2<GradBytes, true, false>;
}

template <bool Stream>
__attribute__((target("avx2"))) void land16_avx2(const uint16_t* block, size_t block_numel,
                                                 uint16_t* dst, size_t begin, size_t end) {
  // begin is a multiple of 64 (chunk_range) and so is block_numel: a vector
  // never straddles the block's end. No division per vector: it would cost more
  // than the store.
  size_t i = begin, j = begin % block_numel;
  for (; i + 16 <= end; i += 16, j = j + 16 == block_numel ? 0 : j + 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j));
    if constexpr (Stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), x);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), x);
    }
  }
  for (; i < end; ++i) dst[i] = block[i % block_numel];
  if constexpr (Stream) _mm_sfence();
}

template <bool Stream>
__attribute__((target("avx2"))) void land32_avx2(const uint16_t* block, size_t block_numel,
                                                 float* dst, size_t begin, size_t end) {
  size_t i = begin, j = begin % block_numel;  // as in land16_avx2
  for (; i + 8 <= end; i += 8, j = j + 8 == block_numel ? 0 : j + 8) {
    const __m256i h = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + j))), 16);
    if constexpr (Stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
    }
  }
  for (; i < end; ++i) dst[i] = bf16_to_float(BFloat16{block[i % block_numel]});
  if constexpr (Stream) _mm_sfence();
}

bool aligned32(const void* p) { return reinterpret_cast<uintptr_t>(p) % 32 == 0; }

// Round-to-nearest-even, NaN kept quiet: float_to_bf16, 8 at a time.
__attribute__((target("avx2"))) void copy16_avx2(const float* src, uint16_t* dst, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i is_nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, is_nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08)));
  }
  for (; i < end; ++i) dst[i] = float_to_bf16(src[i]).bits;
}

}  // namespace

HostArray::HostArray(size_t nbytes) : nbytes_(nbytes) {
  ptr_ = std::aligned_alloc(4096, (nbytes + 4095) / 4096 * 4096);
  STRATA_CHECK(ptr_ != nullptr, kOutOfMemory, "strata-adam: cannot allocate {} bytes", nbytes);
}

HostArray::~HostArray() { std::free(ptr_); }

void fill_pseudo(float* dst, size_t numel, uint64_t salt, int threads) {
  timed_split(numel, threads, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) dst[i] = salt == 0 ? 0.0f : pseudo(i, salt);
  });
}

double adam_shaped_triad(const kernels::AdamBuffers& b, int threads) {
  const uint32_t zero = g_zero.load(std::memory_order_relaxed);
  TriadChunk chunk = triad_plain;
  if (have_avx2()) chunk = dtype_nbytes(b.grad_dtype) == 4 ? triad_for_copy<4>(b) : triad_for_copy<2>(b);
  return timed_split(b.numel, threads, [&](size_t begin, size_t end) { chunk(b, begin, end, zero); });
}

bool adam_shaped_triad_check(const kernels::AdamBuffers& b, const size_t* samples, size_t count,
                             const float* p_before, const float* m_before, const float* v_before) {
  bool ok = true;
  for (size_t j = 0; j < count; ++j) {
    const size_t i = samples[j];
    const auto bits = [](float x) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      return u;
    };
    ok &= bits(b.param[i]) == bits(p_before[j]) && bits(b.exp_avg[i]) == bits(m_before[j]) &&
          bits(b.exp_avg_sq[i]) == bits(v_before[j]);
    if (b.param16 != nullptr) {
      ok &= static_cast<const uint16_t*>(b.param16)[i] == static_cast<uint16_t>(bits(b.param[i]) >> 16);
    }
  }
  return ok;
}

double land16(const uint16_t* block, size_t block_numel, uint16_t* dst16, size_t numel, int threads) {
  STRATA_CHECK(block_numel > 0 && block_numel % 64 == 0, kBadArgument, "land16: block of {}", block_numel);
  const bool avx2 = have_avx2();
  return timed_split(numel, threads, [&](size_t begin, size_t end) {
    if (!avx2) {
      for (size_t i = begin; i < end; ++i) dst16[i] = block[i % block_numel];
    } else if (aligned32(dst16 + begin)) {
      land16_avx2<true>(block, block_numel, dst16, begin, end);
    } else {
      land16_avx2<false>(block, block_numel, dst16, begin, end);
    }
  });
}

double land_bf16_to_f32(const uint16_t* block, size_t block_numel, float* dst32, size_t numel,
                        int threads) {
  STRATA_CHECK(block_numel > 0 && block_numel % 64 == 0, kBadArgument, "land_bf16_to_f32: block of {}",
               block_numel);
  const bool avx2 = have_avx2();
  return timed_split(numel, threads, [&](size_t begin, size_t end) {
    if (!avx2) {
      for (size_t i = begin; i < end; ++i) dst32[i] = bf16_to_float(BFloat16{block[i % block_numel]});
    } else if (aligned32(dst32 + begin)) {
      land32_avx2<true>(block, block_numel, dst32, begin, end);
    } else {
      land32_avx2<false>(block, block_numel, dst32, begin, end);
    }
  });
}

double copy_f32_to_bf16(const float* p, uint16_t* dst16, size_t numel, int threads) {
  const bool avx2 = have_avx2();
  return timed_split(numel, threads, [&](size_t begin, size_t end) {
    if (avx2) {
      copy16_avx2(p, dst16, begin, end);
    } else {
      for (size_t i = begin; i < end; ++i) dst16[i] = float_to_bf16(p[i]).bits;
    }
  });
}

}  // namespace strata::bench
