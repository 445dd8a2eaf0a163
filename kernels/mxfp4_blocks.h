// MXFP4 weights as gpt-oss publishes its experts (docs/DESIGN.md §4.2.2):
// the checkpoint's stacked form, and the kept form of one expert's weight.
//
// The checkpoint stores the stacked tensor [E, in, width] (gate_up_proj
// [E, hidden, 2 x intermediate], down_proj [E, intermediate, hidden]) as
// "_blocks" uint8 [E, width, in / 32, 16] and "_scales" uint8 [E, width,
// in / 32]: block column k = e * width + c holds column c of expert e, its
// `in` elements in order, two FP4 codes per byte (element j the low nibble
// of byte j / 2 for even j, the high one for odd j) and an e8m0 exponent per
// 32 of them. Element j of block column k is FP4(code) * 2^(scale - 127) in
// fp32 (exact, or inf past 2^128, as torch.ldexp gives it), rounded once to
// the destination's float dtype: transformers' convert_moe_packed_tensors.
//
// strata's expert weights are Linears [out, in] whose row o is block column
// first + o * step of the stacked tensor (gate and up interleaved: step 2).
// Their kept form (a frozen base at home, Engine::store_blocks) is the
// checkpoint's bytes of those block columns in row order: the codes, numel /
// 2 bytes, then the scales, numel / 32 bytes -- 4.25 bits per element. Its
// element i has code nibble i of the codes and scale i / 32: any run of
// elements is a run of code bytes, and a range of bytes starting at a
// 4-KiB slice boundary starts at a block.
//
// The checkpoint reader, the loader and both backends of
// Ops::dequantize_mxfp4_blocks compute these bits: one value table per
// (scale, code), built with store_from_float.
//
// Thread-safety: pure functions. Errors: none (callers validate).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace strata::kernels {

// One weight [rows, cols] kept in MXFP4, blocks of 32 along its rows (cols a multiple of 32).
struct Mxfp4Blocks {
  int64_t rows = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
  int64_t packed_nbytes() const { return numel() / 2; }
  int64_t scale_numel() const { return numel() / 32; }
  int64_t stored_nbytes() const { return packed_nbytes() + scale_numel(); }
};

// The checkpoint's stacked tensor [experts, in, width] (in a multiple of 32).
struct Mxfp4Stacked {
  int64_t experts = 0, in = 0, width = 0;
  int64_t numel() const { return experts * in * width; }
};

// e2m1 by its 4-bit code (transformers' FP4_VALUES).
inline constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The fp32 value of FP4 `code` under e8m0 exponent `scale`: the product with
// 2^(scale - 127) (2^-127 subnormal for 0, inf for 255), exact or inf.
float mxfp4_value(uint8_t scale, uint8_t code);

// Elements [first, first + n) of a kept form into dst (n elements of float
// storage dtype dst_dtype): `codes` points at the byte holding element
// `first` (the range's own bytes), `scales` at the scale of element 0.
void dequantize_mxfp4(const uint8_t* codes, const uint8_t* scales, int64_t first, int64_t n, void* dst,
                      DType dst_dtype);

// Elements [first, first + n) (row-major) of the stacked tensor `s` in
// checkpoint form (`blocks`, `scales` whole) into dst. Walks 32-row bands in
// tiles of columns: each block's 16 bytes and scale are read once.
void dequantize_mxfp4_stacked(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s, int64_t first,
                              int64_t n, void* dst, DType dst_dtype);

// An expert's weight [rows, s.in] whose row o is block column first_column +
// o * column_step of the stacked tensor `s` in checkpoint form:
// elements [first, first + n) of it into dst (row by row, the reader's bits) ...
void dequantize_mxfp4_columns(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s,
                              int64_t first_column, int64_t column_step, int64_t first, int64_t n, void* dst,
                              DType dst_dtype);
// ... and bytes [first, first + n) of its kept form (rows x s.in elements) into dst.
void pack_mxfp4_columns(const uint8_t* blocks, const uint8_t* scales, const Mxfp4Stacked& s, int64_t first_column,
                        int64_t column_step, int64_t rows, int64_t first, int64_t n, uint8_t* dst);

}  // namespace strata::kernels
