// Ops::attention_merge on cuda: one thread per (batch, head, query) row merges
// a key block's partial output into the fp32 accumulator by their
// log-sum-exps (kernels/attention_merge.h, the formula the cpu kernel runs).
#include "kernels/attention_merge.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/launch.h"

namespace strata::ops::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void merge_kernel(float* out, float* lse, const T* part, const float* part_lse, int64_t batch,
                             int64_t seq, int64_t heads, int64_t head_dim) {
  const int64_t rows = batch * heads * seq;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < rows; t += stride) {
    const int64_t i = t % seq, h = (t / seq) % heads, b = t / (seq * heads);  // lse is [batch, heads, seq]
    const MergeWeights w = merge_weights(lse[t], part_lse[t]);
    const int64_t at = ((b * seq + i) * heads + h) * head_dim;
    for (int64_t c = 0; c < head_dim; ++c) out[at + c] = out[at + c] * w.keep + to_f(part[at + c]) * w.take;
    lse[t] = w.lse;
  }
}

}  // namespace

void launch_attention_merge(Storage part_t, float* out, float* lse, const void* part, const float* part_lse,
                            int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, cudaStream_t stream) {
  const int64_t rows = batch * heads * seq;
  STRATA_DISPATCH_T(part_t, T,
                    merge_kernel<T><<<grid_for(rows, kThreads), kThreads, 0, stream>>>(
                        out, lse, static_cast<const T*>(part), part_lse, batch, seq, heads, head_dim));
}

}  // namespace strata::ops::cuda
