// CUDA embedding lookup and its backward (fp32 atomic scatter-add).
#include "kernels/cuda/nn_device.h"
#include "kernels/cuda/nn_launch.h"

namespace strata::nn::cuda::detail {
namespace {

template <typename T>
__global__ void embedding_forward_kernel(const T* table, const int32_t* ids, int64_t vocab,
                                         int64_t dim, T* out) {
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  const bool valid = id >= 0 && id < vocab;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    out[r * dim + c] = valid ? table[static_cast<int64_t>(id) * dim + c] : from_f<T>(0.0f);
  }
}

template <typename T>
__global__ void embedding_backward_kernel(const T* dout, const int32_t* ids, int64_t vocab,
                                          int64_t dim, float* dtable) {
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  if (id < 0 || id >= vocab) return;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    atomicAdd(dtable + static_cast<int64_t>(id) * dim + c, to_f(dout[r * dim + c]));
  }
}

}  // namespace

void launch_embedding_forward(bool bf16, const void* table, const int32_t* ids, int64_t rows,
                              int64_t vocab, int64_t dim, void* out, cudaStream_t stream) {
  if (rows == 0) return;
  STRATA_NN_DISPATCH(bf16,
                     embedding_forward_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
                         static_cast<const T*>(table), ids, vocab, dim, static_cast<T*>(out)));
}

void launch_embedding_backward(bool bf16, const void* dout, const int32_t* ids, int64_t rows,
                               int64_t vocab, int64_t dim, float* dtable, cudaStream_t stream) {
  if (rows == 0) return;
  STRATA_NN_DISPATCH(bf16,
                     embedding_backward_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
                         static_cast<const T*>(dout), ids, vocab, dim, dtable));
}

}  // namespace strata::nn::cuda::detail
