// CUDA RMSNorm: forward (one block per row, fp32 statistics, rstd saved) and
// the input gradient of backward. The weight gradient is a column sum of
// dy * x * rstd, done by the deterministic column-sum kernel (elementwise.cu).
// The weight may have a different storage type than the activations.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, typename W>
__global__ void rmsnorm_forward_kernel(const T* x, const W* w, int64_t rows, int64_t dim, float eps,
                                       T* y, float* rstd, bool vectorized, float offset) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    float sum_sq = 0.0f;
    if (vectorized) {
      for (int64_t c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
        float f[8];
        load8(xr + c, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum_sq += f[e] * f[e];
      }
    } else {
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = to_f(xr[c]);
        sum_sq += v * v;
      }
    }
    const float s = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(dim) + eps);
    if (threadIdx.x == 0) rstd[r] = s;
    if (vectorized) {
      for (int64_t c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
        float f[8], g[8];
        load8(xr + c, f);
        load8(w + c, g);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = f[e] * s * (g[e] + offset);
        store8(yr + c, f);
      }
    } else {
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
        yr[c] = from_f<T>(to_f(xr[c]) * s * (to_f(w[c]) + offset));
    }
  }
}

template <typename T, typename W>
__global__ void rmsnorm_backward_dx_kernel(const T* dy, const T* x, const W* w, const float* rstd,
                                           int64_t rows, int64_t dim, T* dx, bool accumulate,
                                           bool vectorized, float offset) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t off = r * dim;
    const float s = rstd[r];
    float dot = 0.0f;
    if (vectorized) {
      for (int64_t c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
        float g[8], xv[8], wv[8];
        load8(dy + off + c, g);
        load8(x + off + c, xv);
        load8(w + c, wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) wv[e] += offset;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += g[e] * wv[e] * xv[e];
      }
    } else {
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
        dot += to_f(dy[off + c]) * (to_f(w[c]) + offset) * to_f(x[off + c]);
    }
    const float coef = s * s * block_sum(dot, scratch) / static_cast<float>(dim);
    if (vectorized) {
      for (int64_t c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
        float g[8], xv[8], wv[8], out[8];
        load8(dy + off + c, g);
        load8(x + off + c, xv);
        load8(w + c, wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) wv[e] += offset;
        if (accumulate) {
          load8(dx + off + c, out);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) out[e] = 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] += s * (g[e] * wv[e] - xv[e] * coef);
        store8(dx + off + c, out);
      }
    } else {
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = s * (to_f(dy[off + c]) * (to_f(w[c]) + offset) - to_f(x[off + c]) * coef);
        dx[off + c] = from_f<T>(accumulate ? to_f(dx[off + c]) + v : v);
      }
    }
  }
}

unsigned row_grid(int64_t rows) {
  return static_cast<unsigned>(rows < 65535 * 16 ? rows : 65535 * 16);
}

}  // namespace

void launch_rmsnorm_forward(Storage t, const void* x, Storage w_t, const void* w, int64_t rows,
                            int64_t dim, float eps, void* y, float* rstd, float weight_offset,
                            cudaStream_t stream) {
  if (rows == 0) return;
  const bool vectorized = dim % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  STRATA_DISPATCH_2(t, T, w_t, W,
                    rmsnorm_forward_kernel<T, W><<<row_grid(rows), kThreads, 0, stream>>>(
                        static_cast<const T*>(x), static_cast<const W*>(w), rows, dim, eps,
                        static_cast<T*>(y), rstd, vectorized, weight_offset));
}

void launch_rmsnorm_backward_dx(Storage t, const void* dy, const void* x, Storage w_t,
                                const void* w, const float* rstd, int64_t rows, int64_t dim,
                                void* dx, bool accumulate, float weight_offset, cudaStream_t stream) {
  if (rows == 0) return;
  const bool vectorized =
      dim % 8 == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx);
  STRATA_DISPATCH_2(
      t, T, w_t, W,
      rmsnorm_backward_dx_kernel<T, W><<<row_grid(rows), kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const W*>(w), rstd, rows,
          dim, static_cast<T*>(dx), accumulate, vectorized, weight_offset));
}

}  // namespace strata::ops::cuda
