// FP8 block quantization (kernels/fp8_quantize.h).
#include "kernels/fp8_quantize.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "core/dtype.h"

namespace strata::kernels {

float fp8_block_scale_inv(float amax, bool ue8m0) {
  constexpr float kE4m3Max = 448.0f;
  if (!(amax > 0.0f)) return 1.0f;
  float s = amax / kE4m3Max;
  if (s == 0.0f) s = std::numeric_limits<float>::denorm_min();
  if (!ue8m0) return s;
  // 2^ceil(log2 s) from the bits (DeepSeek's fast_log2_ceil / fast_pow2).
  s = std::max(s, std::numeric_limits<float>::min());
  const uint32_t bits = std::bit_cast<uint32_t>(s);
  uint32_t exponent = (bits >> 23) & 0xffu;
  if ((bits & 0x7fffffu) != 0) ++exponent;  // s <= FLT_MAX / 448: no overflow into the infinities
  return std::bit_cast<float>(exponent << 23);
}

void quantize_fp8_blocks(const float* x, const Fp8Blocks& shape, bool ue8m0, uint8_t* q, float* scale_inv) {
  const int64_t grid_cols = shape.grid_cols();
  for (int64_t bi = 0; bi < shape.grid_rows(); ++bi) {
    const int64_t r0 = bi * shape.block_rows, r1 = std::min(shape.rows, r0 + shape.block_rows);
    for (int64_t bj = 0; bj < grid_cols; ++bj) {
      const int64_t c0 = bj * shape.block_cols, c1 = std::min(shape.cols, c0 + shape.block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * shape.cols + c]));
      }
      const float s = fp8_block_scale_inv(amax, ue8m0);
      scale_inv[bi * grid_cols + bj] = s;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) q[r * shape.cols + c] = float_to_fp8_e4m3(x[r * shape.cols + c] / s);
      }
    }
  }
}

}  // namespace strata::kernels
