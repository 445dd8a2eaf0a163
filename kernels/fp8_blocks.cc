// FP8 block dequantization on the host (kernels/fp8_blocks.h): the cpu
// backend's kernel and the checkpoint reader's.
#include "kernels/fp8_blocks.h"

#include <algorithm>
#include <array>

namespace strata::kernels {

void dequantize_fp8_blocks(const uint8_t* w, const float* scale_inv, const Fp8Blocks& shape, int64_t first,
                           int64_t n, void* dst, DType dst_dtype) {
  // Every e4m3 code widened once (exact).
  static const std::array<float, 256> kValues = [] {
    std::array<float, 256> v{};
    for (size_t i = 0; i < v.size(); ++i) v[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
    return v;
  }();
  const int64_t cols = shape.cols, grid_cols = shape.grid_cols();
  size_t out = 0;
  for (int64_t e = first, end = first + n; e < end;) {
    const int64_t row = e / cols, col = e % cols;
    const int64_t stop = std::min(end, row * cols + std::min(cols, (col / shape.block_cols + 1) * shape.block_cols));
    const float scale = scale_inv[(row / shape.block_rows) * grid_cols + col / shape.block_cols];
    for (; e < stop; ++e, ++out) store_from_float(dst, dst_dtype, out, kValues[w[e - first]] * scale);
  }
}

}  // namespace strata::kernels
