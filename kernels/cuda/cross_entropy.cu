// CUDA row kernels of the chunked cross-entropy (the GEMMs around them are in
// ops_cuda.cc): per row of an fp32 logits chunk, the log-sum-exp, the loss and
// optionally the logits gradient; then the loss sum and token count added to
// the fp64 statistics, and the count of non-ignored targets. Nothing here
// touches the host: the gradient's normalizer is read from device memory when
// the kernel runs. Sums run in a fixed order, so results are reproducible.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int32_t kIgnore = -100;  // strata::ops::kIgnoreIndex
constexpr int kRowThreads = 256;
constexpr int kSumThreads = 1024;

// logits = cap * tanh(logits / cap) in place (Gemma 2's final soft cap).
__global__ void softcap_kernel(float* logits, int64_t n, float cap) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    logits[i] = cap * tanhf(logits[i] / cap);
  }
}

// One block per row: the row's log-sum-exp in one pass (block_logsumexp), a
// second pass writes the gradient (through the soft cap: cap > 0 means the
// logits were capped, d capped / d logit = 1 - (capped / cap)^2).
template <typename G>
__global__ void ce_rows_kernel(const float* logits, const int32_t* targets, int64_t vocab,
                               float* lse, float* loss, G* grad, const double* normalizer,
                               double grad_scale, float cap) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const float* lr = logits + r * vocab;
  const int32_t t = targets[r];
  const bool counted = t != kIgnore;
  const bool valid = t >= 0 && t < vocab;  // other values are the caller's bug: no loss term
  // Read before the barriers below: with an fp32 gradient written in place,
  // lr[t] is overwritten in the last pass.
  const float target_logit = valid ? lr[t] : 0.0f;
  const float row_lse = block_logsumexp(lr, vocab, scratch);
  if (threadIdx.x == 0) {
    lse[r] = row_lse;
    loss[r] = counted && valid ? row_lse - target_logit : 0.0f;
  }
  if (grad == nullptr) return;
  G* gr = grad + r * vocab;
  if (!counted) {
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) gr[c] = from_f<G>(0.0f);
    return;
  }
  const float scale = static_cast<float>(grad_scale / normalizer[0]);
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float p = expf(lr[c] - row_lse);
    const float slope = cap > 0 ? 1.0f - (lr[c] / cap) * (lr[c] / cap) : 1.0f;
    gr[c] = from_f<G>(scale * (c == t ? p - 1.0f : p) * slope);
  }
}

__global__ void ce_stats_kernel(const float* loss, const int32_t* targets, int64_t rows,
                                double* stats) {
  __shared__ double scratch[32];
  double sum = 0.0, count = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) {
    sum += loss[i];
    count += targets[i] != kIgnore ? 1.0 : 0.0;
  }
  sum = block_sum(sum, scratch);
  count = block_sum(count, scratch);
  if (threadIdx.x == 0) {
    stats[0] += sum;
    stats[1] += count;
  }
}

__global__ void count_targets_kernel(const int32_t* targets, int64_t rows, double* count) {
  __shared__ double scratch[32];
  double n = 0.0;
  for (int64_t i = threadIdx.x; i < rows; i += blockDim.x) n += targets[i] != kIgnore ? 1.0 : 0.0;
  n = block_sum(n, scratch);
  if (threadIdx.x == 0) count[0] += n;
}

}  // namespace

void launch_ce_rows(const float* logits, const int32_t* targets, int64_t n, int64_t vocab,
                    float* lse, float* loss, Storage grad_t, void* grad, const double* normalizer,
                    double grad_scale, float logit_softcap, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned grid = static_cast<unsigned>(n);
  if (logit_softcap > 0) {
    softcap_kernel<<<grid_for(n * vocab, kRowThreads), kRowThreads, 0, stream>>>(const_cast<float*>(logits),
                                                                                 n * vocab, logit_softcap);
  }
  if (grad == nullptr) {
    ce_rows_kernel<float><<<grid, kRowThreads, 0, stream>>>(logits, targets, vocab, lse, loss,
                                                            nullptr, nullptr, 0.0, logit_softcap);
    return;
  }
  STRATA_DISPATCH_T(
      grad_t, G,
      ce_rows_kernel<G><<<grid, kRowThreads, 0, stream>>>(
          logits, targets, vocab, lse, loss, static_cast<G*>(grad), normalizer, grad_scale, logit_softcap));
}

void launch_ce_stats(const float* loss, const int32_t* targets, int64_t rows, double* stats,
                     cudaStream_t stream) {
  if (rows == 0) return;
  ce_stats_kernel<<<1, kSumThreads, 0, stream>>>(loss, targets, rows, stats);
}

void launch_count_targets(const int32_t* targets, int64_t rows, double* count,
                          cudaStream_t stream) {
  if (rows == 0) return;
  count_targets_kernel<<<1, kSumThreads, 0, stream>>>(targets, rows, count);
}

}  // namespace strata::ops::cuda
