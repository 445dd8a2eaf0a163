// CPU rotary position embedding (Hugging Face rotate_half layout), forward and
// its transpose for backward. Angles are computed in double from
// rope_inv_freq, cos and sin scaled by rope_attention_scale
// (kernels/rope_frequencies.h: YaRN's attention factor, else 1).
#include <cmath>
#include <vector>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"
#include "core/error.h"

namespace strata::nn::cpu {
namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle (backward = transpose).
template <typename T>
void rotate(T* x, const int32_t* positions, int64_t rows, int64_t heads, int64_t head_dim,
            const Rope& rope, double sign) {
  STRATA_CHECK(head_dim > 0 && head_dim % 2 == 0, kBadArgument,
               "rope: head_dim must be even and positive, got {}", head_dim);
  // The rotated dims (all of the head, or rope.rotary_offset/rotary_dim's part) and their pairs.
  const int64_t rotary = ops::rope_rotary_dim(rope, head_dim), half = rotary / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  std::vector<int64_t> first(static_cast<size_t>(half)), second(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[static_cast<size_t>(i)] = ops::rope_inv_freq(rope, i, rotary);
    ops::rope_pair(rope, head_dim, i, &first[static_cast<size_t>(i)], &second[static_cast<size_t>(i)]);
  }
  const double scale = ops::rope_attention_scale(rope);
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= detail::kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const double pos = positions[r];
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * inv_freq[static_cast<size_t>(i)];
      const T c = static_cast<T>(scale * std::cos(angle));
      const T s = static_cast<T>(scale * sign * std::sin(angle));
      const int64_t a = first[static_cast<size_t>(i)], b = second[static_cast<size_t>(i)];
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + (r * heads + h) * head_dim;
        const T x1 = xh[a];
        const T x2 = xh[b];
        xh[a] = x1 * c - x2 * s;
        xh[b] = x2 * c + x1 * s;
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* x, const int32_t* positions, int64_t rows, int64_t heads, int64_t head_dim,
                  const Rope& rope) {
  rotate(x, positions, rows, heads, head_dim, rope, 1.0);
}

template <typename T>
void rope_backward(T* dx, const int32_t* positions, int64_t rows, int64_t heads, int64_t head_dim,
                   const Rope& rope) {
  rotate(dx, positions, rows, heads, head_dim, rope, -1.0);
}

template void rope_forward<float>(float*, const int32_t*, int64_t, int64_t, int64_t, const Rope&);
template void rope_forward<double>(double*, const int32_t*, int64_t, int64_t, int64_t, const Rope&);
template void rope_backward<float>(float*, const int32_t*, int64_t, int64_t, int64_t, const Rope&);
template void rope_backward<double>(double*, const int32_t*, int64_t, int64_t, int64_t, const Rope&);

}  // namespace strata::nn::cpu
