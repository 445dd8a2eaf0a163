// Causal GQA attention backward for fp16/bf16 on tensor cores (WMMA 16x16x16,
// fp32 accumulation), FlashAttention-2 style without atomics:
//  - dK/dV: one block per (64-key tile, kv head [, head split], batch); 4
//    warps of 16 keys keep dK, dV in accumulator registers while looping over
//    the group's query heads and the query tiles at or after the key tile.
//  - dQ: one block per (64-query tile, head, batch); 4 warps of 16 queries
//    loop over the key tiles up to the diagonal, recomputing P.
// A sliding window, packed documents and a key block of its own (kv_seq keys
// at global offsets; attention_mask.h, attention_block_ranges.h) skip the
// tiles no row of the block's tile reaches and mask per element inside. Sinks
// need nothing here: the lse they joined gives every P. Design, tiling and
// shared-memory budget: attention.cu.
#include "kernels/cuda/attention_tc.cuh"

namespace strata::ops::cuda {
namespace {

using namespace attn;

constexpr int kBwdWarps = 4;
constexpr int kBwdThreads = 32 * kBwdWarps;
constexpr int kBwdTile = kRowsPerWarp * kBwdWarps;  // 64 keys or queries per block
static_assert(kBwdTile == kKeyTile, "inner tiles are as wide as the block's own tile");
constexpr float kLog2e = 1.4426950408889634f;

template <int kD>
struct BwdSmem {
  static constexpr int kLd = kTileLd<kD>;
  static constexpr size_t kTileBytes = size_t{kBwdTile} * kLd * 2;
  // Tiles 0, 1: the block's own rows (K, V or Q, dO), loaded once.
  // Tiles 2, 3: the rows of the current step (Q, dO or K, V).
  static constexpr size_t kRowVecOffset = 4 * kTileBytes;  // lse [64], delta [64]
  static constexpr size_t kScoreOffset = kRowVecOffset + 2 * kBwdTile * 4;
  static constexpr size_t kProbOffset =
      kScoreOffset + size_t{kBwdWarps} * kRowsPerWarp * kScoreLd * 4;
  static constexpr size_t kBytes = kProbOffset + size_t{kBwdWarps} * kRowsPerWarp * kProbLd * 2;
};

// S = A_w B^T for the warp's 16 rows of `a` (shared tile) against 16-row
// groups [n_begin, n_end) of `b` (shared tile), stored fp32 to s_w.
template <typename T, int kD>
__device__ __forceinline__ void scores(const T* a_rows, const T* b_tile, int n_begin, int n_end,
                                       float* s_w) {
  constexpr int kLd = kTileLd<kD>;
  for (int n = n_begin; n < n_end; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      FragA<T> a;
      FragBCol<T> bt;  // B^T: element (d, row) at b_tile[row * kLd + d]
      wmma::load_matrix_sync(a, a_rows + kk * 16, kLd);
      wmma::load_matrix_sync(bt, b_tile + n * 16 * kLd + kk * 16, kLd);
      wmma::mma_sync(acc, a, bt, acc);
    }
    wmma::store_matrix_sync(s_w + n * 16, acc, kScoreLd, wmma::mem_row_major);
  }
}

// acc[f] += P_w C for 16-column groups [k_begin, k_end) of the warp's 16-bit
// [16][kProbLd] matrix p_w and the rows of shared tile c.
template <typename T, int kD>
__device__ __forceinline__ void accumulate(FragC (&acc)[kD / 16], const T* p_w, const T* c_tile,
                                           int k_begin, int k_end) {
  constexpr int kLd = kTileLd<kD>;
  for (int kk = k_begin; kk < k_end; ++kk) {
    FragA<T> a;
    wmma::load_matrix_sync(a, p_w + kk * 16, kProbLd);
#pragma unroll
    for (int f = 0; f < kD / 16; ++f) {
      FragBRow<T> b;
      wmma::load_matrix_sync(b, c_tile + kk * 16 * kLd + f * 16, kLd);
      wmma::mma_sync(acc[f], a, b, acc[f]);
    }
  }
}

// dK, dV of one 64-key tile. blockIdx.y = kv_head * splits + split: the block
// handles query heads [split * heads_per_block, ...) of the kv head's group.
// With splits == 1 it writes dk/dv (storage T); otherwise fp32 partial sums to
// dk_part/dv_part [splits][batch, seq, kv_heads, head_dim], added up by
// dkdv_reduce_kernel in a fixed order.
template <typename T, int kD>
__global__ void __launch_bounds__(kBwdThreads)
    attention_dkdv_tc_kernel(const T* __restrict__ dout, const T* __restrict__ q,
                             const T* __restrict__ k, const T* __restrict__ v,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dk_part,
                             float* __restrict__ dv_part, int seq, int kv_seq, int heads, int kv_heads,
                             int head_dim, int splits, float scale, float scale_log2, bool vec,
                             AttentionMask batch_mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Smem = BwdSmem<kD>;
  constexpr int kLd = Smem::kLd;
  constexpr int kFrags = kD / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  T* k_s = reinterpret_cast<T*>(smem);
  T* v_s = reinterpret_cast<T*>(smem + Smem::kTileBytes);
  T* q_s = reinterpret_cast<T*>(smem + 2 * Smem::kTileBytes);
  T* do_s = reinterpret_cast<T*>(smem + 3 * Smem::kTileBytes);
  float* lse_s = reinterpret_cast<float*>(smem + Smem::kRowVecOffset);
  float* delta_s = lse_s + kBwdTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_w = reinterpret_cast<float*>(smem + Smem::kScoreOffset) + warp * kRowsPerWarp * kScoreLd;
  T* p_w = reinterpret_cast<T*>(smem + Smem::kProbOffset) + warp * kRowsPerWarp * kProbLd;

  const int key_tile = blockIdx.x;
  const int kh = blockIdx.y / splits, split = blockIdx.y % splits;
  const int b = blockIdx.z;
  const int group = heads / kv_heads, heads_per_block = group / splits;
  const int k0 = key_tile * kBwdTile;
  const int64_t q_stride = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t kv_base =
      static_cast<int64_t>(b) * kv_seq * kv_stride + static_cast<int64_t>(kh) * head_dim;
  load_tile<T, kBwdTile, kD, kBwdThreads>(k_s, k + kv_base, kv_stride, k0, kv_seq, head_dim, vec);
  load_tile<T, kBwdTile, kD, kBwdThreads>(v_s, v + kv_base, kv_stride, k0, kv_seq, head_dim, vec);

  FragC dk_acc[kFrags], dv_acc[kFrags];
#pragma unroll
  for (int f = 0; f < kFrags; ++f) {
    wmma::fill_fragment(dk_acc[f], 0.0f);
    wmma::fill_fragment(dv_acc[f], 0.0f);
  }
  const int warp_key0 = k0 + warp * kRowsPerWarp;
  const int r = lane / 2;
  const int key = warp_key0 + r;
  const AttentionMask mask = batch_mask.row(static_cast<int64_t>(b) * batch_mask.seq);
  // The queries [first_query, last_query) that see this row's key (none for a
  // padding row), those that see some key of the warp's 16 (none when all are
  // padding), and the query tiles that see some key of the block's tile (the
  // others are skipped).
  const BlockRange row_queries = key < kv_seq ? seeing_block_queries(mask, key, seq) : BlockRange{0, 0};
  const int first_query = static_cast<int>(row_queries.first), last_query = static_cast<int>(row_queries.last);
  const BlockRange warp_queries =
      warp_key0 < kv_seq ? tile_seeing_queries(mask, warp_key0, min(warp_key0 + kRowsPerWarp, kv_seq), seq)
                         : BlockRange{0, 0};
  const BlockRange tile_queries = tile_seeing_queries(mask, k0, min(k0 + kBwdTile, kv_seq), seq);
  const int q_tiles = tile_queries.last > tile_queries.first
                          ? static_cast<int>((tile_queries.last + kBwdTile - 1) / kBwdTile) : 0;
  const T* k_rows = k_s + warp * kRowsPerWarp * kLd;
  const T* v_rows = v_s + warp * kRowsPerWarp * kLd;
  const float* s_row = s_w + r * kScoreLd;
  T* p_row = p_w + r * kProbLd;

  for (int hi = 0; hi < heads_per_block; ++hi) {
    const int h = kh * group + split * heads_per_block + hi;
    const int64_t q_base =
        static_cast<int64_t>(b) * seq * q_stride + static_cast<int64_t>(h) * head_dim;
    const int64_t row_offset = (static_cast<int64_t>(b) * heads + h) * seq;
    // Query tiles before the first query that sees the tile's first key see
    // none of its keys (causal).
    for (int qt = static_cast<int>(tile_queries.first) / kBwdTile; qt < q_tiles; ++qt) {
      const int q0 = qt * kBwdTile;
      __syncthreads();  // the previous step is done with q_s, do_s, lse_s, delta_s
      load_tile<T, kBwdTile, kD, kBwdThreads>(q_s, q + q_base, q_stride, q0, seq, head_dim, vec);
      load_tile<T, kBwdTile, kD, kBwdThreads>(do_s, dout + q_base, q_stride, q0, seq, head_dim,
                                              vec);
      load_row_vector<kBwdTile, kBwdThreads>(lse_s, lse + row_offset, q0, seq, kLog2e);
      load_row_vector<kBwdTile, kBwdThreads>(delta_s, delta + row_offset, q0, seq, 1.0f);
      __syncthreads();
      // Query groups (16 queries) of this tile that see any of the warp's
      // keys: from the one holding the warp's first seeing query to the one
      // holding its last (which is before seq).
      if (warp_queries.last <= warp_queries.first || warp_queries.first >= q0 + kBwdTile ||
          warp_queries.last <= q0)
        continue;  // warp-uniform
      const int n_first = warp_queries.first > q0 ? static_cast<int>(warp_queries.first - q0) / 16 : 0;
      const int n_end = (static_cast<int>(min(warp_queries.last, static_cast<int64_t>(q0 + kBwdTile))) - q0 + 15) / 16;

      // P^T = exp(K Q^T * scale - lse) for the warp's keys (rows) and the
      // tile's queries (columns), in registers (fp32) and in p_w (16-bit).
      // Column c (query q0 + c) is visible iff it is in a computed group and
      // among the queries that see this row's key [first_query, last_query)
      // (which end before seq): c_lo <= c < c_hi.
      scores<T, kD>(k_rows, q_s, n_first, n_end, s_w);
      __syncwarp();
      const int c_lo = max(n_first * 16, first_query - q0);
      const int c_hi = min(n_end * 16, last_query - q0);
      float p[32];
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int c = pair_col(e, lane);
        const float2 sv = capped_pair(batch_mask, scale, load_pair(s_row, c));
        p[2 * e] = c >= c_lo && c < c_hi ? exp2f(sv.x * scale_log2 - lse_s[c]) : 0.0f;
        p[2 * e + 1] =
            c + 1 >= c_lo && c + 1 < c_hi ? exp2f(sv.y * scale_log2 - lse_s[c + 1]) : 0.0f;
        store_pair(p_row, c, p[2 * e], p[2 * e + 1]);
      }
      __syncwarp();
      accumulate<T, kD>(dv_acc, p_w, do_s, n_first, n_end);  // dV += P^T dO
      // dP^T = V dO^T, then dS^T = P^T * (dP^T - delta) into p_w.
      scores<T, kD>(v_rows, do_s, n_first, n_end, s_w);
      __syncwarp();  // also: every lane's P fragment loads are done before p_w is rewritten
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int c = pair_col(e, lane);
        const float2 dp = load_pair(s_row, c);
        // p == 0 covers masked columns, whose s_w entries may be stale.
        const float ds0 = p[2 * e] != 0.0f ? p[2 * e] * (dp.x - delta_s[c]) *
                                                 capped_slope(batch_mask, p[2 * e], lse_s[c], scale_log2)
                                           : 0.0f;
        const float ds1 = p[2 * e + 1] != 0.0f ? p[2 * e + 1] * (dp.y - delta_s[c + 1]) *
                                                     capped_slope(batch_mask, p[2 * e + 1], lse_s[c + 1], scale_log2)
                                               : 0.0f;
        store_pair(p_row, c, ds0, ds1);
      }
      __syncwarp();
      accumulate<T, kD>(dk_acc, p_w, q_s, n_first, n_end);  // dK += dS^T Q (scaled at the end)
    }
  }
  __syncwarp();
  if (splits == 1) {
    store_rows<T, kD>(dk_acc, s_w, dk + kv_base, kv_stride, warp_key0, kv_seq, head_dim, scale);
    store_rows<T, kD>(dv_acc, s_w, dv + kv_base, kv_stride, warp_key0, kv_seq, head_dim, 1.0f);
  } else {
    const int64_t part = static_cast<int64_t>(split) * gridDim.z * kv_seq * kv_stride;
    store_rows<float, kD>(dk_acc, s_w, dk_part + part + kv_base, kv_stride, warp_key0, kv_seq,
                          head_dim, scale);
    store_rows<float, kD>(dv_acc, s_w, dv_part + part + kv_base, kv_stride, warp_key0, kv_seq,
                          head_dim, 1.0f);
  }
#endif
}

// out[i] = sum over splits of part[s * n + i], in split order.
template <typename T>
__global__ void dkdv_reduce_kernel(const float* part, int splits, int64_t n, T* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) total += part[s * n + i];
    out[i] = from_f<T>(total);
  }
}

// dQ of one 64-query tile of one head.
template <typename T, int kD>
__global__ void __launch_bounds__(kBwdThreads)
    attention_dq_tc_kernel(const T* __restrict__ dout, const T* __restrict__ q,
                           const T* __restrict__ k, const T* __restrict__ v,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           T* __restrict__ dq, int seq, int kv_seq, int heads, int kv_heads, int head_dim,
                           float scale, float scale_log2, bool vec, AttentionMask batch_mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Smem = BwdSmem<kD>;
  constexpr int kLd = Smem::kLd;
  constexpr int kFrags = kD / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* do_s = reinterpret_cast<T*>(smem + Smem::kTileBytes);
  T* k_s = reinterpret_cast<T*>(smem + 2 * Smem::kTileBytes);
  T* v_s = reinterpret_cast<T*>(smem + 3 * Smem::kTileBytes);
  float* lse_s = reinterpret_cast<float*>(smem + Smem::kRowVecOffset);
  float* delta_s = lse_s + kBwdTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_w = reinterpret_cast<float*>(smem + Smem::kScoreOffset) + warp * kRowsPerWarp * kScoreLd;
  T* ds_w = reinterpret_cast<T*>(smem + Smem::kProbOffset) + warp * kRowsPerWarp * kProbLd;

  const int q_tile = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // longest first
  const int h = blockIdx.y, b = blockIdx.z;
  const int kh = h / (heads / kv_heads);
  const int q0 = q_tile * kBwdTile;
  const int64_t q_stride = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t q_base =
      static_cast<int64_t>(b) * seq * q_stride + static_cast<int64_t>(h) * head_dim;
  const int64_t kv_base =
      static_cast<int64_t>(b) * kv_seq * kv_stride + static_cast<int64_t>(kh) * head_dim;
  const int64_t row_offset = (static_cast<int64_t>(b) * heads + h) * seq;
  load_tile<T, kBwdTile, kD, kBwdThreads>(q_s, q + q_base, q_stride, q0, seq, head_dim, vec);
  load_tile<T, kBwdTile, kD, kBwdThreads>(do_s, dout + q_base, q_stride, q0, seq, head_dim, vec);
  load_row_vector<kBwdTile, kBwdThreads>(lse_s, lse + row_offset, q0, seq, kLog2e);
  load_row_vector<kBwdTile, kBwdThreads>(delta_s, delta + row_offset, q0, seq, 1.0f);

  FragC dq_acc[kFrags];
#pragma unroll
  for (int f = 0; f < kFrags; ++f) wmma::fill_fragment(dq_acc[f], 0.0f);
  const int warp_row0 = q0 + warp * kRowsPerWarp;
  const int r = lane / 2;
  const int query = warp_row0 + r;
  const T* q_rows = q_s + warp * kRowsPerWarp * kLd;
  const T* do_rows = do_s + warp * kRowsPerWarp * kLd;
  const float* s_row = s_w + r * kScoreLd;
  T* ds_row = ds_w + r * kProbLd;
  const AttentionMask mask = batch_mask.row(static_cast<int64_t>(b) * batch_mask.seq);
  const WarpKeys keys = warp_keys<kBwdTile>(mask, q0, warp_row0, query, seq, kv_seq);

  for (int kt = keys.tile_begin; kt < keys.tile_end; ++kt) {
    const int k0 = kt * kBwdTile;
    __syncthreads();  // the previous step is done with k_s, v_s (first: q_s etc. are loaded)
    load_tile<T, kBwdTile, kD, kBwdThreads>(k_s, k + kv_base, kv_stride, k0, kv_seq, head_dim, vec);
    load_tile<T, kBwdTile, kD, kBwdThreads>(v_s, v + kv_base, kv_stride, k0, kv_seq, head_dim, vec);
    __syncthreads();
    const int n_cols = keys.groups(k0);
    if (n_cols == 0) continue;  // warp-uniform
    // Column c (key k0 + c) is visible iff computed and in the row's keys
    // [keys.first, keys.last) (which end before kv_seq): lo <= c < visible.
    const int visible = min(n_cols * 16, keys.last - k0);
    const int lo = max(0, keys.first - k0);

    scores<T, kD>(q_rows, k_s, 0, n_cols, s_w);  // S = Q K^T
    __syncwarp();
    const float row_lse = lse_s[warp * kRowsPerWarp + r];
    const float row_delta = delta_s[warp * kRowsPerWarp + r];
    float p[32];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int c = pair_col(e, lane);
      const float2 sv = capped_pair(batch_mask, scale, load_pair(s_row, c));
      p[2 * e] = c >= lo && c < visible ? exp2f(sv.x * scale_log2 - row_lse) : 0.0f;
      p[2 * e + 1] = c + 1 >= lo && c + 1 < visible ? exp2f(sv.y * scale_log2 - row_lse) : 0.0f;
    }
    __syncwarp();                                 // S is read; s_w takes dP next
    scores<T, kD>(do_rows, v_s, 0, n_cols, s_w);  // dP = dO V^T
    __syncwarp();
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int c = pair_col(e, lane);
      const float2 dp = load_pair(s_row, c);
      const float ds0 =
          p[2 * e] != 0.0f ? p[2 * e] * (dp.x - row_delta) * capped_slope(batch_mask, p[2 * e], row_lse, scale_log2)
                           : 0.0f;
      const float ds1 = p[2 * e + 1] != 0.0f ? p[2 * e + 1] * (dp.y - row_delta) *
                                                   capped_slope(batch_mask, p[2 * e + 1], row_lse, scale_log2)
                                             : 0.0f;
      store_pair(ds_row, c, ds0, ds1);
    }
    __syncwarp();
    accumulate<T, kD>(dq_acc, ds_w, k_s, 0, n_cols);  // dQ += dS K (scaled at the end)
  }
  __syncwarp();
  store_rows<T, kD>(dq_acc, s_w, dq + q_base, q_stride, warp_row0, seq, head_dim, scale);
#endif
}

template <typename K>
cudaError_t allow_smem(K kernel, size_t nbytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(nbytes));
}

template <typename T, int kD>
cudaError_t launch_backward(const T* dout, const T* q, const T* k, const T* v, const float* lse,
                            const float* delta, const AttentionDims& d, T* dq, T* dk, T* dv,
                            float* partial, int splits, cudaStream_t stream) {
  const size_t smem = BwdSmem<kD>::kBytes;
  auto dkdv = attention_dkdv_tc_kernel<T, kD>;
  auto dq_kernel = attention_dq_tc_kernel<T, kD>;
  cudaError_t status = allow_smem(dkdv, smem);
  if (status == cudaSuccess) status = allow_smem(dq_kernel, smem);
  if (status != cudaSuccess) return status;
  const bool vec =
      d.head_dim % 8 == 0 && aligned16(dout) && aligned16(q) && aligned16(k) && aligned16(v);
  const double scale = attention_scale(d.mask, d.head_dim);
  const auto fscale = static_cast<float>(scale);
  const auto scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const unsigned q_tiles = static_cast<unsigned>((d.seq + kBwdTile - 1) / kBwdTile);
  const unsigned kv_tiles = static_cast<unsigned>((d.keys() + kBwdTile - 1) / kBwdTile);
  const int seq = static_cast<int>(d.seq), kv_seq = static_cast<int>(d.keys()), heads = static_cast<int>(d.heads);
  const int kv_heads = static_cast<int>(d.kv_heads), head_dim = static_cast<int>(d.head_dim);
  const int64_t kv_numel = d.batch * d.keys() * d.kv_heads * d.head_dim;
  float* dk_part = splits > 1 ? partial : nullptr;
  float* dv_part = splits > 1 ? partial + splits * kv_numel : nullptr;
  dkdv<<<dim3(kv_tiles, static_cast<unsigned>(d.kv_heads * splits), static_cast<unsigned>(d.batch)),
         kBwdThreads, smem, stream>>>(dout, q, k, v, lse, delta, dk, dv, dk_part, dv_part, seq,
                                      kv_seq, heads, kv_heads, head_dim, splits, fscale, scale_log2, vec,
                                      kernel_mask(d));
  if (splits > 1) {
    dkdv_reduce_kernel<T>
        <<<grid_for(kv_numel, 256), 256, 0, stream>>>(dk_part, splits, kv_numel, dk);
    dkdv_reduce_kernel<T>
        <<<grid_for(kv_numel, 256), 256, 0, stream>>>(dv_part, splits, kv_numel, dv);
  }
  dq_kernel<<<dim3(q_tiles, static_cast<unsigned>(d.heads), static_cast<unsigned>(d.batch)),
              kBwdThreads, smem, stream>>>(dout, q, k, v, lse, delta, dq, seq, kv_seq, heads, kv_heads,
                                           head_dim, fscale, scale_log2, vec, kernel_mask(d));
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_for(const void* dout, const void* q, const void* k, const void* v,
                         const float* lse, const float* delta, const AttentionDims& d, void* dq,
                         void* dk, void* dv, float* partial, int splits, cudaStream_t stream) {
  const auto* a = static_cast<const T*>(dout);
  const auto* tq = static_cast<const T*>(q);
  const auto* tk = static_cast<const T*>(k);
  const auto* tv = static_cast<const T*>(v);
  auto* gq = static_cast<T*>(dq);
  auto* gk = static_cast<T*>(dk);
  auto* gv = static_cast<T*>(dv);
  if (d.head_dim <= 64)
    return launch_backward<T, 64>(a, tq, tk, tv, lse, delta, d, gq, gk, gv, partial, splits,
                                  stream);
  return launch_backward<T, 128>(a, tq, tk, tv, lse, delta, d, gq, gk, gv, partial, splits, stream);
}

}  // namespace

int attention_dkdv_splits(const AttentionDims& d, int sm_count) {
  // Split a kv head's query heads over several blocks (fp32 partial sums,
  // reduced in order) only when the plain grid would leave SMs idle: GQA with
  // few kv heads and a small batch.
  const int64_t group = d.heads / d.kv_heads;
  const int64_t blocks = (d.keys() + kBwdTile - 1) / kBwdTile * d.kv_heads * d.batch;
  int splits = 1;
  while (blocks * splits < 2 * static_cast<int64_t>(sm_count) && group % (2 * splits) == 0)
    splits *= 2;
  return splits;
}

cudaError_t attention_backward_tc(Storage t, const void* dout, const void* q, const void* k,
                                  const void* v, const float* lse, const float* delta,
                                  const AttentionDims& dims, void* dq, void* dk, void* dv,
                                  float* partial, int splits, cudaStream_t stream) {
  if (t == Storage::kBF16)
    return backward_for<__nv_bfloat16>(dout, q, k, v, lse, delta, dims, dq, dk, dv, partial, splits,
                                       stream);
  if (t == Storage::kF16)
    return backward_for<__half>(dout, q, k, v, lse, delta, dims, dq, dk, dv, partial, splits,
                                stream);
  return cudaErrorInvalidValue;
}

}  // namespace strata::ops::cuda
