// CUDA elementwise helpers of the nn operators: residual add, bias add and
// bias gradient (Linear), and fp32 -> storage casts.
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

template <typename T>
__global__ void add_kernel(const T* a, const T* b, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
  }
}

template <typename T>
__global__ void add_bias_kernel(T* y, int64_t ldy, const T* bias, int64_t cols) {
  T* yr = y + blockIdx.x * ldy;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    yr[c] = from_f<T>(to_f(yr[c]) + to_f(bias[c]));
}

template <typename T>
__global__ void bias_grad_kernel(const T* dy, int64_t ldy, int64_t rows, int64_t cols,
                                 float* dbias) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.0f;
  for (int64_t r = 0; r < rows; ++r) acc += to_f(dy[r * ldy + c]);
  dbias[c] += acc;
}

template <typename T>
__global__ void cast_kernel(const float* src, int64_t n, T* dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = from_f<T>(src[i]);
  }
}

}  // namespace

void launch_add(bool bf16, const void* a, const void* b, int64_t numel, void* out,
                cudaStream_t stream) {
  if (numel == 0) return;
  STRATA_NN_DISPATCH(
      bf16, add_kernel<T><<<grid_for(numel, 256), 256, 0, stream>>>(
                static_cast<const T*>(a), static_cast<const T*>(b), numel, static_cast<T*>(out)));
}

void launch_add_bias(bool bf16, void* y, int64_t ldy, const void* bias, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  if (rows == 0) return;
  STRATA_NN_DISPATCH(bf16, add_bias_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
                               static_cast<T*>(y), ldy, static_cast<const T*>(bias), cols));
}

void launch_bias_grad(bool bf16, const void* dy, int64_t ldy, int64_t rows, int64_t cols,
                      float* dbias, cudaStream_t stream) {
  STRATA_NN_DISPATCH(bf16, bias_grad_kernel<T><<<grid_for(cols, 256), 256, 0, stream>>>(
                               static_cast<const T*>(dy), ldy, rows, cols, dbias));
}

void launch_cast_from_f32(bool bf16, const float* src, int64_t numel, void* dst,
                          cudaStream_t stream) {
  if (numel == 0) return;
  STRATA_NN_DISPATCH(bf16, cast_kernel<T>
                     <<<grid_for(numel, 256), 256, 0, stream>>>(src, numel, static_cast<T*>(dst)));
}

}  // namespace strata::nn::cuda::detail
