// CUDA row kernels of the vocabulary-parallel cross-entropy (Ops::
// vocab_parallel_parts / vocab_parallel_loss; the logits GEMM and the dh / dw
// GEMMs are the model's linear ops): per row of this rank's logits [n, shard],
// its log-sum-exp and target logit; then, from every rank's gathered parts,
// the whole vocabulary's log-sum-exp, the row's loss and (training) the
// gradient written over the logits. Ranks are combined in a fixed order, in
// double, so every rank computes the same bits from the same gathered parts.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int32_t kIgnore = -100;  // strata::ops::kIgnoreIndex
constexpr int kRowThreads = 256;

// One block per row.
template <typename T>
__global__ void vp_parts_kernel(const T* logits, const int32_t* targets, int64_t n, int64_t shard, int64_t first_id,
                                float* parts) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const T* lr = logits + r * shard;
  const float row_lse = block_logsumexp(lr, shard, scratch);
  if (threadIdx.x == 0) {
    const int32_t t = targets[r];
    const int64_t local = static_cast<int64_t>(t) - first_id;
    parts[r] = row_lse;
    parts[n + r] = t != kIgnore && local >= 0 && local < shard ? to_f(lr[local]) : 0.0f;
  }
}

template <typename T>
__global__ void vp_loss_kernel(T* logits, const float* gathered, int64_t ranks, const int32_t* targets, int64_t n,
                               int64_t shard, int64_t first_id, float* lse, float* loss, const double* normalizer,
                               double grad_scale) {
  __shared__ float row_lse;
  const int64_t r = blockIdx.x;
  const int32_t t = targets[r];
  if (threadIdx.x == 0) {
    double m = -INFINITY;
    for (int64_t p = 0; p < ranks; ++p) m = fmax(m, static_cast<double>(gathered[(p * 2) * n + r]));
    double sum = 0.0, target_logit = 0.0;
    for (int64_t p = 0; p < ranks; ++p) {
      sum += exp(static_cast<double>(gathered[(p * 2) * n + r]) - m);
      target_logit += gathered[(p * 2 + 1) * n + r];
    }
    const double whole = m + log(sum);
    row_lse = static_cast<float>(whole);
    lse[r] = row_lse;
    loss[r] = t != kIgnore ? static_cast<float>(whole - target_logit) : 0.0f;
  }
  __syncthreads();
  if (normalizer == nullptr) return;
  T* gr = logits + r * shard;
  if (t == kIgnore) {
    for (int64_t c = threadIdx.x; c < shard; c += blockDim.x) gr[c] = from_f<T>(0.0f);
    return;
  }
  const float scale = static_cast<float>(grad_scale / normalizer[0]);
  const int64_t local = static_cast<int64_t>(t) - first_id;
  for (int64_t c = threadIdx.x; c < shard; c += blockDim.x) {
    const float p = expf(to_f(gr[c]) - row_lse);
    gr[c] = from_f<T>(scale * (c == local ? p - 1.0f : p));
  }
}

}  // namespace

void launch_vocab_parallel_parts(Storage t, const void* logits, const int32_t* targets, int64_t n, int64_t shard,
                                 int64_t first_id, float* parts, cudaStream_t stream) {
  if (n == 0) return;
  STRATA_DISPATCH_T(t, T,
                    vp_parts_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
                        static_cast<const T*>(logits), targets, n, shard, first_id, parts));
}

void launch_vocab_parallel_loss(Storage t, void* logits, const float* gathered, int64_t ranks,
                                const int32_t* targets, int64_t n, int64_t shard, int64_t first_id, float* lse,
                                float* loss, const double* normalizer, double grad_scale, cudaStream_t stream) {
  if (n == 0) return;
  STRATA_DISPATCH_T(t, T,
                    vp_loss_kernel<T><<<static_cast<unsigned>(n), kRowThreads, 0, stream>>>(
                        static_cast<T*>(logits), gathered, ranks, targets, n, shard, first_id, lse, loss,
                        normalizer, grad_scale));
}

}  // namespace strata::ops::cuda
