// CPU model operators of a Llama-style decoder (embedding, RMSNorm, Linear,
// rotary embedding, causal GQA attention, SwiGLU, residual add, chunked
// cross-entropy), each with an explicit forward and backward.
//
// Every operator is a template over the compute type T, instantiated for float
// (the production path) and double (the reference the finite-difference tests
// and the CUDA tests compare against). GEMMs go through cblas (OpenBLAS), the
// rest are loops parallelised with OpenMP. 16-bit storage is widened to T by
// the caller (strata::convert) before a call; the kernels compute in T.
//
// Layout: row-major; "rows" is the number of tokens (batch * seq). Pointers are
// host memory owned by the caller; outputs never alias inputs unless a function
// says "in place". Gradients of parameters (dw, dbias, dtable) are ACCUMULATED
// (+=) so that several micro-batches or tiles can add into one buffer; gradients
// of activations are overwritten unless an `accumulate` flag says otherwise.
// Thread-safety: functions are reentrant; concurrent calls must not share outputs.
// Errors: shape arguments are checked and raise strata::Error(kBadArgument);
// nothing else throws.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace strata::nn::cpu {

// ---- embedding: out[t, :] = table[ids[t], :] ---------------------------------
// ids out of [0, vocab) raise Error(kBadArgument) naming the position.
template <typename T>
void embedding_forward(const T* table /*[vocab, dim]*/, const int32_t* ids /*[rows]*/, int64_t rows,
                       int64_t vocab, int64_t dim, T* out /*[rows, dim]*/);
// Rows whose id is padding_idx add nothing (torch's padding_idx); < 0: none.
// A vocabulary shard (table_rows >= 0): dtable holds rows [first_id, first_id
// + table_rows) of the vocab rows, and the other ids add nothing to it.
template <typename T>
void embedding_backward(const T* dout /*[rows, dim]*/, const int32_t* ids, int64_t rows,
                        int64_t vocab, int64_t dim, T* dtable /*[vocab or table_rows, dim], +=*/,
                        int64_t padding_idx = -1, int64_t first_id = 0, int64_t table_rows = -1);

// ---- RMSNorm: y = x / sqrt(mean(x^2) + eps) * w ------------------------------
template <typename T>
void rmsnorm_forward(const T* x /*[rows, dim]*/, const T* w /*[dim]*/, int64_t rows, int64_t dim,
                     double eps, T* y /*[rows, dim]*/, T* rstd /*[rows], saved for backward*/);
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, int64_t rows, int64_t dim,
                      T* dx /*[rows, dim]*/, T* dw /*[dim], +=; null: not wanted*/);

// ---- Linear: y = scale * x W^T (+ b) -------------------------------------------
// W is [out, in] (the Hugging Face / PyTorch layout). ldx/ldy are row strides in
// elements (>= in / out), so a caller can address a column block of a wider
// matrix (TiledLinear). accumulate: y += ... instead of y = .... The bias is
// not scaled.
template <typename T>
void linear_forward(const T* x, int64_t ldx, const T* w /*[out, in]*/,
                    const T* bias /*[out] or null*/, int64_t rows, int64_t in, int64_t out, T* y,
                    int64_t ldy, bool accumulate, T scale = T(1));
// dx = scale * dy W (+= when accumulate_dx), dw += scale * dy^T x, dbias +=
// sum_rows dy. dx, dw and dbias may each be null (not needed).
template <typename T>
void linear_backward(const T* dy, int64_t ldy, const T* x, int64_t ldx, const T* w, int64_t rows,
                     int64_t in, int64_t out, T* dx, int64_t lddx, bool accumulate_dx, T* dw,
                     T* dbias, T scale = T(1));

// ---- rotary position embedding (Hugging Face "rotate_half" convention) ------
// In place on x [rows, heads, head_dim]: pairs (i, i + head_dim/2) are rotated by
// positions[row] * rope_inv_freq(rope, i, head_dim), angles in double, cos
// and sin times rope_attention_scale(rope).
// head_dim must be even.
using ops::Rope;
template <typename T>
void rope_forward(T* x, const int32_t* positions /*[rows]*/, int64_t rows, int64_t heads,
                  int64_t head_dim, const Rope& rope);
// The transpose (inverse rotation), in place on the gradient.
template <typename T>
void rope_backward(T* dx, const int32_t* positions, int64_t rows, int64_t heads, int64_t head_dim,
                   const Rope& rope);

// ---- causal self-attention with grouped-query heads -------------------------
using ops::AttentionMask;
using ops::AttentionShape;
// q/out: [batch, seq, heads, head_dim]; k/v: [batch, seq, kv_heads, head_dim];
// lse: [batch, heads, seq] (log-sum-exp of each softmax row, saved so backward
// recomputes probabilities instead of storing seq x seq of them). Scale 1/sqrt(head_dim).
// Query i sees keys [first_visible_key(mask, i), i] (attention_mask.h).
template <typename T>
void attention_forward(const T* q, const T* k, const T* v, const AttentionShape& shape, T* out,
                       T* lse, const AttentionMask& mask = {});
// dq, dk, dv are overwritten.
template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const AttentionShape& shape, T* dq, T* dk, T* dv,
                        const AttentionMask& mask = {});

// The attention sinks' gradient (mask.sinks, attention_mask.h): dsinks[h] +=
// -sum over batch and queries of exp(sinks[h] - lse) <dout, out>, from the
// forward's out and lse (which include the sinks).
template <typename T>
void attention_sinks_backward(const T* dout, const T* out, const T* lse, const AttentionShape& shape,
                              const float* sinks, T* dsinks);

// ---- SwiGLU: out = silu(gate) * up ------------------------------------------
template <typename T>
void swiglu_forward(const T* gate, const T* up, int64_t numel, T* out);
template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, int64_t numel, T* dgate, T* dup);

// ---- residual add: out = a + b (out may alias a or b). Backward is identity. ----
template <typename T>
void add(const T* a, const T* b, int64_t numel, T* out);

// ---- cross-entropy over the vocabulary, fused with the output projection ----
// logits = h W^T are formed chunk_rows rows at a time (chunk_rows x vocab scratch),
// so the full [rows, vocab] logits never exist. Targets equal to kIgnoreIndex
// contribute nothing. Targets outside [0, vocab) raise Error(kBadArgument).
using ops::kIgnoreIndex;
struct CrossEntropyShape {
  int64_t rows = 0, dim = 0, vocab = 0;
  int64_t chunk_rows = 256;
};
// Returns the SUM of per-row losses; lse [rows] is saved for backward.
template <typename T>
double cross_entropy_forward(const T* h /*[rows, dim]*/, const T* w /*[vocab, dim]*/,
                             const int32_t* targets /*[rows]*/, const CrossEntropyShape& shape,
                             T* lse);
// Gradient of (scale * sum of losses): dh is overwritten, dw accumulated (+=).
template <typename T>
void cross_entropy_backward(const T* h, const T* w, const int32_t* targets, const T* lse,
                            const CrossEntropyShape& shape, double scale, T* dh, T* dw);
// Number of targets that are not kIgnoreIndex.
int64_t count_targets(const int32_t* targets, int64_t rows);

}  // namespace strata::nn::cpu
