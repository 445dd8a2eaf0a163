// CUDA optimizer kernels (offload_optimizer.device none): the Adam/AdamW
// update of kernels::adam_step on the device, with the parameter copy written
// in the same pass, and the gradient's sum of squares (the clipping norm and
// the overflow check) in two deterministic passes.
//
// Bit-identity with the CPU kernels: each operation of update8 in
// kernels/cpu/adam_avx2.cc (and update16 in adam_avx512.cc) is written here as
// the intrinsic of the same IEEE operation — fused where AVX fuses, rounded
// separately where it does not — so nvcc's FMA contraction can neither merge
// nor split one; square root and division are the correctly rounded ones on
// both sides, and neither flushes denormals (nvcc's default, the MXCSR's
// default). Equal inputs then give equal bits, except NaN payloads (x86 keeps
// an operand's, CUDA returns its canonical NaN).
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int kAdamThreads = 256;
constexpr int kSumThreads = 256;
// At most this many blocks (partial sums) in grad_sum_sq's first pass: about
// two resident grids of 256 threads on an H100, enough loads in flight to
// stream the gradient, few enough partials for one block to add.
constexpr int64_t kMaxSumBlocks = 1024;

bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// update8 of adam_avx2.cc for one element (AVX2 negates step_size on the host;
// negation is exact, so either side may do it).
__device__ __forceinline__ void adam_update(const AdamScalars& k, float& p, float& m, float& v,
                                            float g) {
  g = __fmaf_rn(g, k.grad_scale, __fmul_rn(k.l2, p));
  p = __fmul_rn(p, k.decay);
  m = __fmaf_rn(k.beta1, m, __fmul_rn(k.one_minus_beta1, g));
  v = __fmaf_rn(k.beta2, v, __fmul_rn(k.one_minus_beta2, __fmul_rn(g, g)));
  const float denom = __fmaf_rn(__fsqrt_rn(v), k.inv_bias2_sqrt, k.eps);
  p = __fmaf_rn(-k.step_size, __fdiv_rn(m, denom), p);
}

// Four consecutive copies at dst: 16 bytes of fp32 (dst 16-byte aligned) or 8
// bytes of a 16-bit type (dst 8-byte aligned), elements in address order.
template <typename C>
__device__ __forceinline__ void store4(C* dst, const float4& p) {
  if constexpr (sizeof(C) == 4) {
    *reinterpret_cast<float4*>(dst) = p;
  } else {
    const unsigned lo = bits_of(from_f<C>(p.x)) | (bits_of(from_f<C>(p.y)) << 16);
    const unsigned hi = bits_of(from_f<C>(p.z)) | (bits_of(from_f<C>(p.w)) << 16);
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  }
}

// Grid-stride over numel elements, four per step with 16-byte accesses when
// every array is aligned for them (vectorized), else one. copy may be null.
template <typename C>
__global__ void adam_kernel(AdamScalars k, float* param, float* exp_avg, float* exp_avg_sq,
                            const float* grad, C* copy, int64_t n, bool vectorized) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vectorized) {
    const int64_t packs = n / 4;
    for (int64_t q = tid; q < packs; q += stride) {
      float4 p = reinterpret_cast<const float4*>(param)[q];
      float4 m = reinterpret_cast<const float4*>(exp_avg)[q];
      float4 v = reinterpret_cast<const float4*>(exp_avg_sq)[q];
      const float4 g = reinterpret_cast<const float4*>(grad)[q];
      adam_update(k, p.x, m.x, v.x, g.x);
      adam_update(k, p.y, m.y, v.y, g.y);
      adam_update(k, p.z, m.z, v.z, g.z);
      adam_update(k, p.w, m.w, v.w, g.w);
      reinterpret_cast<float4*>(param)[q] = p;
      reinterpret_cast<float4*>(exp_avg)[q] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[q] = v;
      if (copy != nullptr) store4(copy + 4 * q, p);
    }
    scalar_begin = packs * 4;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_update(k, p, m, v, grad[i]);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (copy != nullptr) copy[i] = from_f<C>(p);
  }
}

// x*x for x = the fp32 product grad*scale widened: exact in double (a 24-bit
// significand squared), so the only roundings are the additions.
__device__ __forceinline__ double add_square(double acc, float g, float scale) {
  const double x = static_cast<double>(__fmul_rn(g, scale));
  return __fma_rn(x, x, acc);
}

// First pass. Elements go in groups of four; thread t of the grid adds groups
// t, t + stride, ... each in element order, whether a group arrives as one
// float4 (vectorized and whole) or as single loads, so the order — hence the
// bits — depends on n only. Each block's sum goes to partial[block].
__global__ void sum_sq_partial_kernel(const float* grad, int64_t n, float scale, bool vectorized,
                                      double* partial) {
  __shared__ double scratch[32];
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double acc = 0.0;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < groups;
       q += stride) {
    const int64_t i = 4 * q;
    if (vectorized && i + 4 <= n) {
      const float4 g = reinterpret_cast<const float4*>(grad)[q];
      acc = add_square(acc, g.x, scale);
      acc = add_square(acc, g.y, scale);
      acc = add_square(acc, g.z, scale);
      acc = add_square(acc, g.w, scale);
    } else {
      const int64_t end = i + 4 < n ? i + 4 : n;
      for (int64_t j = i; j < end; ++j) acc = add_square(acc, grad[j], scale);
    }
  }
  acc = block_sum(acc, scratch);  // fixed order: warp butterflies, then warps in order
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Second pass, one block: the partials in a fixed order; out[0] overwritten
// (0 when there are none).
__global__ void sum_sq_finish_kernel(const double* partial, int64_t blocks, double* out) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) acc += partial[b];
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[0] = acc;
}

}  // namespace

void launch_adam_step(const AdamScalars& k, float* param, float* exp_avg, float* exp_avg_sq,
                      const float* grad, int64_t numel, Storage copy_t, void* copy,
                      cudaStream_t stream) {
  if (numel == 0) return;
  const uintptr_t copy_align = copy_t == Storage::kF32 ? 16 : 8;  // four copies per access
  const bool vectorized = aligned_to(param, 16) && aligned_to(exp_avg, 16) &&
                          aligned_to(exp_avg_sq, 16) && aligned_to(grad, 16) &&
                          (copy == nullptr || aligned_to(copy, copy_align));
  const unsigned grid = grid_for(vectorized ? (numel + 3) / 4 : numel, kAdamThreads);
  if (copy == nullptr) {
    adam_kernel<float><<<grid, kAdamThreads, 0, stream>>>(k, param, exp_avg, exp_avg_sq, grad,
                                                          nullptr, numel, vectorized);
    return;
  }
  STRATA_DISPATCH_T(copy_t, C,
                    adam_kernel<C>
                    <<<grid, kAdamThreads, 0, stream>>>(k, param, exp_avg, exp_avg_sq, grad,
                                                        static_cast<C*>(copy), numel, vectorized));
}

int64_t grad_sum_sq_blocks(int64_t numel) {
  if (numel <= 0) return 0;
  const int64_t groups = (numel + 3) / 4;
  const int64_t blocks = (groups + kSumThreads - 1) / kSumThreads;
  return blocks < kMaxSumBlocks ? blocks : kMaxSumBlocks;
}

void launch_grad_sum_sq(const float* grad, int64_t numel, float scale, double* partial, double* out,
                        cudaStream_t stream) {
  const int64_t blocks = grad_sum_sq_blocks(numel);
  if (blocks > 0) {
    sum_sq_partial_kernel<<<static_cast<unsigned>(blocks), kSumThreads, 0, stream>>>(
        grad, numel, scale, aligned_to(grad, 16), partial);
  }
  sum_sq_finish_kernel<<<1, kSumThreads, 0, stream>>>(partial, blocks, out);
}

}  // namespace strata::ops::cuda
