// A frozen weight kept in its checkpoint's block-quantized form
// (docs/DESIGN.md §4.2.2): which format, its shape in that format, and what
// its home holds. One description for every format, so the engine's home,
// gathers and host reads treat them alike.
//
// Thread-safety: plain values. Errors: none.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"
#include "kernels/fp8_blocks.h"
#include "kernels/mxfp4_blocks.h"

namespace strata::kernels {

struct QuantBlocks {
  enum class Format : uint8_t {
    kFp8,    // e4m3 bytes, one per element; an fp32 scale per block (fp8)
    kMxfp4,  // kernels/mxfp4_blocks.h's kept form: two codes per byte, then an e8m0 scale per 32 (mxfp4)
  };
  Format format = Format::kFp8;
  Fp8Blocks fp8;      // format kFp8
  Mxfp4Blocks mxfp4;  // format kMxfp4

  static QuantBlocks of(const Fp8Blocks& b) { return {Format::kFp8, b, {}}; }
  static QuantBlocks of(const Mxfp4Blocks& b) { return {Format::kMxfp4, {}, b}; }

  const char* name() const { return format == Format::kFp8 ? "FP8" : "MXFP4"; }
  // The home's elements: FP8's e4m3 bytes in the weight's shape, MXFP4's
  // kept form as bytes (its scales included, partitioned with the codes).
  DType stored_dtype() const { return format == Format::kFp8 ? DType::kF8E4M3 : DType::kU8; }
  Shape stored_shape() const {
    return format == Format::kFp8 ? Shape{fp8.rows, fp8.cols} : Shape{mxfp4.stored_nbytes()};
  }
  int64_t stored_nbytes() const { return format == Format::kFp8 ? fp8.rows * fp8.cols : mxfp4.stored_nbytes(); }
  // The scale grid every rank holds whole (Engine::write_blocks): FP8's fp32
  // grid (also in accelerator memory, for the gathers), MXFP4's e8m0 bytes
  // (on the host only: the gathers read the scales gathered with the codes).
  DType scale_dtype() const { return format == Format::kFp8 ? DType::kF32 : DType::kU8; }
  Shape scale_shape() const {
    return format == Format::kFp8 ? Shape{fp8.grid_rows(), fp8.grid_cols()}
                                  : Shape{mxfp4.rows, mxfp4.cols / 32};
  }
};

}  // namespace strata::kernels
