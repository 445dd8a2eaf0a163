// FP8 block quantization, the inverse of kernels/fp8_blocks.h's
// dequantization: the one quantizer strata writes FP8 weights with (the
// export's --export-dtype fp8, docs/DESIGN.md §5.3), as DeepSeek quantizes
// its checkpoints (its fp8 cast, scripts/make-golden-quant's quantize_block):
// per block of block_rows x block_cols (edge blocks ragged, the grid
// ceil-sized), in fp32,
//   amax      = max |x| over the block
//   scale_inv = amax / 448                  (448: e4m3's largest value)
//               amax 0: 1 (the block's zeros, and their signs, come back
//               exactly); a quotient that underflows to 0 (amax below
//               448 * 2^-150): the smallest subnormal, so no division by 0
//   ue8m0     : scale_inv rounded up to a power of two from its bits, as
//               DeepSeek's fast_round_scale (2^ceil(log2 s), exact; a
//               subnormal s becomes 2^-126 as transformers' clamp to
//               float32's tiny does)
//   q         = e4m3(x / scale_inv), torch's .to(torch.float8_e4m3fn)
//               (core/dtype.h's float_to_fp8_e4m3: nearest even, saturating
//               at 448, NaN kept)
// so dequantizing (q * scale_inv) a weight quantized by the same formula
// from its own dequantized fp32 values gives back its bytes and scales.
//
// Thread-safety: pure functions. Errors: none (callers validate the shapes).
#pragma once

#include <cstdint>

#include "kernels/fp8_blocks.h"

namespace strata::kernels {

// One block's scale_inv for absolute maximum `amax` (>= 0, finite).
float fp8_block_scale_inv(float amax, bool ue8m0);

// x [rows, cols] (fp32, row-major) into q (rows * cols e4m3 codes) and
// scale_inv (shape.grid_numel() fp32, row-major over the grid).
void quantize_fp8_blocks(const float* x, const Fp8Blocks& shape, bool ue8m0, uint8_t* q, float* scale_inv);

}  // namespace strata::kernels
