// Internal to the CPU optimizer kernels: the per-ISA single-threaded range
// functions the dispatcher (adam.cc) calls. Deliberately no inline code here:
// an inline function emitted by an -mavx2 translation unit could be picked by
// the linker for scalar callers, so SIMD files call the scalar ranges for tails.
#pragma once

#include <cstddef>

#include "kernels/optimizer.h"
#include "core/dtype.h"

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

// Updates of at least this many elements store the 16-bit copy non-temporally.
// Such a call streams >= 240 MiB (30 B/element), beyond most last-level caches
// and about the largest (this VM reports 260 MiB, shared with its neighbours), so
// the copy would rarely survive until its reader (the H2D transfer or the next
// forward); a normal store would first read each
// line for ownership, 2 B/element of the ~32 a step moves (a median 6% faster on
// copy rows, bench/strata-adam/PERFORMANCE.md). A reader right after the call
// (OptimizerSwapper's param_sink) then reads the copy from memory: the same
// traffic the read-for-ownership and write-back of normal stores cost. Smaller
// updates keep the copy in cache for its reader.
constexpr size_t kStreamParam16MinNumel = size_t{1} << 23;
// Whether the SIMD kernels stream b's copy: a copy is written, the whole update
// (b.numel, not one thread's range) reaches kStreamParam16MinNumel, and param16
// is `alignment`-aligned (every range starts at a multiple of 64 elements, so
// each one's first store is then aligned too). Only speed depends on it.
bool stream_param16(const AdamBuffers& b, size_t alignment);

}  // namespace strata::kernels::detail
