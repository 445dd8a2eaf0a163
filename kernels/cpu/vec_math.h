// Vectorised float helpers for the cpu ops' inner loops (softmax rows, scaling),
// with run-time ISA dispatch: the AVX2 versions (vec_math_avx2.cc) when the CPU
// has AVX2 + FMA, scalar otherwise (STRATA_ISA=scalar forces the scalar ones).
// The AVX2 exp is a degree-6 polynomial after range reduction: within 2 ulp of
// std::exp for inputs in [-87, 88]; below -87.3 it returns 0 (std::exp returns
// a denormal there, which no softmax can tell apart from 0).
// Thread-safety: pure functions. Internal to kernels/cpu.
#pragma once

#include <cstdint>

namespace strata::ops::vec {

// max of x[0..n); -inf for n == 0.
float max(const float* x, int64_t n);
// out[i] = exp(x[i] - shift) (out may be x, or null to only sum); returns the
// sum of the exponentials, accumulated in double across lanes.
double exp_shifted(const float* x, int64_t n, float shift, float* out);
// x[i] *= f.
void scale(float* x, int64_t n, float f);
// y[i] += a * x[i].
void axpy(float* y, const float* x, int64_t n, float a);
// SwiGLU: out[i] = silu(gate[i]) * up[i], silu(g) = g * sigmoid(g).
void swiglu(const float* gate, const float* up, int64_t n, float* out);
// Its backward: dgate = dout * up * s * (1 + g (1 - s)), dup = dout * silu(g).
void swiglu_backward(const float* dout, const float* gate, const float* up, int64_t n,
                     float* dgate, float* dup);

namespace detail {
float max_avx2(const float* x, int64_t n);
double exp_shifted_avx2(const float* x, int64_t n, float shift, float* out);
void scale_avx2(float* x, int64_t n, float f);
void axpy_avx2(float* y, const float* x, int64_t n, float a);
void swiglu_avx2(const float* gate, const float* up, int64_t n, float* out);
void swiglu_backward_avx2(const float* dout, const float* gate, const float* up, int64_t n,
                          float* dgate, float* dup);
}  // namespace detail

}  // namespace strata::ops::vec
