// CUDA SwiGLU gate forward and backward (elementwise, fp32 math).
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

template <typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = to_f(gate[i]);
    out[i] = from_f<T>(g / (1.0f + expf(-g)) * to_f(up[i]));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* dout, const T* gate, const T* up, int64_t n,
                                       T* dgate, T* dup) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = to_f(gate[i]), d = to_f(dout[i]), u = to_f(up[i]);
    const float sig = 1.0f / (1.0f + expf(-g));
    dgate[i] = from_f<T>(d * u * sig * (1.0f + g * (1.0f - sig)));
    dup[i] = from_f<T>(d * g * sig);
  }
}

}  // namespace

void launch_swiglu_forward(bool bf16, const void* gate, const void* up, int64_t numel, void* out,
                           cudaStream_t stream) {
  if (numel == 0) return;
  STRATA_NN_DISPATCH(bf16, swiglu_forward_kernel<T><<<grid_for(numel, 256), 256, 0, stream>>>(
                               static_cast<const T*>(gate), static_cast<const T*>(up), numel,
                               static_cast<T*>(out)));
}

void launch_swiglu_backward(bool bf16, const void* dout, const void* gate, const void* up,
                            int64_t numel, void* dgate, void* dup, cudaStream_t stream) {
  if (numel == 0) return;
  STRATA_NN_DISPATCH(
      bf16, swiglu_backward_kernel<T><<<grid_for(numel, 256), 256, 0, stream>>>(
                static_cast<const T*>(dout), static_cast<const T*>(gate), static_cast<const T*>(up),
                numel, static_cast<T*>(dgate), static_cast<T*>(dup)));
}

}  // namespace strata::nn::cuda::detail
