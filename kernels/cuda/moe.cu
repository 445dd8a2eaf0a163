// CUDA kernels of the mixture-of-experts ops (kernels/ops.h, moe_*): routing
// (softmax or sigmoid in fp32, then kernels/moe_routing.h's choice and
// weights, the cpu kernel's formula), the stable permutation of the
// assignments by expert, gather/combine of token rows and their backwards,
// and the load-balancing loss. Deterministic: every sum runs in a fixed order.
// Routing runs one thread per token row (E is small: 8 to a few hundred) and
// the permutation one block that owns the experts (each thread scans the
// assignments for its experts, in row order): simple and exact; a segmented
// scan is the step up when rows * k grows past ~1e5.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void route_kernel(const T* logits, int64_t rows, int64_t experts, int64_t k, MoeRouter router,
                             const float* bias, float* probs, int32_t* indices, float* weights) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const T* l = logits + r * experts;
  float* p = probs + r * experts;
  if (router.scores == MoeScores::kSigmoid) {
    for (int64_t e = 0; e < experts; ++e) p[e] = 1.0f / (1.0f + expf(-to_f(l[e])));
  } else {
    float m = to_f(l[0]);
    for (int64_t e = 1; e < experts; ++e) m = fmaxf(m, to_f(l[e]));
    float sum = 0;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = expf(to_f(l[e]) - m);
      sum += p[e];
    }
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
  }
  uint64_t allowed[kMaxMoeGroupWords];
  moe_choose(router, p, bias, experts, k, allowed, indices + r * k, weights + r * k);
}

// One block: counts per expert, their prefix sums (offsets), then each
// expert's slots in assignment order; with aux_stats, += counts and prob sums.
__global__ void assign_kernel(const int32_t* indices, const float* probs, int64_t rows, int64_t experts,
                              int64_t k, int32_t* offsets, int32_t* slots, int32_t* tokens,
                              double* aux_stats) {
  const int64_t n = rows * k;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t count = 0;
    for (int64_t a = 0; a < n; ++a) count += indices[a] == e;
    offsets[e + 1] = count;
    if (aux_stats != nullptr) {
      double psum = 0;
      for (int64_t r = 0; r < rows; ++r) psum += probs[r * experts + e];
      aux_stats[e] += count;
      aux_stats[experts + e] += psum;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t next = offsets[e];
    for (int64_t a = 0; a < n; ++a) {
      if (indices[a] != e) continue;
      slots[a] = next;
      tokens[next] = static_cast<int32_t>(a / k);
      ++next;
    }
  }
}

template <typename T>
__global__ void route_backward_kernel(const float* probs, const int32_t* indices, const float* weights,
                                      const float* dweights, int64_t rows, int64_t experts, int64_t k,
                                      MoeRouter router, const float* aux_grad, T* dlogits) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* p = probs + r * experts;
  const int32_t* idx = indices + r * k;
  const float *w = weights + r * k, *dw = dweights + r * k;
  // d loss / d p_e (moe_routing.h), then the scores' backward: the sigmoid's
  // p_e (1 - p_e), or the softmax's p_e (dp_e - sum_i p_i dp_i).
  if (router.scores == MoeScores::kSigmoid) {
    for (int64_t e = 0; e < experts; ++e) {
      const float dp = moe_dprob(router, p, idx, w, dw, k, aux_grad, e);
      dlogits[r * experts + e] = from_f<T>(dp * (p[e] * (1.0f - p[e])));
    }
    return;
  }
  float pd = 0;
  for (int64_t e = 0; e < experts; ++e) pd += p[e] * moe_dprob(router, p, idx, w, dw, k, aux_grad, e);
  for (int64_t e = 0; e < experts; ++e) {
    dlogits[r * experts + e] = from_f<T>(p[e] * (moe_dprob(router, p, idx, w, dw, k, aux_grad, e) - pd));
  }
}

template <typename T>
__global__ void gather_kernel(const T* x, const int32_t* tokens, int64_t n, int64_t dim, T* xp) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n * dim; i += stride) {
    xp[i] = x[static_cast<int64_t>(tokens[i / dim]) * dim + i % dim];
  }
}

template <typename T>
__global__ void gather_backward_kernel(const T* dxp, const int32_t* slots, int64_t rows, int64_t k,
                                       int64_t dim, bool accumulate, T* dx) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * dim; i += stride) {
    const int64_t r = i / dim, d = i % dim;
    float v = accumulate ? to_f(dx[i]) : 0.0f;
    for (int64_t j = 0; j < k; ++j) v += to_f(dxp[static_cast<int64_t>(slots[r * k + j]) * dim + d]);
    dx[i] = from_f<T>(v);
  }
}

template <typename T>
__global__ void combine_kernel(const T* yp, const int32_t* slots, const float* weights, int64_t rows,
                               int64_t k, int64_t dim, T* y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * dim; i += stride) {
    const int64_t r = i / dim, d = i % dim;
    float v = 0;
    for (int64_t j = 0; j < k; ++j) {
      v += weights[r * k + j] * to_f(yp[static_cast<int64_t>(slots[r * k + j]) * dim + d]);
    }
    y[i] = from_f<T>(v);
  }
}

// One warp per assignment (r, j): dyp's row and the dot product for dweights.
template <typename T>
__global__ void combine_backward_kernel(const T* dy, const T* yp, const int32_t* slots, const float* weights,
                                        int64_t assignments, int64_t k, int64_t dim, T* dyp,
                                        float* dweights) {
  const int64_t a = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (a >= assignments) return;
  const int64_t r = a / k, s = slots[a];
  const float w = weights[a];
  float dot = 0;
  for (int64_t d = lane; d < dim; d += 32) {
    const float g = to_f(dy[r * dim + d]);
    dyp[s * dim + d] = from_f<T>(w * g);
    dot += g * to_f(yp[s * dim + d]);
  }
  dot = warp_sum(dot);
  if (lane == 0) dweights[a] = dot;
}

__global__ void aux_loss_kernel(const double* aux_stats, int64_t experts, double rows, double scale,
                                double* aux, float* aux_grad) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double sum = 0;
  for (int64_t e = 0; e < experts; ++e) {
    sum += (aux_stats[e] / rows) * (aux_stats[experts + e] / rows);
    aux_grad[e] = static_cast<float>(scale * static_cast<double>(experts) * aux_stats[e] / (rows * rows));
  }
  aux[0] = static_cast<double>(experts) * sum;
}

// y[r] += sigmoid(gate[r]) * v[r] (qwen2_moe's shared expert), element-wise.
template <typename T>
__global__ void sigmoid_gated_add_kernel(const T* v, const T* gate, int64_t rows, int64_t dim, T* y) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * dim; i += stride) {
    const float g = 1.0f / (1.0f + expf(-to_f(gate[i / dim])));
    y[i] = from_f<T>(to_f(y[i]) + g * to_f(v[i]));
  }
}

// One warp per row: dv's row and the dot product <dy, v> for dgate.
template <typename T>
__global__ void sigmoid_gated_add_backward_kernel(const T* dy, const T* v, const T* gate, int64_t rows,
                                                  int64_t dim, T* dv, T* dgate) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float g = 1.0f / (1.0f + expf(-to_f(gate[r])));
  float dot = 0;
  for (int64_t d = lane; d < dim; d += 32) {
    const float grad = to_f(dy[r * dim + d]);
    dv[r * dim + d] = from_f<T>(g * grad);
    dot += grad * to_f(v[r * dim + d]);
  }
  dot = warp_sum(dot);
  if (lane == 0) dgate[r] = from_f<T>(g * (1.0f - g) * dot);
}

unsigned int row_blocks(int64_t rows) {
  return static_cast<unsigned int>((rows + kThreads - 1) / kThreads);
}

}  // namespace

void launch_moe_route(Storage t, const void* logits, int64_t rows, int64_t experts, int64_t k,
                      const MoeRouter& router, const float* correction_bias, float* probs, int32_t* indices,
                      float* weights, int32_t* offsets, int32_t* slots, int32_t* tokens, double* aux_stats,
                      cudaStream_t stream) {
  if (rows > 0) {
    STRATA_DISPATCH_T(t, T,
                      route_kernel<T><<<row_blocks(rows), kThreads, 0, stream>>>(
                          static_cast<const T*>(logits), rows, experts, k, router, correction_bias, probs,
                          indices, weights));
  }
  const int threads = experts >= 1024 ? 1024 : static_cast<int>((experts + 31) / 32 * 32);
  assign_kernel<<<1, threads, 0, stream>>>(indices, probs, rows, experts, k, offsets, slots, tokens,
                                           aux_stats);
}

void launch_moe_route_backward(const float* probs, const int32_t* indices, const float* weights,
                               const float* dweights, int64_t rows, int64_t experts, int64_t k,
                               const MoeRouter& router, const float* aux_grad, Storage t, void* dlogits,
                               cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T,
                    route_backward_kernel<T><<<row_blocks(rows), kThreads, 0, stream>>>(
                        probs, indices, weights, dweights, rows, experts, k, router, aux_grad,
                        static_cast<T*>(dlogits)));
}

void launch_moe_gather(Storage t, const void* x, const int32_t* tokens, int64_t n, int64_t dim, void* xp,
                       cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T,
                    gather_kernel<T><<<grid_for(n * dim, kThreads), kThreads, 0, stream>>>(
                        static_cast<const T*>(x), tokens, n, dim, static_cast<T*>(xp)));
}

void launch_moe_gather_backward(Storage t, const void* dxp, const int32_t* slots, int64_t rows, int64_t k,
                                int64_t dim, bool accumulate, void* dx, cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T,
                    gather_backward_kernel<T><<<grid_for(rows * dim, kThreads), kThreads, 0, stream>>>(
                        static_cast<const T*>(dxp), slots, rows, k, dim, accumulate, static_cast<T*>(dx)));
}

void launch_moe_combine(Storage t, const void* yp, const int32_t* slots, const float* weights, int64_t rows,
                        int64_t k, int64_t dim, void* y, cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T,
                    combine_kernel<T><<<grid_for(rows * dim, kThreads), kThreads, 0, stream>>>(
                        static_cast<const T*>(yp), slots, weights, rows, k, dim, static_cast<T*>(y)));
}

void launch_moe_combine_backward(Storage t, const void* dy, const void* yp, const int32_t* slots,
                                 const float* weights, int64_t rows, int64_t k, int64_t dim, void* dyp,
                                 float* dweights, cudaStream_t stream) {
  const int64_t assignments = rows * k;
  const auto blocks = static_cast<unsigned int>((assignments * 32 + kThreads - 1) / kThreads);
  STRATA_DISPATCH_T(t, T,
                    combine_backward_kernel<T><<<blocks, kThreads, 0, stream>>>(
                        static_cast<const T*>(dy), static_cast<const T*>(yp), slots, weights, assignments,
                        k, dim, static_cast<T*>(dyp), dweights));
}

void launch_moe_aux_loss(const double* aux_stats, int64_t experts, double rows, double scale, double* aux,
                         float* aux_grad, cudaStream_t stream) {
  aux_loss_kernel<<<1, 1, 0, stream>>>(aux_stats, experts, rows, scale, aux, aux_grad);
}

void launch_sigmoid_gated_add(Storage t, const void* v, const void* gate, int64_t rows, int64_t dim, void* y,
                              cudaStream_t stream) {
  STRATA_DISPATCH_T(t, T,
                    sigmoid_gated_add_kernel<T><<<grid_for(rows * dim, kThreads), kThreads, 0, stream>>>(
                        static_cast<const T*>(v), static_cast<const T*>(gate), rows, dim, static_cast<T*>(y)));
}

void launch_sigmoid_gated_add_backward(Storage t, const void* dy, const void* v, const void* gate, int64_t rows,
                                       int64_t dim, void* dv, void* dgate, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>((rows * 32 + kThreads - 1) / kThreads);
  STRATA_DISPATCH_T(t, T,
                    sigmoid_gated_add_backward_kernel<T><<<blocks, kThreads, 0, stream>>>(
                        static_cast<const T*>(dy), static_cast<const T*>(v), static_cast<const T*>(gate), rows,
                        dim, static_cast<T*>(dv), static_cast<T*>(dgate)));
}

}  // namespace strata::ops::cuda
