// Causal GQA attention forward for fp16/bf16 on tensor cores (WMMA 16x16x16,
// fp32 accumulation) with an online softmax: one block per (64-query tile,
// head, batch), 4 warps of 16 query rows, 64-key tiles. Design and shared-
// memory budget: attention.cu. A sliding window, packed documents and a key
// block of its own (attention_mask.h, attention_block_ranges.h) skip the key
// tiles no row of the query tile sees and mask the rest per element; a row
// that sees no key gets out 0 and lse -inf. gpt-oss's sinks start a row's
// running max at the sink and its running sum at 1 (the sink's own term).
#include "kernels/cuda/attention_tc.cuh"

namespace strata::ops::cuda {
namespace {

using namespace attn;

// 4 warps: at ~200 registers per thread two blocks fit on an SM, so one
// block's K/V tile loads overlap the other's tensor-core work (a single 8-warp
// block would stall on every load).
constexpr int kFwdWarps = 4;
constexpr int kFwdThreads = 32 * kFwdWarps;
constexpr int kFwdQueryTile = kRowsPerWarp * kFwdWarps;  // 64

template <int kD>
struct FwdSmem {
  static constexpr int kLd = kTileLd<kD>;
  // Region 0 holds the Q tile until every warp has its Q fragments in
  // registers, then the warps' fp32 score buffers.
  static constexpr size_t kQBytes = size_t{kFwdQueryTile} * kLd * 2;
  static constexpr size_t kScoreBytes = size_t{kFwdWarps} * kRowsPerWarp * kScoreLd * 4;
  static constexpr size_t kRegion0 = kQBytes > kScoreBytes ? kQBytes : kScoreBytes;
  static constexpr size_t kKOffset = kRegion0;
  static constexpr size_t kVOffset = kKOffset + size_t{kKeyTile} * kLd * 2;
  static constexpr size_t kPOffset = kVOffset + size_t{kKeyTile} * kLd * 2;
  static constexpr size_t kAlphaOffset = kPOffset + size_t{kFwdWarps} * kRowsPerWarp * kProbLd * 2;
  static constexpr size_t kBytes = kAlphaOffset + size_t{kFwdWarps} * kRowsPerWarp * 4;
};

template <typename T, int kD>
__global__ void __launch_bounds__(kFwdThreads)
    attention_forward_tc_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, T* __restrict__ out,
                                float* __restrict__ lse, int seq, int kv_seq, int heads, int kv_heads,
                                int head_dim, float scale_log2, bool vec, AttentionMask batch_mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Smem = FwdSmem<kD>;
  constexpr int kLd = Smem::kLd;
  constexpr int kFrags = kD / 16;  // 16-column fragments across head_dim
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* k_s = reinterpret_cast<T*>(smem + Smem::kKOffset);
  T* v_s = reinterpret_cast<T*>(smem + Smem::kVOffset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_w = reinterpret_cast<float*>(smem) + warp * kRowsPerWarp * kScoreLd;
  T* p_w = reinterpret_cast<T*>(smem + Smem::kPOffset) + warp * kRowsPerWarp * kProbLd;
  float* alpha_w = reinterpret_cast<float*>(smem + Smem::kAlphaOffset) + warp * kRowsPerWarp;

  // The last query tiles see the most keys: start them first.
  const int q_tile = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int h = blockIdx.y, b = blockIdx.z;
  const int kh = h / (heads / kv_heads);
  const int q0 = q_tile * kFwdQueryTile;
  const int64_t q_stride = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_stride = static_cast<int64_t>(kv_heads) * head_dim;
  const int64_t q_base =
      static_cast<int64_t>(b) * seq * q_stride + static_cast<int64_t>(h) * head_dim;
  const int64_t kv_base =
      static_cast<int64_t>(b) * kv_seq * kv_stride + static_cast<int64_t>(kh) * head_dim;

  load_tile<T, kFwdQueryTile, kD, kFwdThreads>(q_s, q + q_base, q_stride, q0, seq, head_dim, vec);
  __syncthreads();
  FragA<T> q_frag[kFrags];
#pragma unroll
  for (int kk = 0; kk < kFrags; ++kk)
    wmma::load_matrix_sync(q_frag[kk], q_s + warp * kRowsPerWarp * kLd + kk * 16, kLd);
  __syncthreads();  // region 0 becomes the score buffers

  int frag_row[FragC::num_elements];
  fragment_rows(s_w, frag_row);
  FragC o_acc[kFrags];
#pragma unroll
  for (int f = 0; f < kFrags; ++f) wmma::fill_fragment(o_acc[f], 0.0f);

  // Softmax lanes: two per row (pair_col), running max and sum in log2 units.
  const int r = lane / 2;
  const int warp_row0 = q0 + warp * kRowsPerWarp;
  const int query = warp_row0 + r;
  const float* s_row = s_w + r * kScoreLd;
  T* p_row = p_w + r * kProbLd;
  // A sink (log2 units like the scores) is a key with no value: the running
  // max starts at it and the running sum at exp2(sink - sink) = 1.
  const bool has_sink = batch_mask.sinks != nullptr;
  float row_max = has_sink ? batch_mask.sinks[h] * 1.4426950408889634f : -INFINITY;
  float row_sum = has_sink ? 1.0f : 0.0f;

  const AttentionMask mask = batch_mask.row(static_cast<int64_t>(b) * batch_mask.seq);
  const float scale = scale_log2 * 0.6931471805599453f;  // the scores' own scale (for the soft cap)
  const WarpKeys keys = warp_keys<kFwdQueryTile>(mask, q0, warp_row0, query, seq, kv_seq);
  for (int kt = keys.tile_begin; kt < keys.tile_end; ++kt) {
    const int k0 = kt * kKeyTile;
    load_tile<T, kKeyTile, kD, kFwdThreads>(k_s, k + kv_base, kv_stride, k0, kv_seq, head_dim, vec);
    load_tile<T, kKeyTile, kD, kFwdThreads>(v_s, v + kv_base, kv_stride, k0, kv_seq, head_dim, vec);
    __syncthreads();
    const int n_cols = keys.groups(k0);
    if (n_cols > 0) {  // warp-uniform
      // S = Q K^T for the visible column groups.
      for (int n = 0; n < n_cols; ++n) {
        FragC s_acc;
        wmma::fill_fragment(s_acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < kFrags; ++kk) {
          FragBCol<T> k_frag;  // K^T: element (d, key) at k_s[key * kLd + d]
          wmma::load_matrix_sync(k_frag, k_s + n * 16 * kLd + kk * 16, kLd);
          wmma::mma_sync(s_acc, q_frag[kk], k_frag, s_acc);
        }
        wmma::store_matrix_sync(s_w + n * 16, s_acc, kScoreLd, wmma::mem_row_major);
      }
      __syncwarp();
      // Column c (key k0 + c) is visible iff it is in a computed group and in
      // the row's keys [keys.first, keys.last) (which end before kv_seq):
      // lo <= c < visible.
      const int visible = min(n_cols * 16, keys.last - k0);
      const int lo = max(0, keys.first - k0);
      float tile_max = -INFINITY;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int c = pair_col(e, lane);
        const float2 sv = capped_pair(mask, scale, load_pair(s_row, c));
        if (c >= lo && c < visible) tile_max = fmaxf(tile_max, sv.x);
        if (c + 1 >= lo && c + 1 < visible) tile_max = fmaxf(tile_max, sv.y);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1)) * scale_log2;
      const float new_max = fmaxf(row_max, tile_max);
      // A row with no visible key yet keeps an offset of 0 (all p are 0).
      const float offset = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2f(row_max - offset);  // 0 while row_max is -inf
      float tile_sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int c = pair_col(e, lane);
        const float2 sv = capped_pair(mask, scale, load_pair(s_row, c));
        const float p0 = c >= lo && c < visible ? exp2f(sv.x * scale_log2 - offset) : 0.0f;
        const float p1 = c + 1 >= lo && c + 1 < visible ? exp2f(sv.y * scale_log2 - offset) : 0.0f;
        tile_sum += p0 + p1;
        store_pair(p_row, c, p0, p1);
      }
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
      row_sum = row_sum * alpha + tile_sum;
      row_max = new_max;
      if (lane % 2 == 0) alpha_w[r] = alpha;
      __syncwarp();
      scale_rows(o_acc, alpha_w, frag_row);
      // O += P V over the visible keys.
      for (int kk = 0; kk < n_cols; ++kk) {
        FragA<T> p_frag;
        wmma::load_matrix_sync(p_frag, p_w + kk * 16, kProbLd);
#pragma unroll
        for (int f = 0; f < kFrags; ++f) {
          FragBRow<T> v_frag;  // V: element (key, d) at v_s[key * kLd + d]
          wmma::load_matrix_sync(v_frag, v_s + kk * 16 * kLd + f * 16, kLd);
          wmma::mma_sync(o_acc[f], p_frag, v_frag, o_acc[f]);
        }
      }
    }
    __syncthreads();  // the next iteration overwrites k_s and v_s
  }

  // O /= row sum; lse = ln(sum_j exp(s_j)) = max * ln 2 + ln(sum) (a row
  // that saw no key and has no sink: O 0, lse -inf).
  if (lane % 2 == 0) {
    alpha_w[r] = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    if (query < seq)
      lse[(static_cast<int64_t>(b) * heads + h) * seq + query] =
          row_sum > 0.0f ? row_max * 0.6931471805599453f + logf(row_sum) : -INFINITY;
  }
  __syncwarp();
  scale_rows(o_acc, alpha_w, frag_row);
  store_rows<T, kD>(o_acc, s_w, out + q_base, q_stride, warp_row0, seq, head_dim, 1.0f);
#endif
}

template <typename T, int kD>
cudaError_t launch_forward(const T* q, const T* k, const T* v, const AttentionDims& d, T* out,
                           float* lse, cudaStream_t stream) {
  const size_t smem = FwdSmem<kD>::kBytes;
  auto kernel = attention_forward_tc_kernel<T, kD>;
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  const bool vec = d.head_dim % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  const dim3 grid(static_cast<unsigned>((d.seq + kFwdQueryTile - 1) / kFwdQueryTile),
                  static_cast<unsigned>(d.heads), static_cast<unsigned>(d.batch));
  const float scale_log2 = static_cast<float>(1.4426950408889634 * attention_scale(d.mask, d.head_dim));
  kernel<<<grid, kFwdThreads, smem, stream>>>(
      q, k, v, out, lse, static_cast<int>(d.seq), static_cast<int>(d.keys()), static_cast<int>(d.heads),
      static_cast<int>(d.kv_heads), static_cast<int>(d.head_dim), scale_log2, vec,
      kernel_mask(d));
  return cudaGetLastError();
}

template <typename T>
cudaError_t forward_for(const void* q, const void* k, const void* v, const AttentionDims& d,
                        void* out, float* lse, cudaStream_t stream) {
  const auto* tq = static_cast<const T*>(q);
  const auto* tk = static_cast<const T*>(k);
  const auto* tv = static_cast<const T*>(v);
  if (d.head_dim <= 64)
    return launch_forward<T, 64>(tq, tk, tv, d, static_cast<T*>(out), lse, stream);
  return launch_forward<T, 128>(tq, tk, tv, d, static_cast<T*>(out), lse, stream);
}

}  // namespace

cudaError_t attention_forward_tc(Storage t, const void* q, const void* k, const void* v,
                                 const AttentionDims& dims, void* out, float* lse,
                                 cudaStream_t stream) {
  if (t == Storage::kBF16) return forward_for<__nv_bfloat16>(q, k, v, dims, out, lse, stream);
  if (t == Storage::kF16) return forward_for<__half>(q, k, v, dims, out, lse, stream);
  return cudaErrorInvalidValue;
}

}  // namespace strata::ops::cuda
