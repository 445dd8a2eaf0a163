// CPU causal self-attention with grouped-query heads: the reference the fast
// kernels are tested against. Forward keeps only the per-row log-sum-exp;
// backward recomputes the probabilities from it (the FlashAttention
// recurrence), so no [seq, seq] matrix is stored between passes. Query i sees
// keys [first_visible_key(mask, i), i]; with a key block of its own (context
// parallelism) the keys ops::visible_block_keys gives, evaluated at global
// positions, and a row that sees none gets out 0 and lse -inf.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"
#include "core/error.h"

namespace strata::nn::cpu {
namespace {

void check_shape(const AttentionShape& s) {
  STRATA_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.head_dim > 0 &&
                   s.heads % s.kv_heads == 0,
               kBadArgument,
               "attention: bad shape batch={} seq={} heads={} kv_heads={} head_dim={} (heads must "
               "be a multiple of kv_heads)",
               s.batch, s.seq, s.heads, s.kv_heads, s.head_dim);
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// A scaled score after Gemma 2's soft cap (cap 0: none).
template <typename T>
T capped(T score, T cap) {
  return cap > 0 ? cap * std::tanh(score / cap) : score;
}

}  // namespace

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, const AttentionShape& s, T* out,
                       T* lse, const AttentionMask& mask) {
  check_shape(s);
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t q_row = s.heads * d, kv_row = s.kv_heads * d;  // token strides
  const int64_t kv = s.keys();
  const T scale = static_cast<T>(ops::attention_scale(mask, d));
  const T cap = static_cast<T>(mask.softcap);
#pragma omp parallel if (s.batch * s.heads * s.seq * kv * d >= 2 * detail::kMinParallelWork)
  {
    std::vector<T> p(static_cast<size_t>(kv));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t kh = h / group;
        for (int64_t i = 0; i < s.seq; ++i) {
          const T* qi = q + (b * s.seq + i) * q_row + h * d;
          const auto [first, last] = ops::visible_block_keys(mask.row(b * mask.seq), i, kv);
          // A sink joins the denominator with no value (-inf: none).
          const T sink = mask.sinks != nullptr ? T(mask.sinks[h]) : -std::numeric_limits<T>::infinity();
          T m = sink;
          for (int64_t j = first; j < last; ++j) {
            p[j] = capped(dot(qi, k + (b * kv + j) * kv_row + kh * d, d) * scale, cap);
            m = std::max(m, p[j]);
          }
          T sum = mask.sinks != nullptr ? std::exp(sink - m) : T(0);
          for (int64_t j = first; j < last; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
          }
          T* oi = out + (b * s.seq + i) * q_row + h * d;
          std::fill(oi, oi + d, T(0));
          for (int64_t j = first; j < last; ++j) {
            const T* vj = v + (b * kv + j) * kv_row + kh * d;
            const T w = p[j] / sum;
            for (int64_t c = 0; c < d; ++c) oi[c] += w * vj[c];
          }
          lse[(b * s.heads + h) * s.seq + i] = sum > 0 ? m + std::log(sum) : m;  // none: -inf
        }
      }
    }
  }
}

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const AttentionShape& s, T* dq, T* dk, T* dv,
                        const AttentionMask& mask) {
  check_shape(s);
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t q_row = s.heads * d, kv_row = s.kv_heads * d;
  const int64_t kv = s.keys();
  const T scale = static_cast<T>(ops::attention_scale(mask, d));
  const T cap = static_cast<T>(mask.softcap);
  // One (batch, kv head) per iteration: all query heads of a group write the
  // same dk/dv rows, so they stay on one thread.
#pragma omp parallel for collapse(2) \
    schedule(static) if (s.batch * s.heads * s.seq * kv * d >= 2 * detail::kMinParallelWork)
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t kh = 0; kh < s.kv_heads; ++kh) {
      for (int64_t j = 0; j < kv; ++j) {
        std::fill_n(dk + (b * kv + j) * kv_row + kh * d, d, T(0));
        std::fill_n(dv + (b * kv + j) * kv_row + kh * d, d, T(0));
      }
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        for (int64_t i = 0; i < s.seq; ++i) {
          const int64_t qo = (b * s.seq + i) * q_row + h * d;
          const T* qi = q + qo;
          const T* doi = dout + qo;
          T* dqi = dq + qo;
          std::fill(dqi, dqi + d, T(0));
          const T delta = dot(doi, out + qo, d);  // sum_j p_ij dp_ij
          const T row_lse = lse[(b * s.heads + h) * s.seq + i];
          const auto [first, last] = ops::visible_block_keys(mask.row(b * mask.seq), i, kv);
          for (int64_t j = first; j < last; ++j) {
            const int64_t ko = (b * kv + j) * kv_row + kh * d;
            const T score = capped(dot(qi, k + ko, d) * scale, cap);
            const T p = std::exp(score - row_lse);
            const T dp = dot(doi, v + ko, d);
            // Through the soft cap: d(c tanh(x / c))/dx = 1 - (score / c)^2.
            const T slope = cap > 0 ? T(1) - (score / cap) * (score / cap) : T(1);
            const T ds = p * (dp - delta) * slope * scale;
            T* dkj = dk + ko;
            T* dvj = dv + ko;
            const T* kj = k + ko;
            for (int64_t c = 0; c < d; ++c) {
              dvj[c] += p * doi[c];
              dqi[c] += ds * kj[c];
              dkj[c] += ds * qi[c];
            }
          }
        }
      }
    }
  }
}

template <typename T>
void attention_sinks_backward(const T* dout, const T* out, const T* lse, const AttentionShape& s,
                              const float* sinks, T* dsinks) {
  const int64_t d = s.head_dim, q_row = s.heads * d;
  // dsink_h = -sum over rows of p_sink (dO . O): the softmax's backward with
  // the sink's dp = 0. One head per iteration: each adds into its own entry.
#pragma omp parallel for schedule(static) if (s.batch * s.heads * s.seq * d >= detail::kMinParallelWork)
  for (int64_t h = 0; h < s.heads; ++h) {
    T acc = 0;
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t i = 0; i < s.seq; ++i) {
        const int64_t o = (b * s.seq + i) * q_row + h * d;
        acc += std::exp(T(sinks[h]) - lse[(b * s.heads + h) * s.seq + i]) * dot(dout + o, out + o, d);
      }
    }
    dsinks[h] -= acc;
  }
}

template void attention_sinks_backward<float>(const float*, const float*, const float*, const AttentionShape&,
                                              const float*, float*);
template void attention_sinks_backward<double>(const double*, const double*, const double*, const AttentionShape&,
                                               const float*, double*);
template void attention_forward<float>(const float*, const float*, const float*,
                                       const AttentionShape&, float*, float*, const AttentionMask&);
template void attention_forward<double>(const double*, const double*, const double*,
                                        const AttentionShape&, double*, double*,
                                        const AttentionMask&);
template void attention_backward<float>(const float*, const float*, const float*, const float*,
                                        const float*, const float*, const AttentionShape&, float*,
                                        float*, float*, const AttentionMask&);
template void attention_backward<double>(const double*, const double*, const double*, const double*,
                                         const double*, const double*, const AttentionShape&,
                                         double*, double*, double*, const AttentionMask&);

}  // namespace strata::nn::cpu
