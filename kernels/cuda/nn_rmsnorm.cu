// CUDA RMSNorm forward and backward, one block per row, fp32 statistics.
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

template <typename T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, int64_t dim, float eps, T* y,
                                       float* rstd) {
  __shared__ float scratch[32];
  const T* xr = x + blockIdx.x * dim;
  float sum_sq = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    const float v = to_f(xr[c]);
    sum_sq += v * v;
  }
  const float s = rsqrtf(block_sum(sum_sq, scratch) / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = s;
  T* yr = y + blockIdx.x * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
    yr[c] = from_f<T>(to_f(xr[c]) * s * to_f(w[c]));
}

template <typename T>
__global__ void rmsnorm_backward_kernel(const T* dy, const T* x, const T* w, const float* rstd,
                                        int64_t dim, T* dx, float* dw) {
  __shared__ float scratch[32];
  const int64_t off = blockIdx.x * dim;
  const float s = rstd[blockIdx.x];
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    dot += to_f(dy[off + c]) * to_f(w[c]) * to_f(x[off + c]);
  }
  const float coef = s * s * block_sum(dot, scratch) / static_cast<float>(dim);
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    const float xv = to_f(x[off + c]), g = to_f(dy[off + c]);
    dx[off + c] = from_f<T>(s * (g * to_f(w[c]) - xv * coef));
    atomicAdd(dw + c, g * xv * s);
  }
}

}  // namespace

void launch_rmsnorm_forward(bool bf16, const void* x, const void* w, int64_t rows, int64_t dim,
                            float eps, void* y, float* rstd, cudaStream_t stream) {
  if (rows == 0) return;
  STRATA_NN_DISPATCH(
      bf16,
      rmsnorm_forward_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(w), dim, eps, static_cast<T*>(y), rstd));
}

void launch_rmsnorm_backward(bool bf16, const void* dy, const void* x, const void* w,
                             const float* rstd, int64_t rows, int64_t dim, void* dx, float* dw,
                             cudaStream_t stream) {
  if (rows == 0) return;
  STRATA_NN_DISPATCH(
      bf16, rmsnorm_backward_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
                static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
                dim, static_cast<T*>(dx), dw));
}

}  // namespace strata::nn::cuda::detail
