// Causal GQA attention for the cpu ops, blocked over query rows so that the
// work is GEMMs (OpenBLAS) plus vectorised softmax rows. For a block of kBq
// query rows [i0, i1) of one head, only keys [j0, i1) can be seen, j0 the
// first key its first row sees (0 without a sliding window; attention_mask.h):
//   forward:  S = Q_blk K^T * scale  ([kBq, i1 - j0], scratch), P = softmax
//             rows (each over its own visible keys), O_blk = P V, lse saved;
//   backward: P recomputed from lse, dP = dO_blk V^T, dS = P (dP - delta) scale,
//             dQ_blk = dS K, dK += dS^T Q_blk, dV += P^T dO_blk.
// With Gemma's soft cap (mask.softcap) each visible score is capped before
// the softmax, and backward recomputes the cap's slope 1 - tanh^2 into one
// more kBq x seq scratch to multiply dS by.
// Scratch is kBq x seq per thread (not per head), so no [seq, seq] matrix is
// ever held. A key block of its own (context parallelism) works the same with
// key indices shifted by the offsets (ops::visible_block_keys); a row that
// sees none of its keys gets out 0 and lse -inf, a query block that sees none
// skips its products. The nn_ops.h templates stay the reference this is checked against.
//
// Parallelism: forward tasks are (batch, head, query block) — independent. In
// backward every query head of a group adds into the same dK/dV rows, so a task
// is one (batch, kv head). When there are fewer tasks than threads, the tasks
// run one after another and the GEMMs use the whole OpenMP team instead.
#include "kernels/cpu/attention_blocked.h"

#include "kernels/attention_merge.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/cpu/vec_math.h"

namespace strata::ops::cpu {
namespace {

using nn::cpu::detail::gemm;

constexpr int64_t kBq = 64;  // query rows per block

struct Strides {
  int64_t q_row, kv_row;  // elements between consecutive tokens
  int64_t d, group;
  float scale;
};

Strides strides_of(const AttentionShape& s, const AttentionMask& mask) {
  return {s.heads * s.head_dim, s.kv_heads * s.head_dim, s.head_dim, s.heads / s.kv_heads,
          static_cast<float>(ops::attention_scale(mask, s.head_dim))};
}

// Gemma 2's soft cap on the visible scores [lo, hi) of a row, in place;
// with `slope` also 1 - tanh^2 of each (the cap's derivative, for backward).
void cap_scores(const AttentionMask& mask, float* row, int64_t lo, int64_t hi, float* slope = nullptr) {
  if (mask.softcap <= 0) return;
  for (int64_t j = lo; j < hi; ++j) {
    row[j] = attention_score(mask, row[j]);
    if (slope != nullptr) slope[j] = attention_score_slope(mask, row[j]);
  }
}

// The keys a block of query rows [i0, i1) needs: [j0, j0 + width), j0 the
// first key its first row sees (later rows see no earlier key), the last one
// its last row sees; row r's own keys are columns [lo, hi) of a [n, width]
// score block (lo == hi == 0 for a row that sees none). width <= 0: no row
// sees a key.
struct BlockKeys {
  int64_t j0, width, kv_seq;
  BlockRange cols(const AttentionMask& m, int64_t i0, int64_t r) const {
    const BlockRange k = visible_block_keys(m, i0 + r, kv_seq);
    return k.first < k.last ? BlockRange{k.first - j0, k.last - j0} : BlockRange{0, 0};
  }
};

BlockKeys keys_of_block(const AttentionMask& mask, int64_t i0, int64_t i1, int64_t kv_seq) {
  const int64_t j0 = visible_block_keys(mask, i0, kv_seq).first;
  return {j0, visible_block_keys(mask, i1 - 1, kv_seq).last - j0, kv_seq};
}

// Softmax rows of block scores sc [n, width] in place, each over its visible
// columns; writes lse; zeroes the masked columns of each row.
void softmax_block(float* sc, int64_t n, int64_t i0, const BlockKeys& bk, const AttentionMask& mask,
                   float* lse_out) {
  for (int64_t r = 0; r < n; ++r) {
    float* row = sc + r * bk.width;
    const auto [lo, hi] = bk.cols(mask, i0, r);
    if (lo == hi) {  // sees no key of the block
      std::fill(row, row + bk.width, 0.0f);
      lse_out[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    cap_scores(mask, row, lo, hi);
    const float m = vec::max(row + lo, hi - lo);
    const double sum = vec::exp_shifted(row + lo, hi - lo, m, row + lo);
    vec::scale(row + lo, hi - lo, static_cast<float>(1.0 / sum));
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi, row + bk.width, 0.0f);
    lse_out[r] = m + static_cast<float>(std::log(sum));
  }
}

void forward_block(const float* q, const float* k, const float* v, const AttentionShape& s,
                   const AttentionMask& batch_mask, const Strides& st, int64_t b, int64_t h, int64_t i0,
                   float* out, float* lse, float* sc) {
  const AttentionMask mask = batch_mask.row(b * batch_mask.seq);
  const int64_t i1 = std::min(i0 + kBq, s.seq), n = i1 - i0, kh = h / st.group, kv = s.keys();
  const BlockKeys bk = keys_of_block(mask, i0, i1, kv);
  if (bk.width <= 0) {  // no row sees a key of the block
    for (int64_t r = 0; r < n; ++r) {
      std::fill_n(out + (b * s.seq + i0 + r) * st.q_row + h * st.d, st.d, 0.0f);
      lse[(b * s.heads + h) * s.seq + i0 + r] = -std::numeric_limits<float>::infinity();
    }
    return;
  }
  const float* qb = q + (b * s.seq + i0) * st.q_row + h * st.d;
  const float* kb = k + (b * kv + bk.j0) * st.kv_row + kh * st.d;
  const float* vb = v + (b * kv + bk.j0) * st.kv_row + kh * st.d;
  gemm<float>(false, true, n, bk.width, st.d, st.scale, qb, st.q_row, kb, st.kv_row, 0.0f, sc,
              bk.width);
  softmax_block(sc, n, i0, bk, mask, lse + (b * s.heads + h) * s.seq + i0);
  gemm<float>(false, false, n, st.d, bk.width, 1.0f, sc, bk.width, vb, st.kv_row, 0.0f,
              out + (b * s.seq + i0) * st.q_row + h * st.d, st.q_row);
}

// One (batch, kv head): every query head of its group, every query block.
void backward_task(const float* dout, const float* q, const float* k, const float* v,
                   const float* out, const float* lse, const AttentionShape& s,
                   const AttentionMask& batch_mask, const Strides& st, int64_t b, int64_t kh, float* dq,
                   float* dk, float* dv, float* p, float* dp, float* slope) {
  const AttentionMask mask = batch_mask.row(b * batch_mask.seq);
  const int64_t kv = s.keys();
  const float* kb = k + b * kv * st.kv_row + kh * st.d;
  const float* vb = v + b * kv * st.kv_row + kh * st.d;
  float* dkb = dk + b * kv * st.kv_row + kh * st.d;
  float* dvb = dv + b * kv * st.kv_row + kh * st.d;
  for (int64_t j = 0; j < kv; ++j) {
    std::fill_n(dkb + j * st.kv_row, st.d, 0.0f);
    std::fill_n(dvb + j * st.kv_row, st.d, 0.0f);
  }
  for (int64_t h = kh * st.group; h < (kh + 1) * st.group; ++h) {
    for (int64_t i0 = 0; i0 < s.seq; i0 += kBq) {
      const int64_t i1 = std::min(i0 + kBq, s.seq), n = i1 - i0;
      const BlockKeys bk = keys_of_block(mask, i0, i1, kv);
      const int64_t w = bk.width, kv_at = bk.j0 * st.kv_row;
      const int64_t off = (b * s.seq + i0) * st.q_row + h * st.d;
      if (w <= 0) {  // no row sees a key of the block: no share of the gradient
        for (int64_t r = 0; r < n; ++r) std::fill_n(dq + off + r * st.q_row, st.d, 0.0f);
        continue;
      }
      const float* row_lse = lse + (b * s.heads + h) * s.seq + i0;
      // P = exp(scale Q K^T - lse), zero where masked.
      gemm<float>(false, true, n, w, st.d, st.scale, q + off, st.q_row, kb + kv_at, st.kv_row, 0.0f,
                  p, w);
      for (int64_t r = 0; r < n; ++r) {
        float* row = p + r * w;
        const auto [lo, hi] = bk.cols(mask, i0, r);
        // slope is empty (null) without a soft cap: no offset from it then.
        cap_scores(mask, row, lo, hi, mask.softcap > 0 ? slope + r * w : nullptr);
        vec::exp_shifted(row + lo, hi - lo, row_lse[r], row + lo);
        std::fill(row, row + lo, 0.0f);
        std::fill(row + hi, row + w, 0.0f);
      }
      // dP = dO V^T, then dS = P (dP - delta) scale in place, delta = rowsum(dO O).
      gemm<float>(false, true, n, w, st.d, 1.0f, dout + off, st.q_row, vb + kv_at, st.kv_row, 0.0f,
                  dp, w);
      for (int64_t r = 0; r < n; ++r) {
        const float* dor = dout + off + r * st.q_row;
        const float* orow = out + off + r * st.q_row;
        float delta = 0;
        for (int64_t c = 0; c < st.d; ++c) delta += dor[c] * orow[c];
        float* prow = p + r * w;
        float* dsrow = dp + r * w;
        const auto [lo, hi] = bk.cols(mask, i0, r);
        for (int64_t j = lo; j < hi; ++j) dsrow[j] = prow[j] * (dsrow[j] - delta) * st.scale;
        if (mask.softcap > 0) {
          const float* sl = slope + r * w;
          for (int64_t j = lo; j < hi; ++j) dsrow[j] *= sl[j];
        }
        std::fill(dsrow, dsrow + lo, 0.0f);
        std::fill(dsrow + hi, dsrow + w, 0.0f);
      }
      gemm<float>(false, false, n, st.d, w, 1.0f, dp, w, kb + kv_at, st.kv_row, 0.0f, dq + off,
                  st.q_row);
      gemm<float>(true, false, w, st.d, n, 1.0f, dp, w, q + off, st.q_row, 1.0f, dkb + kv_at,
                  st.kv_row);
      gemm<float>(true, false, w, st.d, n, 1.0f, p, w, dout + off, st.q_row, 1.0f, dvb + kv_at,
                  st.kv_row);
    }
  }
}

}  // namespace

void attention_forward(const float* q, const float* k, const float* v, const AttentionShape& s,
                       const AttentionMask& mask, float* out, float* lse) {
  const Strides st = strides_of(s, mask);
  const int64_t blocks = (s.seq + kBq - 1) / kBq;
  const int64_t tasks = s.batch * s.heads * blocks;
  const bool parallel_tasks = tasks >= omp_get_max_threads();
#pragma omp parallel if (parallel_tasks)
  {
    std::vector<float> sc(static_cast<size_t>(kBq * s.keys()));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      // Later query blocks see more keys: hand them out first (dynamic schedule).
      const int64_t blk = blocks - 1 - t % blocks, bh = t / blocks;
      forward_block(q, k, v, s, mask, st, bh / s.heads, bh % s.heads, blk * kBq, out, lse, sc.data());
    }
  }
}

void attention_backward(const float* dout, const float* q, const float* k, const float* v,
                        const float* out, const float* lse, const AttentionShape& s,
                        const AttentionMask& mask, float* dq, float* dk, float* dv) {
  const Strides st = strides_of(s, mask);
  const int64_t tasks = s.batch * s.kv_heads;
  const bool parallel_tasks = tasks >= omp_get_max_threads();
#pragma omp parallel if (parallel_tasks)
  {
    std::vector<float> p(static_cast<size_t>(kBq * s.keys())), dp(p.size());
    std::vector<float> slope(mask.softcap > 0 ? p.size() : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      backward_task(dout, q, k, v, out, lse, s, mask, st, t / s.kv_heads, t % s.kv_heads, dq, dk, dv,
                    p.data(), dp.data(), slope.data());
    }
  }
}

void attention_merge(const AttentionShape& s, float* out, float* lse, const float* part,
                     const float* part_lse) {
  const int64_t d = s.head_dim, row = s.heads * d;
#pragma omp parallel for collapse(2) schedule(static) if (s.batch * s.seq * row >= nn::cpu::detail::kMinParallelWork)
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.seq; ++i) {
        float& l = lse[(b * s.heads + h) * s.seq + i];
        const MergeWeights w = merge_weights(l, part_lse[(b * s.heads + h) * s.seq + i]);
        float* o = out + (b * s.seq + i) * row + h * d;
        const float* p = part + (b * s.seq + i) * row + h * d;
        for (int64_t c = 0; c < d; ++c) o[c] = o[c] * w.keep + p[c] * w.take;
        l = w.lse;
      }
    }
  }
}

}  // namespace strata::ops::cpu
