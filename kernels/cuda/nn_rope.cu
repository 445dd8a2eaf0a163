// CUDA rotary position embedding (rotate_half layout), in place; angles in
// double so long positions match the CPU reference.
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

template <typename T>
__global__ void rope_kernel(T* x, const int32_t* positions, int64_t heads, int64_t head_dim,
                            double theta, double sign) {
  const int64_t r = blockIdx.x, half = head_dim / 2;
  const double pos = positions[r];
  for (int64_t idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int64_t h = idx / half, i = idx % half;
    const double angle =
        pos * pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    double sn, cs;
    sincos(angle, &sn, &cs);
    const float c = static_cast<float>(cs), s = static_cast<float>(sign * sn);
    T* xh = x + (r * heads + h) * head_dim;
    const float x1 = to_f(xh[i]), x2 = to_f(xh[i + half]);
    xh[i] = from_f<T>(x1 * c - x2 * s);
    xh[i + half] = from_f<T>(x2 * c + x1 * s);
  }
}

}  // namespace

void launch_rope(bool bf16, void* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, double theta, double sign, cudaStream_t stream) {
  if (rows == 0) return;
  STRATA_NN_DISPATCH(bf16, rope_kernel<T><<<static_cast<unsigned>(rows), 128, 0, stream>>>(
                               static_cast<T*>(x), positions, heads, head_dim, theta, sign));
}

}  // namespace strata::nn::cuda::detail
