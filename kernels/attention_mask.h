// Which keys each query of causal self-attention sees: the one description of
// the mask that every attention kernel (the cpu reference and blocked kernels,
// the cuda flash kernels, forward and backward) asks, so that a new kind of
// mask is added here and in no kernel's conditionals.
//
// Causal always: query i sees keys j <= i. On top of that the visible keys of
// a query are one contiguous range [first_visible_key(i), i], and the queries
// that see a key j one contiguous range [j, last_seeing_query(j)]; a kernel
// skips whole tiles outside those ranges and masks elementwise inside.
//  - window > 0 (sliding-window attention, transformers' sliding_window: a key
//    is visible iff kv_idx > q_idx - window): query i sees keys
//    (i - window, i], its `window` most recent tokens, itself included.
//  - segments (packed documents: several documents in one row, positions
//    restarting at each): query i sees only keys of its own document,
//    [segment_start[i], i] — a block-diagonal causal mask, what transformers
//    computes when it is fed the documents one by one. The arrays hold, for
//    each position of the batch ([batch * seq], row-major), the first position
//    of its document in its row and one past its last; both are non-decreasing
//    along a row, so the visible ranges stay contiguous and monotone and the
//    kernels' tile skipping holds unchanged. They live where the kernels read
//    (device memory for cuda). A kernel takes row(b * seq) for row b.
//  - q_offset, kv_offset (a block of queries against a block of keys, context
//    parallelism): the first query's and the first key's positions in the
//    whole sequence, where the rules above are evaluated (the segment arrays
//    then cover the whole sequence: `seq` entries per row). Query i of the
//    block sees key j of the key block iff is_visible(q_offset + i,
//    kv_offset + j); a query that sees no key of the block gets out 0 and
//    lse -inf (visible_block_keys gives it an empty range). Both 0: one block, today's attention.
//  - sinks (gpt-oss's attention sinks; not a mask either, but how every
//    softmax row is normalised): one learned logit per query head that joins
//    each row's softmax denominator and attends to no value, p_j = exp(s_j) /
//    (sum_k exp(s_k) + exp(sink_h)); lse includes it (a row that sees no key
//    gets lse = sink). Backward is unchanged given that lse (p = exp(s - lse)),
//    and the sinks' own gradient is Ops::attention_sinks_backward.
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: a value type.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata::ops {

struct AttentionMask {
  int64_t window = 0;  // 0: no sliding window (plain causal)
  // Packed documents; null: one document per row. int32 [batch * seq] each,
  // read when the op runs: like its views, valid until its stream has run it.
  const int32_t* segment_start = nullptr;
  const int32_t* segment_end = nullptr;
  int64_t seq = 0;  // entries per row of the segment arrays
  // Global positions of the query block's and the key block's first token.
  int64_t q_offset = 0, kv_offset = 0;
  // How a visible key is scored (not the mask proper, but every kernel that
  // asks the mask scores with it): the score q.k times `scale` (0: 1 /
  // sqrt(head_dim); Gemma's query_pre_attn_scalar^-1/2; DeepSeek's multi-head
  // latent attention under YaRN qk_head_dim^-0.5 * mscale^2), then with
  // softcap > 0 capped to softcap * tanh(score / softcap) before the softmax
  // (Gemma 2's attn_logit_softcapping; its backward multiplies the score's
  // gradient by 1 - tanh^2). attention_scale() and attention_score() are the formulas.
  double scale = 0;
  float softcap = 0;
  // Attention sinks: fp32 [heads] where the kernels read (device memory for
  // cuda); null: none. Only with one block (both offsets 0, keys = queries).
  const float* sinks = nullptr;

  STRATA_HOST_DEVICE bool has_segments() const { return segment_start != nullptr; }
  // The mask of the row whose first position is `offset` (b * seq) in the arrays.
  STRATA_HOST_DEVICE AttentionMask row(int64_t offset) const {
    AttentionMask m = *this;
    if (segment_start != nullptr) {
      m.segment_start += offset;
      m.segment_end += offset;
    }
    return m;
  }
  // A position's entry; positions past the row (a kernel's tile padding) read
  // the last one, whose range is as wide as any in the row.
  STRATA_HOST_DEVICE int64_t entry(int64_t i) const { return i < seq ? i : seq - 1; }
};

// A scaled score after the soft cap (the score itself without one).
STRATA_HOST_DEVICE inline float attention_score(const AttentionMask& mask, float scaled) {
  return mask.softcap > 0 ? mask.softcap * tanhf(scaled / mask.softcap) : scaled;
}

// d capped / d scaled for a capped score (1 without a cap).
STRATA_HOST_DEVICE inline float attention_score_slope(const AttentionMask& mask, float capped) {
  if (mask.softcap <= 0) return 1.0f;
  const float t = capped / mask.softcap;
  return 1.0f - t * t;
}

// The first key query `query` sees (keys [first, query] are visible).
STRATA_HOST_DEVICE inline int64_t first_visible_key(const AttentionMask& mask, int64_t query) {
  int64_t first = mask.window <= 0 ? 0 : query - mask.window + 1;
  if (mask.segment_start != nullptr) {
    const int64_t start = mask.segment_start[mask.entry(query)];
    if (start > first) first = start;
  }
  return first > 0 ? first : 0;
}

// The last query that sees key `key` (queries [key, last] see it), before
// clipping to the sequence: a caller takes min(last, seq - 1).
STRATA_HOST_DEVICE inline int64_t last_seeing_query(const AttentionMask& mask, int64_t key) {
  int64_t last = mask.window <= 0 ? INT64_MAX : key + mask.window - 1;
  if (mask.segment_end != nullptr) {
    const int64_t end = static_cast<int64_t>(mask.segment_end[mask.entry(key)]) - 1;
    if (end < last) last = end;
  }
  return last;
}

// The scale of the scores q.k of a head_dim-wide head under `mask`.
STRATA_HOST_DEVICE inline double attention_scale(const AttentionMask& mask, int64_t head_dim) {
  return mask.scale > 0 ? mask.scale : 1.0 / sqrt(static_cast<double>(head_dim));
}

STRATA_HOST_DEVICE inline bool is_visible(const AttentionMask& mask, int64_t query, int64_t key) {
  return key <= query && key >= first_visible_key(mask, query);
}

// The keys of a key block of kv_seq tokens that query `query` of the query
// block sees (both block-local): [first, last) in the key block, empty when
// first >= last. With both offsets 0: [first_visible_key(query), query + 1).
struct BlockRange {
  int64_t first, last;
};
STRATA_HOST_DEVICE inline BlockRange visible_block_keys(const AttentionMask& mask, int64_t query,
                                                        int64_t kv_seq) {
  const int64_t global = mask.q_offset + query;
  int64_t first = first_visible_key(mask, global) - mask.kv_offset;
  int64_t last = global + 1 - mask.kv_offset;
  first = first < 0 ? 0 : (first > kv_seq ? kv_seq : first);
  if (last > kv_seq) last = kv_seq;
  return {first, last > first ? last : first};  // both within [0, kv_seq], monotone in query
}

// Whether any query of [q_offset, q_offset + seq) can see a key of
// [kv_offset, kv_offset + kv_seq) by causality and the window (documents are
// not consulted: their arrays may live in device memory). A caller skips a
// block pair for which this is false; its rows would all be empty.
STRATA_HOST_DEVICE inline bool block_has_visible(const AttentionMask& mask, int64_t seq, int64_t kv_seq) {
  const int64_t q_last = mask.q_offset + seq - 1;
  if (mask.kv_offset > q_last) return false;  // every key after every query
  const int64_t lowest = mask.window <= 0 ? 0 : mask.q_offset - mask.window + 1;
  return mask.kv_offset + kv_seq - 1 >= lowest;
}

}  // namespace strata::ops
