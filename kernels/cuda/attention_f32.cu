// Causal GQA attention for fp32 activations on CUDA cores (exact fp32 FMA; no
// TF32), with the same structure as the tensor-core kernels: an online-softmax
// forward, and a backward of a dK/dV kernel per key tile plus a dQ kernel per
// query tile, no [seq, seq] matrix and no atomics. Tiles are 32 x 32; a row of
// a tile is owned by 4 consecutive threads of one warp, each taking every 4th
// column. Design and shared-memory budget: attention.cu. Masks beyond
// causality (a sliding window, packed documents) and a key block of its own
// (context parallelism: kv_seq keys, global offsets) come from
// attention_mask.h and attention_block_ranges.h: key tiles wholly outside a
// query tile's visible keys are skipped (and query tiles outside a key tile's
// queries), the rest masked per element. A row that sees no key gets out 0
// and lse -inf; gpt-oss's sinks start each row's running max and sum at the
// sink (max = sink, sum = exp(sink - sink) = 1), so they join the denominator
// and the lse with no value.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kThreads = 128;  // 32 rows x 4 threads
constexpr int kPerThread = kTile / 4;

// fp32 tiles are [32][kD + 1]: the odd stride puts rows j and j' (same column)
// in different banks, so threads reading different rows never conflict.
template <int kD>
constexpr int kLd32 = kD + 1;
constexpr int kPLd = kTile + 1;

template <int kD>
__device__ __forceinline__ void load_tile32(float* dst, const float* src, int64_t stride,
                                            int64_t row0, int64_t seq, int head_dim) {
  for (int i = threadIdx.x; i < kTile * kD; i += kThreads) {
    const int r = i / kD, c = i % kD;
    dst[r * kLd32<kD> + c] = row0 + r < seq && c < head_dim ? src[(row0 + r) * stride + c] : 0.0f;
  }
}

template <int kD>
__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
  float s = 0.0f;
#pragma unroll 16
  for (int c = 0; c < kD; ++c) s += a[c] * b[c];
  return s;
}

template <int kD>
__global__ void __launch_bounds__(kThreads)
    attention_forward_f32_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                 const float* __restrict__ v, float* __restrict__ out,
                                 float* __restrict__ lse, int64_t seq, int64_t kv_seq, int heads,
                                 int kv_heads, int head_dim, float scale, AttentionMask batch_mask) {
  constexpr int kLd = kLd32<kD>;
  extern __shared__ __align__(16) float smem32[];
  float* q_s = smem32;
  float* k_s = q_s + kTile * kLd;
  float* v_s = k_s + kTile * kLd;
  float* p_s = v_s + kTile * kLd;  // [32][33]
  const int64_t q_tile = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (heads / kv_heads);
  const int64_t q0 = q_tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t q_base = b * seq * q_stride + static_cast<int64_t>(h) * head_dim;
  const int64_t kv_base = b * kv_seq * kv_stride + static_cast<int64_t>(kh) * head_dim;
  load_tile32<kD>(q_s, q + q_base, q_stride, q0, seq, head_dim);
  const int r = threadIdx.x / 4, t = threadIdx.x % 4;
  const int64_t query = q0 + r;
  float o[kD / 4];
#pragma unroll
  for (int cc = 0; cc < kD / 4; ++cc) o[cc] = 0.0f;
  // A sink is a key of score `sink` with no value: the running max starts
  // there and the running sum at its exp(sink - sink) = 1.
  const bool has_sink = batch_mask.sinks != nullptr;
  float row_max = has_sink ? batch_mask.sinks[h] : -INFINITY, row_sum = has_sink ? 1.0f : 0.0f;
  const AttentionMask mask = batch_mask.row(static_cast<int64_t>(b) * batch_mask.seq);
  // This row's keys [keys.first, keys.last) of the key block (none for a
  // padding row), and the key tiles some row of the tile sees.
  const BlockRange keys = query < seq ? visible_block_keys(mask, query, kv_seq) : BlockRange{0, 0};
  const BlockRange tile_keys = tile_block_keys(mask, q0, min(q0 + kTile, seq), kv_seq);
  const int64_t key_tiles = tile_keys.last > tile_keys.first ? (tile_keys.last + kTile - 1) / kTile : 0;
  for (int64_t kt = tile_keys.first / kTile; kt < key_tiles; ++kt) {
    const int64_t k0 = kt * kTile;
    __syncthreads();  // previous tile's readers are done (first: nothing)
    load_tile32<kD>(k_s, k + kv_base, kv_stride, k0, kv_seq, head_dim);
    load_tile32<kD>(v_s, v + kv_base, kv_stride, k0, kv_seq, head_dim);
    __syncthreads();
    float s[kPerThread];
    float tile_max = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < kPerThread; ++jj) {
      const int j = t + 4 * jj;
      const int64_t key = k0 + j;
      s[jj] = key >= keys.first && key < keys.last
                  ? attention_score(mask, dot_rows<kD>(q_s + r * kLd, k_s + j * kLd) * scale)
                  : -INFINITY;
      tile_max = fmaxf(tile_max, s[jj]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(row_max, tile_max);
    const float offset = new_max == -INFINITY ? 0.0f : new_max;
    const float alpha = expf(row_max - offset);
    float tile_sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kPerThread; ++jj) {
      const float p = expf(s[jj] - offset);
      p_s[r * kPLd + t + 4 * jj] = p;
      tile_sum += p;
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
    row_sum = row_sum * alpha + tile_sum;
    row_max = new_max;
    __syncwarp();  // the row's 4 threads share p_s[r]
#pragma unroll
    for (int cc = 0; cc < kD / 4; ++cc) o[cc] *= alpha;
    for (int j = 0; j < kTile; ++j) {
      const float p = p_s[r * kPLd + j];
#pragma unroll
      for (int cc = 0; cc < kD / 4; ++cc) o[cc] += p * v_s[j * kLd + t + 4 * cc];
    }
  }
  if (query < seq) {
    // A row that saw no key (and has no sink): out 0, lse -inf.
    const float inv = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    float* out_row = out + q_base + query * q_stride;
#pragma unroll
    for (int cc = 0; cc < kD / 4; ++cc) {
      const int c = t + 4 * cc;
      if (c < head_dim) out_row[c] = o[cc] * inv;
    }
    if (t == 0)
      lse[(static_cast<int64_t>(b) * heads + h) * seq + query] = row_sum > 0.0f ? row_max + logf(row_sum) : -INFINITY;
  }
}

template <int kD>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_f32_kernel(const float* __restrict__ dout, const float* __restrict__ q,
                              const float* __restrict__ k, const float* __restrict__ v,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              float* __restrict__ dk, float* __restrict__ dv, int64_t seq,
                              int64_t kv_seq, int heads, int kv_heads, int head_dim, float scale,
                              AttentionMask batch_mask) {
  constexpr int kLd = kLd32<kD>;
  extern __shared__ __align__(16) float smem32[];
  float* k_s = smem32;
  float* v_s = k_s + kTile * kLd;
  float* q_s = v_s + kTile * kLd;
  float* do_s = q_s + kTile * kLd;
  float* lse_s = do_s + kTile * kLd;
  float* delta_s = lse_s + kTile;
  float* p_s = delta_s + kTile;      // P^T [key][query]
  float* ds_s = p_s + kTile * kPLd;  // dS^T
  const int64_t key_tile = blockIdx.x;
  const int kh = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
  const int64_t k0 = key_tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t kv_base = b * kv_seq * kv_stride + static_cast<int64_t>(kh) * head_dim;
  load_tile32<kD>(k_s, k + kv_base, kv_stride, k0, kv_seq, head_dim);
  load_tile32<kD>(v_s, v + kv_base, kv_stride, k0, kv_seq, head_dim);
  const int j = threadIdx.x / 4, t = threadIdx.x % 4;
  const int64_t key = k0 + j;
  float dk_acc[kD / 4], dv_acc[kD / 4];
#pragma unroll
  for (int cc = 0; cc < kD / 4; ++cc) dk_acc[cc] = dv_acc[cc] = 0.0f;
  const AttentionMask mask = batch_mask.row(static_cast<int64_t>(b) * batch_mask.seq);
  // The queries that see this row's key (none for a padding row), and the
  // query tiles that see some key of the tile (the others are skipped).
  const BlockRange queries = key < kv_seq ? seeing_block_queries(mask, key, seq) : BlockRange{0, 0};
  const BlockRange tile_queries = tile_seeing_queries(mask, k0, min(k0 + kTile, kv_seq), seq);
  const int64_t q_tiles =
      tile_queries.last > tile_queries.first ? (tile_queries.last + kTile - 1) / kTile : 0;
  for (int hi = 0; hi < group; ++hi) {
    const int h = kh * group + hi;
    const int64_t q_base = b * seq * q_stride + static_cast<int64_t>(h) * head_dim;
    const int64_t row_offset = (static_cast<int64_t>(b) * heads + h) * seq;
    for (int64_t qt = tile_queries.first / kTile; qt < q_tiles; ++qt) {
      const int64_t q0 = qt * kTile;
      __syncthreads();
      load_tile32<kD>(q_s, q + q_base, q_stride, q0, seq, head_dim);
      load_tile32<kD>(do_s, dout + q_base, q_stride, q0, seq, head_dim);
      for (int i = threadIdx.x; i < kTile; i += kThreads) {
        lse_s[i] = q0 + i < seq ? lse[row_offset + q0 + i] : 0.0f;
        delta_s[i] = q0 + i < seq ? delta[row_offset + q0 + i] : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int ii = 0; ii < kPerThread; ++ii) {
        const int i = t + 4 * ii;
        const int64_t query = q0 + i;
        float p = 0.0f, ds = 0.0f;
        if (query >= queries.first && query < queries.last) {
          const float s = dot_rows<kD>(k_s + j * kLd, q_s + i * kLd);
          const float dp = dot_rows<kD>(v_s + j * kLd, do_s + i * kLd);
          const float capped = attention_score(mask, s * scale);
          p = expf(capped - lse_s[i]);
          ds = p * (dp - delta_s[i]) * attention_score_slope(mask, capped);
        }
        p_s[j * kPLd + i] = p;
        ds_s[j * kPLd + i] = ds;
      }
      __syncwarp();
      for (int i = 0; i < kTile; ++i) {
        const float p = p_s[j * kPLd + i], ds = ds_s[j * kPLd + i];
#pragma unroll
        for (int cc = 0; cc < kD / 4; ++cc) {
          dv_acc[cc] += p * do_s[i * kLd + t + 4 * cc];
          dk_acc[cc] += ds * q_s[i * kLd + t + 4 * cc];
        }
      }
    }
  }
  if (key < kv_seq) {
    float* dk_row = dk + kv_base + key * kv_stride;
    float* dv_row = dv + kv_base + key * kv_stride;
#pragma unroll
    for (int cc = 0; cc < kD / 4; ++cc) {
      const int c = t + 4 * cc;
      if (c < head_dim) {
        dk_row[c] = dk_acc[cc] * scale;
        dv_row[c] = dv_acc[cc];
      }
    }
  }
}

template <int kD>
__global__ void __launch_bounds__(kThreads)
    attention_dq_f32_kernel(const float* __restrict__ dout, const float* __restrict__ q,
                            const float* __restrict__ k, const float* __restrict__ v,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            float* __restrict__ dq, int64_t seq, int64_t kv_seq, int heads,
                            int kv_heads, int head_dim, float scale, AttentionMask batch_mask) {
  constexpr int kLd = kLd32<kD>;
  extern __shared__ __align__(16) float smem32[];
  float* q_s = smem32;
  float* do_s = q_s + kTile * kLd;
  float* k_s = do_s + kTile * kLd;
  float* v_s = k_s + kTile * kLd;
  float* ds_s = v_s + kTile * kLd;  // [query][key]
  const int64_t q_tile = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (heads / kv_heads);
  const int64_t q0 = q_tile * kTile;
  const int64_t q_stride = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t q_base = b * seq * q_stride + static_cast<int64_t>(h) * head_dim;
  const int64_t kv_base = b * kv_seq * kv_stride + static_cast<int64_t>(kh) * head_dim;
  load_tile32<kD>(q_s, q + q_base, q_stride, q0, seq, head_dim);
  load_tile32<kD>(do_s, dout + q_base, q_stride, q0, seq, head_dim);
  const int i = threadIdx.x / 4, t = threadIdx.x % 4;
  const int64_t query = q0 + i;
  const int64_t row = (static_cast<int64_t>(b) * heads + h) * seq + query;
  const float row_lse = query < seq ? lse[row] : 0.0f;
  const float row_delta = query < seq ? delta[row] : 0.0f;
  float dq_acc[kD / 4];
#pragma unroll
  for (int cc = 0; cc < kD / 4; ++cc) dq_acc[cc] = 0.0f;
  const AttentionMask mask = batch_mask.row(static_cast<int64_t>(b) * batch_mask.seq);
  const BlockRange keys = query < seq ? visible_block_keys(mask, query, kv_seq) : BlockRange{0, 0};
  const BlockRange tile_keys = tile_block_keys(mask, q0, min(q0 + kTile, seq), kv_seq);
  const int64_t key_tiles = tile_keys.last > tile_keys.first ? (tile_keys.last + kTile - 1) / kTile : 0;
  for (int64_t kt = tile_keys.first / kTile; kt < key_tiles; ++kt) {
    const int64_t k0 = kt * kTile;
    __syncthreads();
    load_tile32<kD>(k_s, k + kv_base, kv_stride, k0, kv_seq, head_dim);
    load_tile32<kD>(v_s, v + kv_base, kv_stride, k0, kv_seq, head_dim);
    __syncthreads();
#pragma unroll
    for (int jj = 0; jj < kPerThread; ++jj) {
      const int j = t + 4 * jj;
      const int64_t key = k0 + j;
      float ds = 0.0f;
      if (key >= keys.first && key < keys.last) {
        const float s = dot_rows<kD>(q_s + i * kLd, k_s + j * kLd);
        const float dp = dot_rows<kD>(do_s + i * kLd, v_s + j * kLd);
        const float capped = attention_score(mask, s * scale);
        ds = expf(capped - row_lse) * (dp - row_delta) * attention_score_slope(mask, capped);
      }
      ds_s[i * kPLd + j] = ds;
    }
    __syncwarp();
    for (int j = 0; j < kTile; ++j) {
      const float ds = ds_s[i * kPLd + j];
#pragma unroll
      for (int cc = 0; cc < kD / 4; ++cc) dq_acc[cc] += ds * k_s[j * kLd + t + 4 * cc];
    }
  }
  if (query < seq) {
    float* dq_row = dq + q_base + query * q_stride;
#pragma unroll
    for (int cc = 0; cc < kD / 4; ++cc) {
      const int c = t + 4 * cc;
      if (c < head_dim) dq_row[c] = dq_acc[cc] * scale;
    }
  }
}

template <int kD>
constexpr size_t kForwardSmem = (3 * size_t{kTile} * kLd32<kD> + size_t{kTile} * kPLd) * 4;
template <int kD>
constexpr size_t kDkdvSmem = (4 * size_t{kTile} * kLd32<kD> + 2 * size_t{kTile} +
                              2 * size_t{kTile} * kPLd) *
                             4;
template <int kD>
constexpr size_t kDqSmem = (4 * size_t{kTile} * kLd32<kD> + size_t{kTile} * kPLd) * 4;

template <typename K>
cudaError_t allow_smem(K kernel, size_t nbytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(nbytes));
}

template <int kD>
cudaError_t forward(const float* q, const float* k, const float* v, const AttentionDims& d,
                    float* out, float* lse, cudaStream_t stream) {
  auto kernel = attention_forward_f32_kernel<kD>;
  const cudaError_t status = allow_smem(kernel, kForwardSmem<kD>);
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>((d.seq + kTile - 1) / kTile),
                  static_cast<unsigned>(d.heads), static_cast<unsigned>(d.batch));
  const auto scale = static_cast<float>(attention_scale(d.mask, d.head_dim));
  kernel<<<grid, kThreads, kForwardSmem<kD>, stream>>>(
      q, k, v, out, lse, d.seq, d.keys(), static_cast<int>(d.heads), static_cast<int>(d.kv_heads),
      static_cast<int>(d.head_dim), scale, kernel_mask(d));
  return cudaGetLastError();
}

template <int kD>
cudaError_t backward(const float* dout, const float* q, const float* k, const float* v,
                     const float* lse, const float* delta, const AttentionDims& d, float* dq,
                     float* dk, float* dv, cudaStream_t stream) {
  auto dkdv = attention_dkdv_f32_kernel<kD>;
  auto dq_kernel = attention_dq_f32_kernel<kD>;
  cudaError_t status = allow_smem(dkdv, kDkdvSmem<kD>);
  if (status == cudaSuccess) status = allow_smem(dq_kernel, kDqSmem<kD>);
  if (status != cudaSuccess) return status;
  const unsigned q_tiles = static_cast<unsigned>((d.seq + kTile - 1) / kTile);
  const unsigned kv_tiles = static_cast<unsigned>((d.keys() + kTile - 1) / kTile);
  const auto scale = static_cast<float>(attention_scale(d.mask, d.head_dim));
  const int heads = static_cast<int>(d.heads), kv_heads = static_cast<int>(d.kv_heads);
  const int head_dim = static_cast<int>(d.head_dim);
  dkdv<<<dim3(kv_tiles, static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(d.batch)), kThreads,
         kDkdvSmem<kD>, stream>>>(dout, q, k, v, lse, delta, dk, dv, d.seq, d.keys(), heads, kv_heads,
                                  head_dim, scale, kernel_mask(d));
  dq_kernel<<<dim3(q_tiles, static_cast<unsigned>(d.heads), static_cast<unsigned>(d.batch)), kThreads,
              kDqSmem<kD>, stream>>>(dout, q, k, v, lse, delta, dq, d.seq, d.keys(), heads, kv_heads,
                                     head_dim, scale, kernel_mask(d));
  return cudaGetLastError();
}

}  // namespace

cudaError_t attention_forward_f32(const float* q, const float* k, const float* v,
                                  const AttentionDims& dims, float* out, float* lse,
                                  cudaStream_t stream) {
  if (dims.head_dim <= 64) return forward<64>(q, k, v, dims, out, lse, stream);
  return forward<128>(q, k, v, dims, out, lse, stream);
}

cudaError_t attention_backward_f32(const float* dout, const float* q, const float* k,
                                   const float* v, const float* lse, const float* delta,
                                   const AttentionDims& dims, float* dq, float* dk, float* dv,
                                   cudaStream_t stream) {
  if (dims.head_dim <= 64) return backward<64>(dout, q, k, v, lse, delta, dims, dq, dk, dv, stream);
  return backward<128>(dout, q, k, v, lse, delta, dims, dq, dk, dv, stream);
}

}  // namespace strata::ops::cuda
