// Internal to kernels/cuda: the launchers of our CUDA kernels, called by
// ops_cuda.cc after it has checked every argument. A launcher only enqueues
// work on `stream`; it never synchronises and never throws. Launch errors are
// left for the caller's cudaGetLastError() (launchers that make other runtime
// calls return their status). Shapes are element counts; pointers are device
// memory. This header is plain C++ so that ops_cuda.cc (C++20, host compiler)
// and the .cu files (C++17, nvcc) share it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention_block_ranges.h"
#include "kernels/attention_mask.h"
#include "kernels/glu.h"
#include "kernels/moe_routing.h"
#include "kernels/rope_frequencies.h"

namespace strata::ops::cuda {

// The float storage types (strata::DType's fp32/fp16/bf16 without dtype.h,
// which is C++20 and not for nvcc).
enum class Storage : int { kF32, kF16, kBF16 };

// ---- elementwise.cu ---------------------------------------------------------
// dst = src converted (any storage types, numel elements).
void launch_cast(Storage src_t, const void* src, Storage dst_t, void* dst, int64_t numel,
                 cudaStream_t stream);
// out[i, j] = float(e4m3 w[i, j]) * scale_inv[i / block_rows, j / block_cols],
// rounded once to out_t (kernels/fp8_blocks.h); out [rows, cols], the grid
// ceil(rows / block_rows) x ceil(cols / block_cols).
void launch_dequantize_fp8_blocks(const uint8_t* w, const float* scale_inv, int64_t rows, int64_t cols,
                                  int64_t block_rows, int64_t block_cols, Storage out_t, void* out,
                                  cudaStream_t stream);
// out[i] (numel elements) = MXFP4's kept form (kernels/mxfp4_blocks.h): FP4
// code i (packed[i / 2]'s low nibble for even i, high for odd) times
// 2^(scales[i / 32] - 127) in fp32, rounded once to out_t.
void launch_dequantize_mxfp4_blocks(const uint8_t* packed, const uint8_t* scales, int64_t numel, Storage out_t,
                                    void* out, cudaStream_t stream);
// out = a + b (out may alias a or b).
void launch_add(Storage t, const void* a, const void* b, int64_t numel, void* out,
                cudaStream_t stream);
// act(gate) * up: silu, gelu's tanh approximation (GeGLU), or gpt-oss's
// clamped SwiGLU with `clamp` (kernels/glu.h).
void launch_swiglu_forward(Storage t, const void* gate, const void* up, int64_t numel, void* out,
                           GluActivation act, GluClamp clamp, cudaStream_t stream);
void launch_swiglu_backward(Storage t, const void* dout, const void* gate, const void* up,
                            int64_t numel, void* dgate, void* dup, GluActivation act, GluClamp clamp,
                            cudaStream_t stream);
// out (+= when accumulate) = x * keep / (1 - p), keep = dropout_keep(seed,
// r * cols + c, p) (kernels/dropout_mask.h); [rows, cols] with row strides.
void launch_dropout(Storage t, const void* x, int64_t ldx, void* out, int64_t ldo, int64_t rows, int64_t cols,
                    float p, uint64_t seed, bool accumulate, cudaStream_t stream);
// y[r, c] += bias[c] for a [rows, cols] block with row stride ldy.
void launch_add_bias(Storage t, void* y, int64_t ldy, Storage bias_t, const void* bias,
                     int64_t rows, int64_t cols, cudaStream_t stream);
// Deterministic column sums: dst[c] += sum_r a[r, c] * b[r, c] * row_scale[r]
// (b and row_scale may be null: factor 1). Rows are split into `splits`
// groups (column_sum_splits); with more than one, `partial` is fp32 scratch of
// splits * cols floats and a second kernel adds the groups in order.
int64_t column_sum_splits(int64_t rows, int64_t cols);
void launch_column_sum(Storage t, const void* a, int64_t lda, const void* b, int64_t ldb,
                       const float* row_scale, int64_t rows, int64_t cols, int64_t splits,
                       float* partial, float* dst, cudaStream_t stream);

// ---- embedding.cu -----------------------------------------------------------
// The table holds rows [first_id, first_id + vocab) (a vocabulary shard; 0 and
// the whole vocabulary otherwise): other ids read as zero rows and add no gradient.
// Each row times `scale` (1: copied), and the gradient likewise.
void launch_embedding_forward(Storage table_t, const void* table, const int32_t* ids, int64_t rows,
                              int64_t first_id, int64_t vocab, int64_t dim, Storage out_t, void* out,
                              float scale, cudaStream_t stream);
// Scratch for the deterministic backward (ids sorted with their rows).
size_t embedding_backward_scratch_nbytes(int64_t rows);
// Rows whose id is padding_idx add nothing (< 0: none).
cudaError_t launch_embedding_backward(Storage t, const void* dout, const int32_t* ids, int64_t rows,
                                      int64_t first_id, int64_t vocab, int64_t dim, int64_t padding_idx,
                                      float* dtable, void* scratch, size_t scratch_nbytes, float scale,
                                      cudaStream_t stream);

// ---- rmsnorm.cu -------------------------------------------------------------
// The weight is w + weight_offset (Gemma's 1 + w) in both.
void launch_rmsnorm_forward(Storage t, const void* x, Storage w_t, const void* w, int64_t rows,
                            int64_t dim, float eps, void* y, float* rstd, float weight_offset,
                            cudaStream_t stream);
// dx = rstd * (dy * w - x * rstd^2 * mean(dy * w * x)); added into dx when accumulate.
void launch_rmsnorm_backward_dx(Storage t, const void* dy, const void* x, Storage w_t,
                                const void* w, const float* rstd, int64_t rows, int64_t dim,
                                void* dx, bool accumulate, float weight_offset, cudaStream_t stream);

// ---- rope.cu ----------------------------------------------------------------
// In place on x [rows, heads, head_dim]; sign +1 rotates forward, -1 back.
void launch_rope(Storage t, void* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, const Rope& rope, double sign, cudaStream_t stream);

// ---- cross_entropy.cu -------------------------------------------------------
// For the n rows of an fp32 logits chunk [n, vocab]: lse[r] and loss[r] (0 for
// ignored rows). With grad non-null also grad [n, vocab] (storage grad_t; may
// alias logits when grad_t is fp32) = grad_scale / normalizer[0] *
// (softmax - onehot(target)), 0 on ignored rows; normalizer is read on the device.
// logit_softcap > 0: the logits are first capped in place to c * tanh(x / c)
// (Gemma 2), the gradient taken through the cap.
void launch_ce_rows(const float* logits, const int32_t* targets, int64_t n, int64_t vocab,
                    float* lse, float* loss, Storage grad_t, void* grad, const double* normalizer,
                    double grad_scale, float logit_softcap, cudaStream_t stream);
// stats[0] += sum of loss[0, rows) (in a fixed order), stats[1] += counted rows.
void launch_ce_stats(const float* loss, const int32_t* targets, int64_t rows, double* stats,
                     cudaStream_t stream);
// count[0] += number of targets that are not kIgnoreIndex.
void launch_count_targets(const int32_t* targets, int64_t rows, double* count, cudaStream_t stream);

// ---- vocab_parallel.cu ------------------------------------------------------
// Ops::vocab_parallel_parts on logits [n, shard] (storage t): parts fp32 [2, n].
void launch_vocab_parallel_parts(Storage t, const void* logits, const int32_t* targets, int64_t n, int64_t shard,
                                 int64_t first_id, float* parts, cudaStream_t stream);
// Ops::vocab_parallel_loss's rows: lse [n] and loss [n] (0 for ignored rows)
// from gathered [ranks, 2, n]; with normalizer non-null the logits are
// overwritten with the gradient. launch_ce_stats then adds loss to the stats.
void launch_vocab_parallel_loss(Storage t, void* logits, const float* gathered, int64_t ranks,
                                const int32_t* targets, int64_t n, int64_t shard, int64_t first_id, float* lse,
                                float* loss, const double* normalizer, double grad_scale, cudaStream_t stream);

// ---- adam.cu ----------------------------------------------------------------
// The per-step scalars of kernels::AdamCoefficients that the update reads
// (kernels/optimizer.h includes dtype.h, which is C++20 and not for nvcc);
// ops_cuda.cc copies them field by field.
struct AdamScalars {
  float beta1 = 0, beta2 = 0, one_minus_beta1 = 0, one_minus_beta2 = 0, eps = 0;
  float step_size = 0, inv_bias2_sqrt = 0, decay = 1, l2 = 0, grad_scale = 1;
};
// One Adam/AdamW update of numel elements in place on fp32 param, exp_avg and
// exp_avg_sq from the fp32 grad, operation for operation the update of
// kernels::adam_step's AVX2/AVX-512 kernels (so the bits are theirs). copy,
// unless null, receives the new param in storage copy_t (rounded to nearest
// even); it must not alias param.
void launch_adam_step(const AdamScalars& k, float* param, float* exp_avg, float* exp_avg_sq,
                      const float* grad, int64_t numel, Storage copy_t, void* copy,
                      cudaStream_t stream);
// Blocks of grad_sum_sq's first pass, a function of numel only (0 for 0): the
// fp64 partial sums it needs.
int64_t grad_sum_sq_blocks(int64_t numel);
// out[0] = sum over i of x*x, x = (double)(grad[i] * scale) (an fp32 product),
// OVERWRITTEN (0 for numel 0). Two passes in an order fixed by numel alone (not
// by alignment or the device), so equal inputs give equal bits; partial is fp64
// scratch of grad_sum_sq_blocks(numel) values.
void launch_grad_sum_sq(const float* grad, int64_t numel, float scale, double* partial, double* out,
                        cudaStream_t stream);

// ---- attention_*.cu ---------------------------------------------------------
// seq queries against kv_seq keys: one block (kv_seq == seq, offsets 0), or a
// query block against a key block of its own (context parallelism), placed in
// the whole sequence by mask.q_offset / mask.kv_offset (attention_mask.h).
struct AttentionDims {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  AttentionMask mask;  // which keys a query sees (attention_mask.h)
  int64_t kv_seq = 0;  // keys (and values) per row; 0: seq
  int64_t keys() const { return kv_seq > 0 ? kv_seq : seq; }
};
// The mask the kernels apply: the sliding window as 0 when it cannot bind
// (none, or at least as long as the farthest query is from the first key, so
// every causal key is in it), the segments (packed documents, device memory)
// as given, with their entries per row (the whole sequence's: seq for one block).
inline AttentionMask kernel_mask(const AttentionDims& d) {
  AttentionMask m = d.mask;
  if (!(m.window > 0 && m.window < m.q_offset + d.seq - m.kv_offset)) m.window = 0;
  m.seq = m.has_segments() ? m.seq : d.seq;
  return m;
}
// ---- attention_merge.cu ---------------------------------------------------------
// Ops::attention_merge: out fp32 [batch, seq, heads, head_dim] and lse fp32
// [batch, heads, seq] merged in place with part (part_t) and part_lse.
void launch_attention_merge(Storage part_t, float* out, float* lse, const void* part, const float* part_lse,
                            int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, cudaStream_t stream);
// The largest head_dim the attention kernels support.
inline constexpr int64_t kMaxAttentionHeadDim = 128;
// q, out [batch, seq, heads, head_dim]; k, v [batch, kv_seq, kv_heads, head_dim];
// lse fp32 [batch, heads, seq] (a row that sees no key: -inf, or its head's
// sink with mask.sinks). head_dim in [1, kMaxAttentionHeadDim].
cudaError_t launch_attention_forward(Storage t, const void* q, const void* k, const void* v,
                                     const AttentionDims& dims, void* out, float* lse,
                                     cudaStream_t stream);
// How the backward runs on the current device: the dK/dV head split and the
// device workspace it needs (delta, plus fp32 partial dK/dV when split).
struct AttentionBackwardPlan {
  int splits = 1;
  size_t workspace_nbytes = 0;
};
AttentionBackwardPlan plan_attention_backward(Storage t, const AttentionDims& dims);
cudaError_t launch_attention_backward(Storage t, const void* dout, const void* q, const void* k,
                                      const void* v, const void* out, const float* lse,
                                      const AttentionDims& dims, void* dq, void* dk, void* dv,
                                      const AttentionBackwardPlan& plan, void* workspace,
                                      cudaStream_t stream);

// Behind the two launchers above (attention_tc_*.cu: fp16/bf16 on tensor
// cores; attention_f32.cu: fp32 on CUDA cores).
cudaError_t attention_forward_tc(Storage t, const void* q, const void* k, const void* v,
                                 const AttentionDims& dims, void* out, float* lse,
                                 cudaStream_t stream);
// partial: fp32 [2][splits][batch, seq, kv_heads, head_dim] when splits > 1.
cudaError_t attention_backward_tc(Storage t, const void* dout, const void* q, const void* k,
                                  const void* v, const float* lse, const float* delta,
                                  const AttentionDims& dims, void* dq, void* dk, void* dv,
                                  float* partial, int splits, cudaStream_t stream);
// Query-head splits of the 16-bit dK/dV kernel for a device with sm_count SMs.
int attention_dkdv_splits(const AttentionDims& dims, int sm_count);
cudaError_t attention_forward_f32(const float* q, const float* k, const float* v,
                                  const AttentionDims& dims, float* out, float* lse,
                                  cudaStream_t stream);
cudaError_t attention_backward_f32(const float* dout, const float* q, const float* k,
                                   const float* v, const float* lse, const float* delta,
                                   const AttentionDims& dims, float* dq, float* dk, float* dv,
                                   cudaStream_t stream);
// delta[b, h, i] = sum_c dout[b, i, h, c] * out[b, i, h, c] (the softmax-backward row term).
void launch_attention_delta(Storage t, const void* dout, const void* out, const AttentionDims& dims,
                            float* delta, cudaStream_t stream);
// Ops::attention_sinks_backward: dsinks[h] -= sum over batch and queries of
// exp(sinks[h] - lse[b, h, i]) * sum_c dout[b, i, h, c] * out[b, i, h, c].
// One block per head, summed in a fixed order (bitwise repeatable).
void launch_attention_sinks_backward(Storage t, const void* dout, const void* out, const float* lse,
                                     const float* sinks, const AttentionDims& dims, float* dsinks,
                                     cudaStream_t stream);

// ---- moe.cu -------------------------------------------------------------------
// The moe_* ops of kernels/ops.h (shapes as there; pointers device memory;
// aux_stats, aux_grad and correction_bias may be null; router.groups at most
// kMaxMoeGroupWords * 64).
void launch_moe_route(Storage t, const void* logits, int64_t rows, int64_t experts, int64_t k,
                      const MoeRouter& router, const float* correction_bias, float* probs, int32_t* indices,
                      float* weights, int32_t* offsets, int32_t* slots, int32_t* tokens, double* aux_stats,
                      cudaStream_t stream);
void launch_moe_route_backward(const float* probs, const int32_t* indices, const float* weights,
                               const float* dweights, int64_t rows, int64_t experts, int64_t k,
                               const MoeRouter& router, const float* aux_grad, Storage t, void* dlogits,
                               cudaStream_t stream);
void launch_moe_gather(Storage t, const void* x, const int32_t* tokens, int64_t n, int64_t dim, void* xp,
                       cudaStream_t stream);
void launch_moe_gather_backward(Storage t, const void* dxp, const int32_t* slots, int64_t rows, int64_t k,
                                int64_t dim, bool accumulate, void* dx, cudaStream_t stream);
void launch_moe_combine(Storage t, const void* yp, const int32_t* slots, const float* weights, int64_t rows,
                        int64_t k, int64_t dim, void* y, cudaStream_t stream);
void launch_moe_combine_backward(Storage t, const void* dy, const void* yp, const int32_t* slots,
                                 const float* weights, int64_t rows, int64_t k, int64_t dim, void* dyp,
                                 float* dweights, cudaStream_t stream);
void launch_moe_aux_loss(const double* aux_stats, int64_t experts, double rows, double scale, double* aux,
                         float* aux_grad, cudaStream_t stream);
// sigmoid_gated_add and its backward (v, y, dy, dv [rows, dim]; gate, dgate [rows]; one storage t).
void launch_sigmoid_gated_add(Storage t, const void* v, const void* gate, int64_t rows, int64_t dim, void* y,
                              cudaStream_t stream);
void launch_sigmoid_gated_add_backward(Storage t, const void* dy, const void* v, const void* gate, int64_t rows,
                                       int64_t dim, void* dv, void* dgate, cudaStream_t stream);

}  // namespace strata::ops::cuda
