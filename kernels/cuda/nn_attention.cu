// CUDA causal GQA attention: one block per (query row, head, batch). Forward
// keeps the row's scores in shared memory and saves only the log-sum-exp;
// backward recomputes the probabilities and scatters dk/dv with fp32 atomics.
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, int64_t seq,
                                         int64_t heads, int64_t kv_heads, int64_t d, float scale,
                                         T* out, float* lse) {
  extern __shared__ float smem[];  // q_i [d], scores [seq]
  __shared__ float scratch[32];
  float* qi = smem;
  float* p = smem + d;
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kh = h / (heads / kv_heads);
  const int64_t q_off = ((b * seq + i) * heads + h) * d;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) qi[c] = to_f(q[q_off + c]);
  __syncthreads();
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const T* kj = k + ((b * seq + j) * kv_heads + kh) * d;
    float s = 0.0f;
    for (int64_t c = 0; c < d; ++c) s += qi[c] * to_f(kj[c]);
    p[j] = s * scale;
    local_max = fmaxf(local_max, p[j]);
  }
  const float m = block_max(local_max, scratch);
  float local_sum = 0.0f;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    p[j] = expf(p[j] - m);
    local_sum += p[j];
  }
  const float sum = block_sum(local_sum, scratch);  // also orders the p[] writes
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float o = 0.0f;
    for (int64_t j = 0; j <= i; ++j) o += p[j] * to_f(v[((b * seq + j) * kv_heads + kh) * d + c]);
    out[q_off + c] = from_f<T>(o / sum);
  }
  if (threadIdx.x == 0) lse[(b * heads + h) * seq + i] = m + logf(sum);
}

template <typename T>
__global__ void attention_backward_kernel(const T* dout, const T* q, const T* k, const T* v,
                                          const T* out, const float* lse, int64_t seq,
                                          int64_t heads, int64_t kv_heads, int64_t d, float scale,
                                          T* dq, float* dk, float* dv) {
  extern __shared__ float smem[];  // q_i [d], dout_i [d], p [seq], ds [seq]
  __shared__ float scratch[32];
  float* qi = smem;
  float* doi = smem + d;
  float* p = smem + 2 * d;
  float* ds = p + seq;
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kh = h / (heads / kv_heads);
  const int64_t q_off = ((b * seq + i) * heads + h) * d;
  float local = 0.0f;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    qi[c] = to_f(q[q_off + c]);
    doi[c] = to_f(dout[q_off + c]);
    local += doi[c] * to_f(out[q_off + c]);
  }
  const float delta = block_sum(local, scratch);  // syncs qi/doi too
  const float row_lse = lse[(b * heads + h) * seq + i];
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const int64_t kv_off = ((b * seq + j) * kv_heads + kh) * d;
    float s = 0.0f, dp = 0.0f;
    for (int64_t c = 0; c < d; ++c) {
      s += qi[c] * to_f(k[kv_off + c]);
      dp += doi[c] * to_f(v[kv_off + c]);
    }
    p[j] = expf(s * scale - row_lse);
    ds[j] = p[j] * (dp - delta) * scale;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j <= i; ++j)
      acc += ds[j] * to_f(k[((b * seq + j) * kv_heads + kh) * d + c]);
    dq[q_off + c] = from_f<T>(acc);
  }
  for (int64_t idx = threadIdx.x; idx < (i + 1) * d; idx += blockDim.x) {
    const int64_t j = idx / d, c = idx % d;
    const int64_t kv_off = ((b * seq + j) * kv_heads + kh) * d + c;
    atomicAdd(dk + kv_off, ds[j] * qi[c]);
    atomicAdd(dv + kv_off, p[j] * doi[c]);
  }
}

}  // namespace

void launch_attention_forward(bool bf16, const void* q, const void* k, const void* v, int64_t batch,
                              int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              void* out, float* lse, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(seq), static_cast<unsigned>(heads),
                  static_cast<unsigned>(batch));
  const size_t shared = static_cast<size_t>(head_dim + seq) * sizeof(float);
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  STRATA_NN_DISPATCH(
      bf16, attention_forward_kernel<T><<<grid, kThreads, shared, stream>>>(
                static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), seq,
                heads, kv_heads, head_dim, scale, static_cast<T*>(out), lse));
}

void launch_attention_backward(bool bf16, const void* dout, const void* q, const void* k,
                               const void* v, const void* out, const float* lse, int64_t batch,
                               int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                               void* dq, float* dk32, float* dv32, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(seq), static_cast<unsigned>(heads),
                  static_cast<unsigned>(batch));
  const size_t shared = static_cast<size_t>(2 * head_dim + 2 * seq) * sizeof(float);
  const float scale = 1.0f / sqrtf(static_cast<float>(head_dim));
  STRATA_NN_DISPATCH(
      bf16, attention_backward_kernel<T><<<grid, kThreads, shared, stream>>>(
                static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k),
                static_cast<const T*>(v), static_cast<const T*>(out), lse, seq, heads, kv_heads,
                head_dim, scale, static_cast<T*>(dq), dk32, dv32));
}

}  // namespace strata::nn::cuda::detail
