// Internal to kernels/cuda: launchers of the nn_* CUDA kernels, called by
// nn_ops_cuda.cc after it has checked arguments. Launchers only enqueue work on
// `stream` and never throw; the caller checks cudaGetLastError(). `bf16`
// selects __nv_bfloat16 storage, else float.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace strata::nn::cuda::detail {

void launch_embedding_forward(bool bf16, const void* table, const int32_t* ids, int64_t rows,
                              int64_t vocab, int64_t dim, void* out, cudaStream_t stream);
void launch_embedding_backward(bool bf16, const void* dout, const int32_t* ids, int64_t rows,
                               int64_t vocab, int64_t dim, float* dtable, cudaStream_t stream);
void launch_rmsnorm_forward(bool bf16, const void* x, const void* w, int64_t rows, int64_t dim,
                            float eps, void* y, float* rstd, cudaStream_t stream);
void launch_rmsnorm_backward(bool bf16, const void* dy, const void* x, const void* w,
                             const float* rstd, int64_t rows, int64_t dim, void* dx, float* dw,
                             cudaStream_t stream);
void launch_rope(bool bf16, void* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, double theta, double sign, cudaStream_t stream);
void launch_attention_forward(bool bf16, const void* q, const void* k, const void* v, int64_t batch,
                              int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              void* out, float* lse, cudaStream_t stream);
// dk32/dv32: fp32 [batch, seq, kv_heads, head_dim], zeroed by the caller.
void launch_attention_backward(bool bf16, const void* dout, const void* q, const void* k,
                               const void* v, const void* out, const float* lse, int64_t batch,
                               int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                               void* dq, float* dk32, float* dv32, cudaStream_t stream);
void launch_swiglu_forward(bool bf16, const void* gate, const void* up, int64_t numel, void* out,
                           cudaStream_t stream);
void launch_swiglu_backward(bool bf16, const void* dout, const void* gate, const void* up,
                            int64_t numel, void* dgate, void* dup, cudaStream_t stream);
void launch_add(bool bf16, const void* a, const void* b, int64_t numel, void* out,
                cudaStream_t stream);
// y[r, c] += bias[c] for a [rows, cols] block with row stride ldy.
void launch_add_bias(bool bf16, void* y, int64_t ldy, const void* bias, int64_t rows, int64_t cols,
                     cudaStream_t stream);
// dbias[c] += sum_r dy[r, c].
void launch_bias_grad(bool bf16, const void* dy, int64_t ldy, int64_t rows, int64_t cols,
                      float* dbias, cudaStream_t stream);
void launch_cast_from_f32(bool bf16, const float* src, int64_t numel, void* dst,
                          cudaStream_t stream);
// Cross-entropy rows of fp32 logits [n, vocab]: lse and per-row loss.
void launch_ce_forward_rows(const float* logits, const int32_t* targets, int64_t n, int64_t vocab,
                            float* lse, float* loss, cudaStream_t stream);
// In: fp32 logits; out: (softmax - onehot) * scale in the storage type, 0 for ignored rows.
void launch_ce_backward_rows(bool bf16, const float* logits, const int32_t* targets,
                             const float* lse, int64_t n, int64_t vocab, float scale, void* grad,
                             cudaStream_t stream);

}  // namespace strata::nn::cuda::detail
