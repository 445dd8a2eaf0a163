// CUDA elementwise kernels of the model operators: casts between storage
// types, residual add, SwiGLU forward/backward, the Linear bias add, and the
// deterministic column sums behind the bias and RMSNorm weight gradients.
// Math is fp32; maps move eight elements per thread with 16-byte accesses when
// every pointer is 16-byte aligned (the allocator's tensors are).
#include "kernels/cuda/device.h"
#include "kernels/dropout_mask.h"

namespace strata::ops::cuda {
namespace {

constexpr int kThreads = 256;

// out[j][i] = op(in[0][i], ..., in[kIn-1][i]) for j < kOut, all of storage T.
template <typename T, int kIn, int kOut>
struct MapArgs {
  const T* in[kIn];
  T* out[kOut];
};

template <typename T, int kIn, int kOut, typename Op>
__global__ void map_kernel(MapArgs<T, kIn, kOut> args, int64_t n, bool vectorized, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vectorized) {
    const int64_t packs = n / 8;
    for (int64_t p = tid; p < packs; p += stride) {
      float x[kIn][8], y[kOut][8];
#pragma unroll
      for (int a = 0; a < kIn; ++a) load8(args.in[a] + p * 8, x[a]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float xi[kIn], yi[kOut];
#pragma unroll
        for (int a = 0; a < kIn; ++a) xi[a] = x[a][e];
        op(xi, yi);
#pragma unroll
        for (int b = 0; b < kOut; ++b) y[b][e] = yi[b];
      }
#pragma unroll
      for (int b = 0; b < kOut; ++b) store8(args.out[b] + p * 8, y[b]);
    }
    scalar_begin = packs * 8;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) {
    float xi[kIn], yi[kOut];
#pragma unroll
    for (int a = 0; a < kIn; ++a) xi[a] = to_f(args.in[a][i]);
    op(xi, yi);
#pragma unroll
    for (int b = 0; b < kOut; ++b) args.out[b][i] = from_f<T>(yi[b]);
  }
}

struct AddOp {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = x[0] + x[1]; }
};

// silu(g) * u with silu(g) = g * sigmoid(g).
struct SwigluOp {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    const float g = x[0];
    y[0] = g / (1.0f + expf(-g)) * x[1];
  }
};

// d/dg [g s(g) u] = u s (1 + g (1 - s)); d/du = g s.
struct SwigluBackwardOp {
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const {
    const float d = x[0], g = x[1], u = x[2];
    const float s = 1.0f / (1.0f + expf(-g));
    y[0] = d * u * s * (1.0f + g * (1.0f - s));
    y[1] = d * g * s;
  }
};

// gelu(g) * u with gelu's tanh approximation (torch's gelu(approximate="tanh")).
__device__ inline float gelu_tanh(float g, float* t_out = nullptr) {
  const float t = tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g));
  if (t_out != nullptr) *t_out = t;
  return 0.5f * g * (1.0f + t);
}

struct GegluOp {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = gelu_tanh(x[0]) * x[1]; }
};

// d/dg [gelu(g) u] = u (0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 a g^2)); d/du = gelu(g).
struct GegluBackwardOp {
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const {
    const float d = x[0], g = x[1], u = x[2];
    float t;
    const float gelu = gelu_tanh(g, &t);
    const float slope =
        0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * g * g);
    y[0] = d * u * slope;
    y[1] = d * gelu;
  }
};

// gpt-oss's clamped SwiGLU (kernels/glu.h).
struct ClampedSwigluOp {
  GluClamp clamp;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = clamped_swiglu(x[0], x[1], clamp); }
};

struct ClampedSwigluBackwardOp {
  GluClamp clamp;
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const {
    clamped_swiglu_backward(x[0], x[1], x[2], clamp, &y[0], &y[1]);
  }
};

template <typename T, int kIn, int kOut, typename Op>
void launch_map(const MapArgs<T, kIn, kOut>& args, int64_t n, Op op, cudaStream_t stream) {
  if (n == 0) return;
  bool vectorized = true;
  for (int a = 0; a < kIn; ++a) vectorized = vectorized && aligned16(args.in[a]);
  for (int b = 0; b < kOut; ++b) vectorized = vectorized && aligned16(args.out[b]);
  const int64_t items = vectorized ? (n + 7) / 8 : n;
  map_kernel<T, kIn, kOut, Op>
      <<<grid_for(items, kThreads), kThreads, 0, stream>>>(args, n, vectorized, op);
}

template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n, bool vectorized) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vectorized) {
    const int64_t packs = n / 8;
    for (int64_t p = tid; p < packs; p += stride) {
      float f[8];
      load8(src + p * 8, f);
      store8(dst + p * 8, f);
    }
    scalar_begin = packs * 8;
  }
  for (int64_t i = scalar_begin + tid; i < n; i += stride) dst[i] = from_f<D>(to_f(src[i]));
}

template <typename T, typename B>
__global__ void add_bias_kernel(T* y, int64_t ldy, const B* bias, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    T* p = y + r * ldy + c;
    *p = from_f<T>(to_f(*p) + to_f(bias[c]));
  }
}

template <typename T>
__global__ void dropout_kernel(const T* x, int64_t ldx, T* out, int64_t ldo, int64_t rows, int64_t cols, float p,
                               float scale, uint64_t seed, bool accumulate) {
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    const float v = dropout_keep(seed, static_cast<uint64_t>(i), p) ? to_f(x[r * ldx + c]) * scale : 0.0f;
    T* o = out + r * ldo + c;
    *o = from_f<T>(accumulate ? to_f(*o) + v : v);
  }
}

// Column sums. A block covers kColTile columns (two adjacent ones per lane,
// so a warp reads 64 consecutive elements of a row) and one split of the rows;
// its 8 warps take every 8th row. Partial sums combine in a fixed order.
constexpr int kColTile = 64;
constexpr int kColWarps = 8;

template <typename T>
__global__ void column_sum_kernel(const T* a, int64_t lda, const T* b, int64_t ldb,
                                  const float* row_scale, int64_t rows, int64_t cols,
                                  int64_t rows_per_split, float* partial, float* dst) {
  __shared__ float sums[kColWarps][kColTile];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + 2 * lane;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t r_end = min(rows, r_begin + rows_per_split);
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int64_t r = r_begin + warp; r < r_end; r += kColWarps) {
    const float s = row_scale != nullptr ? row_scale[r] : 1.0f;
    if (c < cols) {
      const float bv = b != nullptr ? to_f(b[r * ldb + c]) : 1.0f;
      acc0 += to_f(a[r * lda + c]) * bv * s;
    }
    if (c + 1 < cols) {
      const float bv = b != nullptr ? to_f(b[r * ldb + c + 1]) : 1.0f;
      acc1 += to_f(a[r * lda + c + 1]) * bv * s;
    }
  }
  sums[warp][2 * lane] = acc0;
  sums[warp][2 * lane + 1] = acc1;
  __syncthreads();
  if (threadIdx.x < kColTile) {
    const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
    float total = 0.0f;
    for (int w = 0; w < kColWarps; ++w) total += sums[w][threadIdx.x];
    if (col < cols) {
      if (gridDim.y == 1) {
        dst[col] += total;
      } else {
        partial[blockIdx.y * cols + col] = total;
      }
    }
  }
}

__global__ void column_sum_finish_kernel(const float* partial, int64_t splits, int64_t cols,
                                         float* dst) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float total = 0.0f;
  for (int64_t s = 0; s < splits; ++s) total += partial[s * cols + c];
  dst[c] += total;
}

// torch's float8_e4m3fn widened exactly (core/dtype.h's fp8_e4m3_to_float).
__device__ __forceinline__ float e4m3_to_f(unsigned int bits) {
  const unsigned int sign = (bits & 0x80u) << 24;
  const unsigned int exponent = (bits >> 3) & 0xfu, mantissa = bits & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
  if (exponent == 0) return __uint_as_float(sign | __float_as_uint(static_cast<float>(mantissa) * 0x1p-9f));
  return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

template <typename D>
__global__ void dequantize_fp8_blocks_kernel(const uint8_t* w, const float* scale_inv, int64_t rows, int64_t cols,
                                             int64_t block_rows, int64_t block_cols, int64_t grid_cols, D* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / cols, c = i - r * cols;
    // One product in fp32 (nothing to fuse), one rounding to D: the host's bits.
    out[i] = from_f<D>(__fmul_rn(e4m3_to_f(w[i]), scale_inv[(r / block_rows) * grid_cols + c / block_cols]));
  }
}

// e2m1 by its code (kernels/mxfp4_blocks.h's kFp4Values).
__constant__ float kFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

template <typename D>
__global__ void dequantize_mxfp4_blocks_kernel(const uint8_t* packed, const uint8_t* scales, int64_t n, D* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const unsigned int s = scales[i >> 5];
    // 2^(s - 127) as torch.ldexp gives it: 2^-127 subnormal for 0, inf for 255.
    const float scale = __uint_as_float(s == 0 ? 1u << 22 : s == 255 ? 0x7f800000u : s << 23);
    const unsigned int code = (packed[i >> 1] >> ((i & 1) * 4)) & 0xfu;
    out[i] = from_f<D>(__fmul_rn(kFp4[code], scale));
  }
}

}  // namespace

void launch_cast(Storage src_t, const void* src, Storage dst_t, void* dst, int64_t numel,
                 cudaStream_t stream) {
  if (numel == 0) return;
  const bool vectorized = aligned16(src) && aligned16(dst);
  const int64_t items = vectorized ? (numel + 7) / 8 : numel;
  STRATA_DISPATCH_2(src_t, S, dst_t, D,
                    cast_kernel<S, D><<<grid_for(items, kThreads), kThreads, 0, stream>>>(
                        static_cast<const S*>(src), static_cast<D*>(dst), numel, vectorized));
}

void launch_dequantize_fp8_blocks(const uint8_t* w, const float* scale_inv, int64_t rows, int64_t cols,
                                  int64_t block_rows, int64_t block_cols, Storage out_t, void* out,
                                  cudaStream_t stream) {
  if (rows * cols == 0) return;
  const int64_t grid_cols = (cols + block_cols - 1) / block_cols;
  STRATA_DISPATCH_T(out_t, D,
                    dequantize_fp8_blocks_kernel<D><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(
                        w, scale_inv, rows, cols, block_rows, block_cols, grid_cols, static_cast<D*>(out)));
}

void launch_dequantize_mxfp4_blocks(const uint8_t* packed, const uint8_t* scales, int64_t numel, Storage out_t,
                                    void* out, cudaStream_t stream) {
  if (numel == 0) return;
  STRATA_DISPATCH_T(out_t, D,
                    dequantize_mxfp4_blocks_kernel<D><<<grid_for(numel, kThreads), kThreads, 0, stream>>>(
                        packed, scales, numel, static_cast<D*>(out)));
}

void launch_add(Storage t, const void* a, const void* b, int64_t numel, void* out,
                cudaStream_t stream) {
  STRATA_DISPATCH_T(
      t, T,
      launch_map(MapArgs<T, 2, 1>{{static_cast<const T*>(a), static_cast<const T*>(b)},
                                  {static_cast<T*>(out)}},
                 numel, AddOp{}, stream));
}

void launch_swiglu_forward(Storage t, const void* gate, const void* up, int64_t numel, void* out,
                           GluActivation act, GluClamp clamp, cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T, {
    const MapArgs<T, 2, 1> args{{static_cast<const T*>(gate), static_cast<const T*>(up)}, {static_cast<T*>(out)}};
    if (act == GluActivation::kClampedSwiglu) {
      launch_map(args, numel, ClampedSwigluOp{clamp}, stream);
    } else if (act == GluActivation::kGeluTanh) {
      launch_map(args, numel, GegluOp{}, stream);
    } else {
      launch_map(args, numel, SwigluOp{}, stream);
    }
  });
}

void launch_swiglu_backward(Storage t, const void* dout, const void* gate, const void* up,
                            int64_t numel, void* dgate, void* dup, GluActivation act, GluClamp clamp,
                            cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T, {
    const MapArgs<T, 3, 2> args{
        {static_cast<const T*>(dout), static_cast<const T*>(gate), static_cast<const T*>(up)},
        {static_cast<T*>(dgate), static_cast<T*>(dup)}};
    if (act == GluActivation::kClampedSwiglu) {
      launch_map(args, numel, ClampedSwigluBackwardOp{clamp}, stream);
    } else if (act == GluActivation::kGeluTanh) {
      launch_map(args, numel, GegluBackwardOp{}, stream);
    } else {
      launch_map(args, numel, SwigluBackwardOp{}, stream);
    }
  });
}

void launch_add_bias(Storage t, void* y, int64_t ldy, Storage bias_t, const void* bias,
                     int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  STRATA_DISPATCH_2(t, T, bias_t, B,
                    add_bias_kernel<T, B><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(
                        static_cast<T*>(y), ldy, static_cast<const B*>(bias), rows, cols));
}

void launch_dropout(Storage t, const void* x, int64_t ldx, void* out, int64_t ldo, int64_t rows, int64_t cols,
                    float p, uint64_t seed, bool accumulate, cudaStream_t stream) {
  if (rows == 0) return;
  const float scale = 1.0f / (1.0f - p);
  STRATA_DISPATCH_T(t, T,
                    dropout_kernel<T><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(
                        static_cast<const T*>(x), ldx, static_cast<T*>(out), ldo, rows, cols, p, scale, seed,
                        accumulate));
}

int64_t column_sum_splits(int64_t rows, int64_t cols) {
  // Aim for ~1024 blocks (several waves on any current GPU) while giving each
  // split at least 64 rows, so the partial sums stay small next to the input.
  const int64_t col_blocks = (cols + kColTile - 1) / kColTile;
  int64_t splits = (1024 + col_blocks - 1) / col_blocks;
  const int64_t max_splits = (rows + 63) / 64;
  if (splits > max_splits) splits = max_splits;
  if (splits > 65535) splits = 65535;
  return splits < 1 ? 1 : splits;
}

void launch_column_sum(Storage t, const void* a, int64_t lda, const void* b, int64_t ldb,
                       const float* row_scale, int64_t rows, int64_t cols, int64_t splits,
                       float* partial, float* dst, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const int64_t rows_per_split = (rows + splits - 1) / splits;
  const dim3 grid(static_cast<unsigned>((cols + kColTile - 1) / kColTile),
                  static_cast<unsigned>(splits));
  STRATA_DISPATCH_T(t, T,
                    column_sum_kernel<T><<<grid, 32 * kColWarps, 0, stream>>>(
                        static_cast<const T*>(a), lda, static_cast<const T*>(b), ldb, row_scale,
                        rows, cols, rows_per_split, partial, dst));
  if (splits > 1) {
    column_sum_finish_kernel<<<grid_for(cols, kThreads), kThreads, 0, stream>>>(partial, splits,
                                                                                cols, dst);
  }
}

}  // namespace strata::ops::cuda
