// Host side of the CUDA nn operators: argument checks, cuBLAS GEMMs (row-major
// through the column-major API), and the chunked cross-entropy orchestration.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/nn_launch.h"
#include "kernels/nn_cuda_ops.h"
#include "runtime/core/error.h"
#include "runtime/cuda/cuda_check.h"

namespace strata::nn::cuda {
namespace {

bool is_bf16(DType dtype, const char* op) {
  STRATA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, kBadArgument,
               "cuda {}: dtype {} is not supported (fp32 or bf16)", op, dtype_name(dtype));
  return dtype == DType::kBF16;
}

cudaStream_t stream_of(BlasContext& ctx) {
  return static_cast<cudaStream_t>(ctx.stream());
}
cublasHandle_t handle_of(BlasContext& ctx) {
  return static_cast<cublasHandle_t>(ctx.handle());
}

void check_launch(const char* op) {
  check_cuda(cudaGetLastError(), op);
}

cudaDataType_t cuda_type(DType dtype) {
  return dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// Row-major C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C. cuBLAS is column
// major, so compute C^T = op(B)^T op(A)^T with the operands swapped.
void gemm(BlasContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          const void* a, DType a_type, int64_t lda, const void* b, DType b_type, int64_t ldb,
          float beta, void* c, DType c_type, int64_t ldc) {
  const float alpha = 1.0f;
  STRATA_CUBLAS_CHECK(cublasGemmEx(
      handle_of(ctx), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, cuda_type(b_type),
      static_cast<int>(ldb), a, cuda_type(a_type), static_cast<int>(lda), &beta, c,
      cuda_type(c_type), static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// A stream-ordered temporary device buffer.
class Scratch {
 public:
  Scratch(size_t nbytes, cudaStream_t stream) : stream_(stream) {
    STRATA_CUDA_CHECK(cudaMallocAsync(&ptr_, std::max<size_t>(nbytes, 1), stream_));
  }
  ~Scratch() { cudaFreeAsync(ptr_, stream_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

BlasContext::BlasContext(void* stream) : stream_(stream) {
  cublasHandle_t h = nullptr;
  STRATA_CUBLAS_CHECK(cublasCreate(&h));
  handle_ = h;
  STRATA_CUBLAS_CHECK(cublasSetStream(h, static_cast<cudaStream_t>(stream)));
}

BlasContext::~BlasContext() {
  if (handle_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void embedding_forward(BlasContext& ctx, DType dtype, const void* table, const int32_t* ids,
                       int64_t rows, int64_t vocab, int64_t dim, void* out) {
  detail::launch_embedding_forward(is_bf16(dtype, "embedding"), table, ids, rows, vocab, dim, out,
                                   stream_of(ctx));
  check_launch("embedding forward");
}

void embedding_backward(BlasContext& ctx, DType dtype, const void* dout, const int32_t* ids,
                        int64_t rows, int64_t vocab, int64_t dim, float* dtable) {
  detail::launch_embedding_backward(is_bf16(dtype, "embedding"), dout, ids, rows, vocab, dim,
                                    dtable, stream_of(ctx));
  check_launch("embedding backward");
}

void rmsnorm_forward(BlasContext& ctx, DType dtype, const void* x, const void* w, int64_t rows,
                     int64_t dim, double eps, void* y, float* rstd) {
  detail::launch_rmsnorm_forward(is_bf16(dtype, "rmsnorm"), x, w, rows, dim,
                                 static_cast<float>(eps), y, rstd, stream_of(ctx));
  check_launch("rmsnorm forward");
}

void rmsnorm_backward(BlasContext& ctx, DType dtype, const void* dy, const void* x, const void* w,
                      const float* rstd, int64_t rows, int64_t dim, void* dx, float* dw) {
  detail::launch_rmsnorm_backward(is_bf16(dtype, "rmsnorm"), dy, x, w, rstd, rows, dim, dx, dw,
                                  stream_of(ctx));
  check_launch("rmsnorm backward");
}

void linear_forward(BlasContext& ctx, DType dtype, const void* x, int64_t ldx, const void* w,
                    const void* bias, int64_t rows, int64_t in, int64_t out, void* y, int64_t ldy,
                    bool accumulate) {
  const bool bf16 = is_bf16(dtype, "linear");
  STRATA_CHECK(rows >= 0 && in > 0 && out > 0 && ldx >= in && ldy >= out, kBadArgument,
               "cuda linear: bad shape rows={} in={} out={} ldx={} ldy={}", rows, in, out, ldx,
               ldy);
  if (rows == 0) return;
  gemm(ctx, false, true, rows, out, in, x, dtype, ldx, w, dtype, in, accumulate ? 1.0f : 0.0f, y,
       dtype, ldy);
  if (bias != nullptr) {
    detail::launch_add_bias(bf16, y, ldy, bias, rows, out, stream_of(ctx));
    check_launch("linear bias");
  }
}

void linear_backward(BlasContext& ctx, DType dtype, const void* dy, int64_t ldy, const void* x,
                     int64_t ldx, const void* w, int64_t rows, int64_t in, int64_t out, void* dx,
                     int64_t lddx, bool accumulate_dx, float* dw, float* dbias) {
  const bool bf16 = is_bf16(dtype, "linear");
  STRATA_CHECK(
      rows >= 0 && in > 0 && out > 0 && ldx >= in && ldy >= out && (dx == nullptr || lddx >= in),
      kBadArgument, "cuda linear backward: bad shape rows={} in={} out={}", rows, in, out);
  if (rows == 0) return;
  if (dx != nullptr) {
    gemm(ctx, false, false, rows, in, out, dy, dtype, ldy, w, dtype, in,
         accumulate_dx ? 1.0f : 0.0f, dx, dtype, lddx);
  }
  // Weight gradient straight into the fp32 accumulator (16-bit inputs, fp32 C).
  if (dw != nullptr)
    gemm(ctx, true, false, out, in, rows, dy, dtype, ldy, x, dtype, ldx, 1.0f, dw, DType::kF32, in);
  if (dbias != nullptr) {
    detail::launch_bias_grad(bf16, dy, ldy, rows, out, dbias, stream_of(ctx));
    check_launch("linear bias grad");
  }
}

void rope_forward(BlasContext& ctx, DType dtype, void* x, const int32_t* positions, int64_t rows,
                  int64_t heads, int64_t head_dim, double theta) {
  STRATA_CHECK(head_dim > 0 && head_dim % 2 == 0, kBadArgument,
               "cuda rope: head_dim {} must be even", head_dim);
  detail::launch_rope(is_bf16(dtype, "rope"), x, positions, rows, heads, head_dim, theta, 1.0,
                      stream_of(ctx));
  check_launch("rope forward");
}

void rope_backward(BlasContext& ctx, DType dtype, void* dx, const int32_t* positions, int64_t rows,
                   int64_t heads, int64_t head_dim, double theta) {
  STRATA_CHECK(head_dim > 0 && head_dim % 2 == 0, kBadArgument,
               "cuda rope: head_dim {} must be even", head_dim);
  detail::launch_rope(is_bf16(dtype, "rope"), dx, positions, rows, heads, head_dim, theta, -1.0,
                      stream_of(ctx));
  check_launch("rope backward");
}

namespace {

void check_attention(const cpu::AttentionShape& s) {
  STRATA_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0 &&
                   s.heads % s.kv_heads == 0 && s.batch <= 65535 && s.heads <= 65535,
               kBadArgument,
               "cuda attention: bad shape batch={} seq={} heads={} kv_heads={} head_dim={}",
               s.batch, s.seq, s.heads, s.kv_heads, s.head_dim);
  // Backward keeps 2 * (head_dim + seq) floats of one row in dynamic shared
  // memory, next to a 32-float static reduction scratch; without an opt-in the
  // two together must fit in 48 KiB, so head_dim + seq <= 6128.
  constexpr int64_t kSharedNbytes = 48 * 1024, kStaticNbytes = 32 * 4;
  STRATA_CHECK(2 * (s.head_dim + s.seq) * 4 + kStaticNbytes <= kSharedNbytes, kBadArgument,
               "cuda attention: seq {} + head_dim {} exceeds the {} this kernel supports", s.seq,
               s.head_dim, (kSharedNbytes - kStaticNbytes) / 8);
}

}  // namespace

void attention_forward(BlasContext& ctx, DType dtype, const void* q, const void* k, const void* v,
                       const cpu::AttentionShape& s, void* out, float* lse) {
  const bool bf16 = is_bf16(dtype, "attention");
  check_attention(s);
  detail::launch_attention_forward(bf16, q, k, v, s.batch, s.seq, s.heads, s.kv_heads, s.head_dim,
                                   out, lse, stream_of(ctx));
  check_launch("attention forward");
}

void attention_backward(BlasContext& ctx, DType dtype, const void* dout, const void* q,
                        const void* k, const void* v, const void* out, const float* lse,
                        const cpu::AttentionShape& s, void* dq, void* dk, void* dv) {
  const bool bf16 = is_bf16(dtype, "attention");
  check_attention(s);
  const int64_t kv_numel = s.batch * s.seq * s.kv_heads * s.head_dim;
  const cudaStream_t stream = stream_of(ctx);
  // dk/dv collect contributions of every query head of a group and every later
  // query row, so they accumulate in fp32 and are cast once at the end.
  Scratch dk32(static_cast<size_t>(kv_numel) * sizeof(float), stream);
  Scratch dv32(static_cast<size_t>(kv_numel) * sizeof(float), stream);
  STRATA_CUDA_CHECK(
      cudaMemsetAsync(dk32.as<void>(), 0, static_cast<size_t>(kv_numel) * sizeof(float), stream));
  STRATA_CUDA_CHECK(
      cudaMemsetAsync(dv32.as<void>(), 0, static_cast<size_t>(kv_numel) * sizeof(float), stream));
  detail::launch_attention_backward(bf16, dout, q, k, v, out, lse, s.batch, s.seq, s.heads,
                                    s.kv_heads, s.head_dim, dq, dk32.as<float>(), dv32.as<float>(),
                                    stream);
  check_launch("attention backward");
  detail::launch_cast_from_f32(bf16, dk32.as<float>(), kv_numel, dk, stream);
  detail::launch_cast_from_f32(bf16, dv32.as<float>(), kv_numel, dv, stream);
  check_launch("attention backward cast");
}

void swiglu_forward(BlasContext& ctx, DType dtype, const void* gate, const void* up, int64_t numel,
                    void* out) {
  detail::launch_swiglu_forward(is_bf16(dtype, "swiglu"), gate, up, numel, out, stream_of(ctx));
  check_launch("swiglu forward");
}

void swiglu_backward(BlasContext& ctx, DType dtype, const void* dout, const void* gate,
                     const void* up, int64_t numel, void* dgate, void* dup) {
  detail::launch_swiglu_backward(is_bf16(dtype, "swiglu"), dout, gate, up, numel, dgate, dup,
                                 stream_of(ctx));
  check_launch("swiglu backward");
}

void add(BlasContext& ctx, DType dtype, const void* a, const void* b, int64_t numel, void* out) {
  detail::launch_add(is_bf16(dtype, "add"), a, b, numel, out, stream_of(ctx));
  check_launch("add");
}

namespace {

void check_ce(const cpu::CrossEntropyShape& s) {
  STRATA_CHECK(s.rows >= 0 && s.dim > 0 && s.vocab > 0 && s.chunk_rows > 0, kBadArgument,
               "cuda cross_entropy: bad shape rows={} dim={} vocab={} chunk_rows={}", s.rows, s.dim,
               s.vocab, s.chunk_rows);
}

}  // namespace

double cross_entropy_forward(BlasContext& ctx, DType dtype, const void* h, const void* w,
                             const int32_t* targets, const cpu::CrossEntropyShape& s, float* lse) {
  is_bf16(dtype, "cross_entropy");
  check_ce(s);
  if (s.rows == 0) return 0.0;
  const cudaStream_t stream = stream_of(ctx);
  const int64_t chunk = std::min(s.chunk_rows, s.rows);
  const size_t elem = dtype_nbytes(dtype);
  Scratch logits(static_cast<size_t>(chunk * s.vocab) * sizeof(float), stream);
  Scratch loss(static_cast<size_t>(s.rows) * sizeof(float), stream);
  for (int64_t r0 = 0; r0 < s.rows; r0 += chunk) {
    const int64_t n = std::min(chunk, s.rows - r0);
    gemm(ctx, false, true, n, s.vocab, s.dim, static_cast<const char*>(h) + r0 * s.dim * elem,
         dtype, s.dim, w, dtype, s.dim, 0.0f, logits.as<void>(), DType::kF32, s.vocab);
    detail::launch_ce_forward_rows(logits.as<float>(), targets + r0, n, s.vocab, lse + r0,
                                   loss.as<float>() + r0, stream);
    check_launch("cross_entropy forward");
  }
  std::vector<float> host(static_cast<size_t>(s.rows));
  STRATA_CUDA_CHECK(cudaMemcpyAsync(host.data(), loss.as<float>(), host.size() * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(stream));
  double total = 0;
  for (float v : host) total += v;
  return total;
}

void cross_entropy_backward(BlasContext& ctx, DType dtype, const void* h, const void* w,
                            const int32_t* targets, const float* lse,
                            const cpu::CrossEntropyShape& s, double scale, void* dh, float* dw) {
  const bool bf16 = is_bf16(dtype, "cross_entropy");
  check_ce(s);
  if (s.rows == 0) return;
  const cudaStream_t stream = stream_of(ctx);
  const int64_t chunk = std::min(s.chunk_rows, s.rows);
  const size_t elem = dtype_nbytes(dtype);
  Scratch logits(static_cast<size_t>(chunk * s.vocab) * sizeof(float), stream);
  Scratch grad(static_cast<size_t>(chunk * s.vocab) * elem, stream);
  for (int64_t r0 = 0; r0 < s.rows; r0 += chunk) {
    const int64_t n = std::min(chunk, s.rows - r0);
    const void* hc = static_cast<const char*>(h) + r0 * s.dim * elem;
    gemm(ctx, false, true, n, s.vocab, s.dim, hc, dtype, s.dim, w, dtype, s.dim, 0.0f,
         logits.as<void>(), DType::kF32, s.vocab);
    detail::launch_ce_backward_rows(bf16, logits.as<float>(), targets + r0, lse + r0, n, s.vocab,
                                    static_cast<float>(scale), grad.as<void>(), stream);
    check_launch("cross_entropy backward");
    gemm(ctx, false, false, n, s.dim, s.vocab, grad.as<void>(), dtype, s.vocab, w, dtype, s.dim,
         0.0f, static_cast<char*>(dh) + r0 * s.dim * elem, dtype, s.dim);
    gemm(ctx, true, false, s.vocab, s.dim, n, grad.as<void>(), dtype, s.vocab, hc, dtype, s.dim,
         1.0f, dw, DType::kF32, s.dim);
  }
}

}  // namespace strata::nn::cuda
