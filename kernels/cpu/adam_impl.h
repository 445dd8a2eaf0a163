// Internal to the CPU optimizer kernels: the per-ISA single-threaded range
// functions the dispatcher (adam.cc) calls. Deliberately no inline code here:
// an inline function emitted by an -mavx2 translation unit could be picked by
// the linker for scalar callers, so SIMD files call the scalar ranges for tails.
#pragma once

#include <cstddef>

#include "kernels/optimizer.h"
#include "runtime/core/dtype.h"

namespace strata::kernels::detail {

// Single-threaded kernels over elements [begin, end) of the buffers.
void adam_range_scalar(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end);
void adam_range_avx2(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end);
void adam_range_avx512(const AdamCoefficients& c, const AdamBuffers& b, size_t begin, size_t end);

// Sum of squares of grad[begin, end) * scale, in double. Non-finite elements
// make the sum non-finite (squares are never negative, so Inf never cancels).
double sum_sq_range_scalar(const void* grad, DType dtype, size_t begin, size_t end, float scale);
double sum_sq_range_avx2(const void* grad, DType dtype, size_t begin, size_t end, float scale);
double sum_sq_range_avx512(const void* grad, DType dtype, size_t begin, size_t end, float scale);

}  // namespace strata::kernels::detail
