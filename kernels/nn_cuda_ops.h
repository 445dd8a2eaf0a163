// CUDA model operators, mirroring kernels/nn_ops.h: GEMMs through cuBLAS
// (cublasGemmEx, fp32 compute), everything else our own kernels. Activations
// and parameters are fp32 or bf16 in device memory (`dtype`); all statistics
// and reductions accumulate in fp32, and parameter gradients are fp32
// accumulators (+=). Only present in CUDA builds (STRATA_HAVE_CUDA); this
// header itself needs no CUDA headers.
//
// Pointers are device memory owned by the caller. Work is enqueued on the
// BlasContext's stream and is asynchronous unless a function says otherwise;
// temporary buffers use stream-ordered allocation (cudaMallocAsync).
// Thread-safety: a BlasContext must be used by one thread at a time.
// Errors: strata::Error(kBadArgument) for shapes and unsupported dtypes (fp16
// is not supported here), Error(kCuda) for CUDA / cuBLAS failures. Token ids and
// targets are NOT range-checked on the device (checking would need a host
// round trip): out-of-range ids read as zero rows; callers validate on the host.
#pragma once

#include <cstdint>

#include "kernels/nn_ops.h"
#include "runtime/core/dtype.h"

namespace strata::nn::cuda {

// Owns a cuBLAS handle bound to one CUDA stream. Move-only.
class BlasContext {
 public:
  // `stream` is a cudaStream_t (nullptr: the legacy default stream).
  explicit BlasContext(void* stream);
  ~BlasContext();
  BlasContext(const BlasContext&) = delete;
  BlasContext& operator=(const BlasContext&) = delete;
  void* stream() const { return stream_; }
  void* handle() const { return handle_; }  // cublasHandle_t

 private:
  void* stream_;
  void* handle_ = nullptr;
};

void embedding_forward(BlasContext& ctx, DType dtype, const void* table, const int32_t* ids,
                       int64_t rows, int64_t vocab, int64_t dim, void* out);
void embedding_backward(BlasContext& ctx, DType dtype, const void* dout, const int32_t* ids,
                        int64_t rows, int64_t vocab, int64_t dim, float* dtable /*+=*/);

void rmsnorm_forward(BlasContext& ctx, DType dtype, const void* x, const void* w, int64_t rows,
                     int64_t dim, double eps, void* y, float* rstd);
void rmsnorm_backward(BlasContext& ctx, DType dtype, const void* dy, const void* x, const void* w,
                      const float* rstd, int64_t rows, int64_t dim, void* dx, float* dw /*+=*/);

void linear_forward(BlasContext& ctx, DType dtype, const void* x, int64_t ldx, const void* w,
                    const void* bias, int64_t rows, int64_t in, int64_t out, void* y, int64_t ldy,
                    bool accumulate);
void linear_backward(BlasContext& ctx, DType dtype, const void* dy, int64_t ldy, const void* x,
                     int64_t ldx, const void* w, int64_t rows, int64_t in, int64_t out, void* dx,
                     int64_t lddx, bool accumulate_dx, float* dw /*+=*/, float* dbias /*+=*/);

void rope_forward(BlasContext& ctx, DType dtype, void* x, const int32_t* positions, int64_t rows,
                  int64_t heads, int64_t head_dim, double theta);
void rope_backward(BlasContext& ctx, DType dtype, void* dx, const int32_t* positions, int64_t rows,
                   int64_t heads, int64_t head_dim, double theta);

// lse is fp32 [batch, heads, seq]. One row lives in shared memory, so
// seq + head_dim <= 6128 (seq <= 6000 at head_dim 128); larger shapes throw
// Error(kBadArgument).
void attention_forward(BlasContext& ctx, DType dtype, const void* q, const void* k, const void* v,
                       const cpu::AttentionShape& shape, void* out, float* lse);
void attention_backward(BlasContext& ctx, DType dtype, const void* dout, const void* q,
                        const void* k, const void* v, const void* out, const float* lse,
                        const cpu::AttentionShape& shape, void* dq, void* dk, void* dv);

void swiglu_forward(BlasContext& ctx, DType dtype, const void* gate, const void* up, int64_t numel,
                    void* out);
void swiglu_backward(BlasContext& ctx, DType dtype, const void* dout, const void* gate,
                     const void* up, int64_t numel, void* dgate, void* dup);

void add(BlasContext& ctx, DType dtype, const void* a, const void* b, int64_t numel, void* out);

// Chunked cross-entropy fused with the output projection (see nn_ops.h).
// Forward synchronizes the stream to return the summed loss; lse is fp32 [rows].
double cross_entropy_forward(BlasContext& ctx, DType dtype, const void* h, const void* w,
                             const int32_t* targets, const cpu::CrossEntropyShape& shape,
                             float* lse);
void cross_entropy_backward(BlasContext& ctx, DType dtype, const void* h, const void* w,
                            const int32_t* targets, const float* lse,
                            const cpu::CrossEntropyShape& shape, double scale, void* dh,
                            float* dw /*+=*/);

}  // namespace strata::nn::cuda
