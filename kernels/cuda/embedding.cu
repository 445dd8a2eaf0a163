// CUDA embedding lookup and its deterministic backward. The backward sorts the
// token ids (a stable radix sort that carries each row's index) so that all
// rows of one id form a segment; one block sums a segment in row order and
// adds it to that id's row of the fp32 gradient. No atomics, so a repeated id
// gets bitwise the same gradient on every run.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int kThreads = 256;

template <typename P, typename A>
__global__ void embedding_forward_kernel(const P* table, const int32_t* ids, int64_t rows, int64_t first_id,
                                         int64_t vocab, int64_t dim, A* out, bool vectorized, float scale) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t id = static_cast<int64_t>(ids[r]) - first_id;  // the row in this table (a shard's)
    // Another shard's ids read as a zero row; out-of-range ids are the
    // caller's bug and do the same rather than read out of bounds.
    const bool valid = id >= 0 && id < vocab;
    const P* src = table + (valid ? id : 0) * dim;
    A* dst = out + r * dim;
    if (vectorized) {
      for (int64_t c = threadIdx.x * 8; c < dim; c += blockDim.x * 8) {
        float f[8];
        if (valid) {
          load8(src + c, f);
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] *= scale;
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] = 0.0f;
        }
        store8(dst + c, f);
      }
    } else {
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x)
        dst[c] = from_f<A>(valid ? to_f(src[c]) * scale : 0.0f);
    }
  }
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    v[i] = static_cast<int32_t>(i);
  }
}

// Block b handles sorted position i = b, b + gridDim.x, ...: when i starts a
// segment of equal ids, the block sums the segment's rows (in ascending row
// order, which the stable sort kept) and adds the sum to dtable[id].
template <typename T>
__global__ void embedding_segment_kernel(const T* dout, const int32_t* sorted_ids,
                                         const int32_t* sorted_rows, int64_t rows, int64_t first_id,
                                         int64_t vocab, int64_t dim, int64_t padding_idx, float* dtable,
                                         float scale) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int32_t id = sorted_ids[i];
    if (i > 0 && sorted_ids[i - 1] == id) continue;  // not a segment start
    const int64_t local = static_cast<int64_t>(id) - first_id;  // its row in this table (a shard's)
    if (local < 0 || local >= vocab || id == padding_idx) continue;
    int64_t end = i + 1;
    while (end < rows && sorted_ids[end] == id) ++end;
    float* dst = dtable + local * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      float acc = 0.0f;
      for (int64_t j = i; j < end; ++j)
        acc += to_f(dout[static_cast<int64_t>(sorted_rows[j]) * dim + c]) * scale;
      dst[c] += acc;
    }
  }
}

constexpr size_t kAlign = 256;
size_t align_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

size_t sort_temp_nbytes(int64_t rows) {
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(rows));
  return temp;
}

}  // namespace

void launch_embedding_forward(Storage table_t, const void* table, const int32_t* ids, int64_t rows,
                              int64_t first_id, int64_t vocab, int64_t dim, Storage out_t, void* out,
                              float scale, cudaStream_t stream) {
  if (rows == 0 || dim == 0) return;
  const bool vectorized = dim % 8 == 0 && aligned16(table) && aligned16(out);
  const unsigned grid = static_cast<unsigned>(rows < 65535 * 16 ? rows : 65535 * 16);
  STRATA_DISPATCH_2(table_t, P, out_t, A,
                    embedding_forward_kernel<P, A>
                    <<<grid, kThreads, 0, stream>>>(static_cast<const P*>(table), ids, rows, first_id,
                                                    vocab, dim, static_cast<A*>(out), vectorized, scale));
}

size_t embedding_backward_scratch_nbytes(int64_t rows) {
  // sorted ids, row indices before and after the sort, and cub's temporaries.
  return 3 * align_up(static_cast<size_t>(rows) * sizeof(int32_t)) +
         align_up(sort_temp_nbytes(rows));
}

cudaError_t launch_embedding_backward(Storage t, const void* dout, const int32_t* ids, int64_t rows,
                                      int64_t first_id, int64_t vocab, int64_t dim, int64_t padding_idx,
                                      float* dtable, void* scratch, size_t scratch_nbytes, float scale,
                                      cudaStream_t stream) {
  if (rows == 0 || dim == 0) return cudaSuccess;
  char* base = static_cast<char*>(scratch);
  const size_t slice = align_up(static_cast<size_t>(rows) * sizeof(int32_t));
  auto* sorted_ids = reinterpret_cast<int32_t*>(base);
  auto* row_index = reinterpret_cast<int32_t*>(base + slice);
  auto* sorted_rows = reinterpret_cast<int32_t*>(base + 2 * slice);
  void* temp = base + 3 * slice;
  size_t temp_nbytes = scratch_nbytes - 3 * slice;
  iota_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(row_index, rows);
  const cudaError_t sorted =
      cub::DeviceRadixSort::SortPairs(temp, temp_nbytes, ids, sorted_ids, row_index, sorted_rows,
                                      static_cast<int>(rows), 0, 32, stream);
  if (sorted != cudaSuccess) return sorted;
  const unsigned grid = static_cast<unsigned>(rows < 65535 * 16 ? rows : 65535 * 16);
  STRATA_DISPATCH_T(t, T,
                    embedding_segment_kernel<T>
                    <<<grid, kThreads, 0, stream>>>(static_cast<const T*>(dout), sorted_ids,
                                                    sorted_rows, rows, first_id, vocab, dim, padding_idx,
                                                    dtable, scale));
  return cudaSuccess;
}

}  // namespace strata::ops::cuda
