// CPU cross-entropy over the vocabulary fused with the output projection,
// processed chunk_rows rows at a time so the [rows, vocab] logits are never
// stored; backward recomputes each chunk's logits from the saved log-sum-exp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"
#include "core/error.h"

namespace strata::nn::cpu {
namespace {

void check(const int32_t* targets, const CrossEntropyShape& s) {
  STRATA_CHECK(s.rows >= 0 && s.dim > 0 && s.vocab > 0 && s.chunk_rows > 0, kBadArgument,
               "cross_entropy: bad shape rows={} dim={} vocab={} chunk_rows={}", s.rows, s.dim,
               s.vocab, s.chunk_rows);
  for (int64_t r = 0; r < s.rows; ++r) {
    STRATA_CHECK(targets[r] == kIgnoreIndex || (targets[r] >= 0 && targets[r] < s.vocab),
                 kBadArgument, "cross_entropy: target {} at row {} is outside [0, {}) and not {}",
                 targets[r], r, s.vocab, kIgnoreIndex);
  }
}

}  // namespace

int64_t count_targets(const int32_t* targets, int64_t rows) {
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r) n += targets[r] != kIgnoreIndex;
  return n;
}

template <typename T>
double cross_entropy_forward(const T* h, const T* w, const int32_t* targets,
                             const CrossEntropyShape& s, T* lse) {
  check(targets, s);
  const int64_t chunk = std::min(s.chunk_rows, std::max<int64_t>(s.rows, 1));
  std::vector<T> logits(static_cast<size_t>(chunk * s.vocab));
  double total = 0;
  for (int64_t r0 = 0; r0 < s.rows; r0 += chunk) {
    const int64_t n = std::min(chunk, s.rows - r0);
    detail::gemm<T>(false, true, n, s.vocab, s.dim, T(1), h + r0 * s.dim, s.dim, w, s.dim, T(0),
                    logits.data(), s.vocab);
#pragma omp parallel for schedule(static) reduction(+ : total) if (n * s.vocab >= detail::kMinParallelWork)
    for (int64_t r = 0; r < n; ++r) {
      const T* lr = logits.data() + r * s.vocab;
      const T m = *std::max_element(lr, lr + s.vocab);
      double sum = 0;
      for (int64_t c = 0; c < s.vocab; ++c) sum += std::exp(static_cast<double>(lr[c] - m));
      const double row_lse = static_cast<double>(m) + std::log(sum);
      lse[r0 + r] = static_cast<T>(row_lse);
      const int32_t t = targets[r0 + r];
      if (t != kIgnoreIndex) total += row_lse - static_cast<double>(lr[t]);
    }
  }
  return total;
}

template <typename T>
void cross_entropy_backward(const T* h, const T* w, const int32_t* targets, const T* lse,
                            const CrossEntropyShape& s, double scale, T* dh, T* dw) {
  check(targets, s);
  const int64_t chunk = std::min(s.chunk_rows, std::max<int64_t>(s.rows, 1));
  std::vector<T> grad(static_cast<size_t>(chunk * s.vocab));
  for (int64_t r0 = 0; r0 < s.rows; r0 += chunk) {
    const int64_t n = std::min(chunk, s.rows - r0);
    const T* hc = h + r0 * s.dim;
    detail::gemm<T>(false, true, n, s.vocab, s.dim, T(1), hc, s.dim, w, s.dim, T(0), grad.data(),
                    s.vocab);
    // d loss / d logits = softmax - onehot(target), times scale; zero for ignored rows.
#pragma omp parallel for schedule(static) if (n * s.vocab >= detail::kMinParallelWork)
    for (int64_t r = 0; r < n; ++r) {
      T* gr = grad.data() + r * s.vocab;
      const int32_t t = targets[r0 + r];
      if (t == kIgnoreIndex) {
        std::fill(gr, gr + s.vocab, T(0));
        continue;
      }
      const T row_lse = lse[r0 + r];
      for (int64_t c = 0; c < s.vocab; ++c)
        gr[c] = static_cast<T>(scale) * std::exp(gr[c] - row_lse);
      gr[t] -= static_cast<T>(scale);
    }
    detail::gemm<T>(false, false, n, s.dim, s.vocab, T(1), grad.data(), s.vocab, w, s.dim, T(0),
                    dh + r0 * s.dim, s.dim);
    detail::gemm<T>(true, false, s.vocab, s.dim, n, T(1), grad.data(), s.vocab, hc, s.dim, T(1), dw,
                    s.dim);
  }
}

template double cross_entropy_forward<float>(const float*, const float*, const int32_t*,
                                             const CrossEntropyShape&, float*);
template double cross_entropy_forward<double>(const double*, const double*, const int32_t*,
                                              const CrossEntropyShape&, double*);
template void cross_entropy_backward<float>(const float*, const float*, const int32_t*,
                                            const float*, const CrossEntropyShape&, double, float*,
                                            float*);
template void cross_entropy_backward<double>(const double*, const double*, const int32_t*,
                                             const double*, const CrossEntropyShape&, double,
                                             double*, double*);

}  // namespace strata::nn::cpu
