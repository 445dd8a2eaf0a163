// CUDA row kernels of the chunked cross-entropy: log-sum-exp and loss per row
// of an fp32 logits chunk, and the logits gradient (softmax - onehot) * scale.
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

constexpr int32_t kIgnore = -100;

__global__ void ce_forward_kernel(const float* logits, const int32_t* targets, int64_t vocab,
                                  float* lse, float* loss) {
  __shared__ float scratch[32];
  const float* lr = logits + blockIdx.x * vocab;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, lr[c]);
  m = block_max(m, scratch);
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(lr[c] - m);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    const float row_lse = m + logf(s);
    const int32_t t = targets[blockIdx.x];
    lse[blockIdx.x] = row_lse;
    loss[blockIdx.x] = (t == kIgnore || t < 0 || t >= vocab) ? 0.0f : row_lse - lr[t];
  }
}

template <typename T>
__global__ void ce_backward_kernel(const float* logits, const int32_t* targets, const float* lse,
                                   int64_t vocab, float scale, T* grad) {
  const float* lr = logits + blockIdx.x * vocab;
  T* gr = grad + blockIdx.x * vocab;
  const int32_t t = targets[blockIdx.x];
  const bool ignored = t == kIgnore || t < 0 || t >= vocab;
  const float row_lse = lse[blockIdx.x];
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float g = ignored ? 0.0f : scale * (expf(lr[c] - row_lse) - (c == t ? 1.0f : 0.0f));
    gr[c] = from_f<T>(g);
  }
}

}  // namespace

void launch_ce_forward_rows(const float* logits, const int32_t* targets, int64_t n, int64_t vocab,
                            float* lse, float* loss, cudaStream_t stream) {
  if (n == 0) return;
  ce_forward_kernel<<<static_cast<unsigned>(n), 256, 0, stream>>>(logits, targets, vocab, lse,
                                                                  loss);
}

void launch_ce_backward_rows(bool bf16, const float* logits, const int32_t* targets,
                             const float* lse, int64_t n, int64_t vocab, float scale, void* grad,
                             cudaStream_t stream) {
  if (n == 0) return;
  STRATA_NN_DISPATCH(bf16, ce_backward_kernel<T><<<static_cast<unsigned>(n), 256, 0, stream>>>(
                               logits, targets, lse, vocab, scale, static_cast<T*>(grad)));
}

}  // namespace strata::nn::cuda::detail
