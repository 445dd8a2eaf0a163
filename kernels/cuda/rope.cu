// CUDA rotary position embedding (Hugging Face rotate_half layout), in place.
// One thread per (row, frequency): the angle and its sine/cosine are computed
// once in double (positions reach 1e5 and beyond, where an fp32 angle would be
// off by ~1e-2 rad) from rope_inv_freq (kernels/rope_frequencies.h, the
// formula the cpu kernels use), scaled by rope_attention_scale (YaRN's
// attention factor, else 1), and applied to that pair in every head.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

template <typename T>
__global__ void rope_kernel(T* x, const int32_t* positions, int64_t rows, int64_t heads,
                            int64_t head_dim, Rope rope, double sign) {
  const int64_t rotary = rope_rotary_dim(rope, head_dim), half = rotary / 2;
  const int64_t n = rows * half;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / half, i = idx - r * half;
    const double inv_freq = rope_inv_freq(rope, i, rotary);
    int64_t a, b;
    rope_pair(rope, head_dim, i, &a, &b);
    double sn, cs;
    sincos(static_cast<double>(positions[r]) * inv_freq, &sn, &cs);
    const double scale = rope_attention_scale(rope);
    const float c = static_cast<float>(scale * cs), s = static_cast<float>(scale * sign * sn);
    T* row = x + r * heads * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* xh = row + h * head_dim;
      const float x1 = to_f(xh[a]), x2 = to_f(xh[b]);
      xh[a] = from_f<T>(x1 * c - x2 * s);
      xh[b] = from_f<T>(x2 * c + x1 * s);
    }
  }
}

}  // namespace

void launch_rope(Storage t, void* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, const Rope& rope, double sign, cudaStream_t stream) {
  if (rows == 0 || heads == 0) return;
  STRATA_DISPATCH_T(t, T,
                    rope_kernel<T><<<grid_for(rows * (rope_rotary_dim(rope, head_dim) / 2), 128), 128, 0, stream>>>(
                        static_cast<T*>(x), positions, rows, heads, head_dim, rope, sign));
}

}  // namespace strata::ops::cuda
