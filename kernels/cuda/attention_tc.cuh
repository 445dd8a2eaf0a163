// Internal to the 16-bit attention kernels (attention_tc_forward.cu,
// attention_tc_backward.cu): tile geometry, global->shared tile loads, and the
// WMMA helpers. The tiling and shared-memory budget are documented in
// attention.cu.
#pragma once

#include <mma.h>

#include "kernels/cuda/device.h"

namespace strata::ops::cuda::attn {

namespace wmma = nvcuda::wmma;

// Every warp owns 16 rows (one WMMA M tile); key tiles are 64 wide.
constexpr int kRowsPerWarp = 16;
constexpr int kKeyTile = 64;
// Row strides in shared memory. 16-bit tiles get 8 elements (16 bytes) of
// padding so that consecutive rows start 4 banks apart: the 8 row addresses
// of each ldmatrix phase then hit distinct banks. fp32 score buffers get 4
// floats for the same reason. Both keep every 16x16 fragment 32-byte aligned
// as load/store_matrix_sync require (ld * 2 bytes * 16 rows and 16 columns
// are multiples of 32 bytes).
template <int kD>
constexpr int kTileLd = kD + 8;
constexpr int kScoreLd = kKeyTile + 4;  // fp32 [16][68] per warp
constexpr int kProbLd = kKeyTile + 8;   // 16-bit [16][72] per warp

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// The keys of the key block (attention_block_ranges.h, at global positions)
// that a warp's 16 query rows attend to, in the forward and dQ kernels.
struct WarpKeys {
  int first, last;  // this lane's row: keys [first, last) (none for a padding row)
  BlockRange warp;  // the warp's rows' (none when all of them are padding)
  int tile_begin, tile_end;  // the key tiles some row of the block's query tile sees
  // The 16-key column groups of the key tile at k0 that the warp computes: up
  // to the one holding its last key there (earlier groups it does not see are
  // computed and masked); 0 when it sees none of the tile. Warp-uniform.
  __device__ __forceinline__ int groups(int k0) const {
    if (warp.last <= warp.first || warp.first >= k0 + kKeyTile || warp.last <= k0) return 0;
    return (static_cast<int>(min(warp.last, static_cast<int64_t>(k0 + kKeyTile))) - k0 + 15) / 16;
  }
};
// For query `query` of the warp whose rows start at warp_row0, in the query
// tile of kTileRows rows at q0, of seq queries against kv_seq keys.
template <int kTileRows>
__device__ __forceinline__ WarpKeys warp_keys(const AttentionMask& mask, int q0, int warp_row0, int query, int seq,
                                              int kv_seq) {
  const BlockRange row = query < seq ? visible_block_keys(mask, query, kv_seq) : BlockRange{0, 0};
  const BlockRange warp = warp_row0 < seq ? tile_block_keys(mask, warp_row0, min(warp_row0 + kRowsPerWarp, seq), kv_seq)
                                          : BlockRange{0, 0};
  const BlockRange tile = tile_block_keys(mask, q0, min(q0 + kTileRows, seq), kv_seq);
  const int tile_end = tile.last > tile.first ? static_cast<int>((tile.last + kKeyTile - 1) / kKeyTile) : 0;
  return {static_cast<int>(row.first), static_cast<int>(row.last), warp, static_cast<int>(tile.first) / kKeyTile,
          tile_end};
}

// Loads rows [row0, row0 + kRows) of a [seq, stride] slice into a shared tile
// dst[kRows][kTileLd<kD>]: element (r, c) = src[(row0 + r) * stride + c] for
// c < head_dim, and zero for rows at or beyond seq and for c >= head_dim (so
// padded rows and columns contribute exactly nothing to any product, and no
// uninitialised shared memory - possibly NaN bit patterns - reaches a MMA).
// `vec`: head_dim, stride and src are multiples of 8 elements / 16 bytes.
template <typename T, int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t stride, int64_t row0,
                                          int64_t seq, int head_dim, bool vec) {
  constexpr int kLd = kTileLd<kD>;
  if (vec) {
    constexpr int kChunksPerRow = kD / 8;
    for (int chunk = threadIdx.x; chunk < kRows * kChunksPerRow; chunk += kThreads) {
      const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
      uint4 value = make_uint4(0, 0, 0, 0);
      if (row0 + r < seq && c < head_dim)
        value = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride + c);
      *reinterpret_cast<uint4*>(dst + r * kLd + c) = value;
    }
  } else {
    for (int i = threadIdx.x; i < kRows * kD; i += kThreads) {
      const int r = i / kD, c = i % kD;
      dst[r * kLd + c] =
          row0 + r < seq && c < head_dim ? src[(row0 + r) * stride + c] : from_f<T>(0.0f);
    }
  }
}

// Loads kRows floats of a per-row vector (lse or delta of one (batch, head)),
// multiplied by `factor`; zero beyond seq.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_row_vector(float* dst, const float* src, int64_t row0,
                                                int64_t seq, float factor) {
  for (int i = threadIdx.x; i < kRows; i += kThreads)
    dst[i] = row0 + i < seq ? src[row0 + i] * factor : 0.0f;
}

// rows[i] = the row (0..15) that element i of an fp32 accumulator fragment
// holds. WMMA leaves the element <-> position mapping unspecified but fixed
// for a fragment type, and load_matrix_sync/store_matrix_sync/mma_sync all
// use it; loading a matrix whose entries are their own row numbers reveals
// it. This is what lets an online softmax rescale accumulator rows in
// registers. `scratch` is a warp-private [16][kScoreLd] fp32 buffer.
__device__ __forceinline__ void fragment_rows(float* scratch, int (&rows)[FragC::num_elements]) {
  const int lane = threadIdx.x % 32;
  for (int i = lane; i < 256; i += 32)
    scratch[(i / 16) * kScoreLd + i % 16] = static_cast<float>(i / 16);
  __syncwarp();
  FragC f;
  wmma::load_matrix_sync(f, scratch, kScoreLd, wmma::mem_row_major);
#pragma unroll
  for (int i = 0; i < FragC::num_elements; ++i) rows[i] = static_cast<int>(f.x[i]);
  __syncwarp();
}

// Multiplies every row of the accumulators by factor[row] (warp-private shared).
template <int kFrags>
__device__ __forceinline__ void scale_rows(FragC (&acc)[kFrags], const float* factor,
                                           const int (&rows)[FragC::num_elements]) {
  float f[FragC::num_elements];
#pragma unroll
  for (int i = 0; i < FragC::num_elements; ++i) f[i] = factor[rows[i]];
#pragma unroll
  for (int j = 0; j < kFrags; ++j) {
#pragma unroll
    for (int i = 0; i < FragC::num_elements; ++i) acc[j].x[i] *= f[i];
  }
}

// Gemma 2's soft cap in kernels that fold the scale into exp2 (scale_log2):
// a pair of raw scores q.k replaced by the raw scores whose scaled values are
// the capped ones, so the rest of the kernel runs unchanged. No cap: as given.
__device__ __forceinline__ float2 capped_pair(const AttentionMask& mask, float scale, float2 raw) {
  if (mask.softcap <= 0) return raw;
  return make_float2(attention_score(mask, raw.x * scale) / scale, attention_score(mask, raw.y * scale) / scale);
}

// The cap's derivative for a probability p = exp2(capped * log2(e) - lse2)
// (lse2: the row's log-sum-exp in base 2), recovering the capped score from
// p rather than keeping it in registers; 1 without a cap.
__device__ __forceinline__ float capped_slope(const AttentionMask& mask, float p, float lse2, float /*scale_log2*/) {
  if (mask.softcap <= 0) return 1.0f;
  const float capped = (log2f(p) + lse2) * 0.6931471805599453f;
  return attention_score_slope(mask, capped);
}

// Writes a warp's 16 x kD fp32 accumulators, times `scale`, as 16-bit rows
// dst[(row0 + r) * stride + c] for row0 + r < seq and c < head_dim. Goes through
// the warp's [16][kScoreLd] scratch four fragments (64 columns) at a time; each
// store instruction of the warp then covers 64 consecutive elements of a row.
template <typename T, int kD>
__device__ __forceinline__ void store_rows(FragC (&acc)[kD / 16], float* scratch, T* dst,
                                           int64_t stride, int64_t row0, int64_t seq, int head_dim,
                                           float scale) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int f0 = 0; f0 < kD / 16; f0 += 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(scratch + j * 16, acc[f0 + j], kScoreLd, wmma::mem_row_major);
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      if (row0 + r >= seq) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * lane + e;
        if (f0 * 16 + c < head_dim)
          dst[(row0 + r) * stride + f0 * 16 + c] = from_f<T>(scratch[r * kScoreLd + c] * scale);
      }
    }
    __syncwarp();
  }
}

// Softmax-phase lane mapping of a warp's [16][64] score buffer: lane owns row
// lane / 2 and, for e = 0..15, the column pair c = 4e + 2 (lane % 2) + {0, 1}.
// A half-warp's 8-byte loads then cover 16 distinct bank pairs (kScoreLd = 68
// shifts rows by 4 banks), so reads are conflict-free, and the offsets are
// compile-time constants after unrolling (no per-column address registers).
__device__ __forceinline__ int pair_col(int e, int lane) {
  return 4 * e + 2 * (lane % 2);
}

__device__ __forceinline__ float2 load_pair(const float* row, int c) {
  return *reinterpret_cast<const float2*>(row + c);
}

// Stores (a, b) as the 16-bit pair at row[c], row[c + 1] (c even).
__device__ __forceinline__ void store_pair(__nv_bfloat16* row, int c, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(row + c) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_pair(__half* row, int c, float a, float b) {
  *reinterpret_cast<__half2*>(row + c) = __floats2half2_rn(a, b);
}

}  // namespace strata::ops::cuda::attn
