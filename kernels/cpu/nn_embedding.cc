// CPU embedding lookup and its backward (scatter-add of row gradients).
#include <cstring>

#include "kernels/cpu/nn_gemm.h"
#include "kernels/nn_ops.h"
#include "core/error.h"

namespace strata::nn::cpu {

template <typename T>
void embedding_forward(const T* table, const int32_t* ids, int64_t rows, int64_t vocab, int64_t dim,
                       T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    STRATA_CHECK(ids[r] >= 0 && ids[r] < vocab, kBadArgument,
                 "embedding: token id {} at position {} is outside the vocabulary [0, {})", ids[r],
                 r, vocab);
  }
#pragma omp parallel for schedule(static) if (rows * dim >= detail::kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out + r * dim, table + static_cast<int64_t>(ids[r]) * dim,
                static_cast<size_t>(dim) * sizeof(T));
  }
}

template <typename T>
void embedding_backward(const T* dout, const int32_t* ids, int64_t rows, int64_t vocab, int64_t dim,
                        T* dtable, int64_t padding_idx, int64_t first_id, int64_t table_rows) {
  for (int64_t r = 0; r < rows; ++r) {
    STRATA_CHECK(ids[r] >= 0 && ids[r] < vocab, kBadArgument,
                 "embedding backward: token id {} at position {} is outside [0, {})", ids[r], r,
                 vocab);
  }
  const int64_t held = table_rows >= 0 ? table_rows : vocab;
  // Rows repeat (the same token twice), so parallelise over columns: each
  // thread owns a column range of every table row and no two threads collide.
#pragma omp parallel for schedule(static) if (rows * dim >= detail::kMinParallelWork)
  for (int64_t c = 0; c < dim; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t local = static_cast<int64_t>(ids[r]) - first_id;
      if (ids[r] != padding_idx && local >= 0 && local < held) dtable[local * dim + c] += dout[r * dim + c];
    }
  }
}

template void embedding_forward<float>(const float*, const int32_t*, int64_t, int64_t, int64_t,
                                       float*);
template void embedding_forward<double>(const double*, const int32_t*, int64_t, int64_t, int64_t,
                                        double*);
template void embedding_backward<float>(const float*, const int32_t*, int64_t, int64_t, int64_t,
                                        float*, int64_t, int64_t, int64_t);
template void embedding_backward<double>(const double*, const int32_t*, int64_t, int64_t, int64_t,
                                         double*, int64_t, int64_t, int64_t);

}  // namespace strata::nn::cpu
