// Internal to kernels/cuda (.cu files only): fp32 <-> storage conversion and
// block reductions shared by the nn_* kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace strata::nn::cuda::detail {

__device__ __forceinline__ float to_f(float x) {
  return x;
}
__device__ __forceinline__ float to_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  float m = -INFINITY;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

inline unsigned int grid_for(long long n, int block) {
  const long long g = (n + block - 1) / block;
  return static_cast<unsigned int>(g < 65535 * 32 ? (g > 0 ? g : 1) : 65535 * 32);
}

}  // namespace strata::nn::cuda::detail

// Runs the statement with T = __nv_bfloat16 or float.
#define STRATA_NN_DISPATCH(bf16, ...) \
  do {                                \
    if (bf16) {                       \
      using T = __nv_bfloat16;        \
      __VA_ARGS__;                    \
    } else {                          \
      using T = float;                \
      __VA_ARGS__;                    \
    }                                 \
  } while (0)
