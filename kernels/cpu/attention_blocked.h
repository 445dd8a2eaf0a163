// Blocked, GEMM-based causal GQA attention in fp32 for the cpu ops
// (attention_blocked.cc explains the blocking). Same contract as the reference
// templates nn::cpu::attention_forward / attention_backward (kernels/nn_ops.h):
// q/out [batch, seq, heads, head_dim], k/v [batch, seq, kv_heads, head_dim],
// lse [batch, heads, seq]; dq, dk, dv overwritten; query i sees keys
// [first_visible_key(mask, i), i]. Internal to kernels/cpu.
#pragma once

#include "kernels/ops.h"

namespace strata::ops::cpu {

void attention_forward(const float* q, const float* k, const float* v, const AttentionShape& s,
                       const AttentionMask& mask, float* out, float* lse);
void attention_backward(const float* dout, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const AttentionShape& s,
                        const AttentionMask& mask, float* dq, float* dk, float* dv);

// Ops::attention_merge: out [batch, seq, heads, head_dim] and lse [batch,
// heads, seq] merged in place with a block's part and part_lse.
void attention_merge(const AttentionShape& s, float* out, float* lse, const float* part,
                     const float* part_lse);

}  // namespace strata::ops::cpu
