// FP8 block-quantized weights as DeepSeek-V3, Kimi K2 and the Qwen3 FP8
// releases store them (docs/DESIGN.md §4.2.2): a weight [rows, cols] of
// e4m3 bytes (torch's float8_e4m3fn) and an fp32 grid `scale_inv` of
// ceil(rows / block_rows) x ceil(cols / block_cols), one per block, the edge
// blocks ragged. Element (i, j) is float(w[i, j]) * scale_inv[i / block_rows,
// j / block_cols] in fp32 (exact widening, one rounding: the product), then
// rounded once to the destination's float dtype -- transformers'
// _dequantize_fp8_weight. The checkpoint reader (runtime/nn/checkpoint_quant)
// and both backends of Ops::dequantize_fp8_blocks compute exactly this, so a
// weight kept in FP8 and dequantized per gather has the bits of one
// dequantized when it was read.
//
// Thread-safety: pure functions. Errors: none (callers validate).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace strata::kernels {

// The shape of one block-quantized weight.
struct Fp8Blocks {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 128, block_cols = 128;
  int64_t grid_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t grid_cols() const { return (cols + block_cols - 1) / block_cols; }
  int64_t grid_numel() const { return grid_rows() * grid_cols(); }
};

// Elements [first, first + n) (row-major) of the weight dequantized into dst
// (n elements of float storage dtype dst_dtype). `w` points at element
// `first`'s byte (the range's own bytes), `scale_inv` at the whole grid.
// One run per (row, column block): one scale each.
void dequantize_fp8_blocks(const uint8_t* w, const float* scale_inv, const Fp8Blocks& shape, int64_t first,
                           int64_t n, void* dst, DType dst_dtype);

}  // namespace strata::kernels
