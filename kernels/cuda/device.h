// Internal to kernels/cuda (.cu files only): fp32 <-> storage conversions for
// the three float storage types, warp and block reductions, grid sizing, and
// the dtype dispatch macros the launchers use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace strata::ops::cuda {

__device__ __forceinline__ float to_f(float x) {
  return x;
}
__device__ __forceinline__ float to_f(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Round to nearest even, like strata::convert on the host.
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result, summed in the same order on every run. `scratch` holds 32
// values and may be reused by the next call (the leading barrier protects it).
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  V total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  float m = -INFINITY;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// The log-sum-exp of row[0, n) over the block (every thread gets it): a
// running (max, sum of exp) per thread in one pass, combined by the block.
template <typename T>
__device__ __forceinline__ float block_logsumexp(const T* row, int64_t n, float* scratch) {
  float m = -INFINITY, s = 0.0f;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    const float v = to_f(row[c]);
    if (v > m) {
      s = s * expf(m - v) + 1.0f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  const float row_max = block_max(m, scratch);
  const float row_sum = block_sum(m == -INFINITY ? 0.0f : s * expf(m - row_max), scratch);
  return row_max + logf(row_sum);
}

// The bit pattern of a 16-bit value and back (type-safe: no pointer casts
// between unrelated types, which the device compiler's alias analysis may
// assume never alias).
__device__ __forceinline__ unsigned bits_of(__half h) {
  return __half_as_ushort(h);
}
__device__ __forceinline__ unsigned bits_of(__nv_bfloat16 h) {
  return __bfloat16_as_ushort(h);
}
template <typename T>
__device__ __forceinline__ T from_bits(unsigned short b);
template <>
__device__ __forceinline__ __half from_bits<__half>(unsigned short b) {
  return __ushort_as_half(b);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned short b) {
  return __ushort_as_bfloat16(b);
}

// Eight consecutive elements as floats; p must be 16-byte aligned. 16-bit
// elements travel as one uint4 whose words hold elements (2i, 2i + 1) in
// their (low, high) halves (little endian).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = to_f(from_bits<T>(static_cast<unsigned short>(w[i] & 0xffffu)));
      f[2 * i + 1] = to_f(from_bits<T>(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&f)[8]) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = bits_of(from_f<T>(f[2 * i])) | (bits_of(from_f<T>(f[2 * i + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Blocks for a grid-stride loop over n items: enough to fill the device, never
// more than the grid limit.
inline unsigned int grid_for(int64_t n, int block) {
  const int64_t g = (n + block - 1) / block;
  return static_cast<unsigned int>(g < 1 ? 1 : (g > 65535 * 16 ? 65535 * 16 : g));
}

}  // namespace strata::ops::cuda

// Runs the statements with T bound to the storage type of `st` (a Storage).
#define STRATA_DISPATCH_T(st, T, ...)             \
  do {                                            \
    switch (st) {                                 \
      case ::strata::ops::cuda::Storage::kF32: {  \
        using T = float;                          \
        __VA_ARGS__;                              \
        break;                                    \
      }                                           \
      case ::strata::ops::cuda::Storage::kF16: {  \
        using T = __half;                         \
        __VA_ARGS__;                              \
        break;                                    \
      }                                           \
      case ::strata::ops::cuda::Storage::kBF16: { \
        using T = __nv_bfloat16;                  \
        __VA_ARGS__;                              \
        break;                                    \
      }                                           \
    }                                             \
  } while (0)

// Two nested dispatches: activation type TA and parameter type TP.
#define STRATA_DISPATCH_2(sa, TA, sp, TP, ...) \
  STRATA_DISPATCH_T(sa, TA, STRATA_DISPATCH_T(sp, TP, __VA_ARGS__))
