// Causal grouped-query attention on CUDA: the entry points (dispatch by
// storage type and head_dim), the backward's row term delta, the attention
// sinks' gradient, and the design of the kernels in attention_tc_*.cu and
// attention_f32.cu.
//
// Algorithm (FlashAttention-2). No [seq, seq] matrix exists anywhere: scores
// are formed a tile at a time in shared memory and discarded.
//  - Forward: per query tile, loop over key tiles 0..diagonal keeping a
//    running row max m and row sum l (online softmax, base-2 exponentials
//    with log2(e)/sqrt(d) folded into the score scale); O is rescaled by
//    exp(m_old - m_new) when the max grows and divided by l at the end.
//    lse = m ln2 + ln l (fp32 [batch, heads, seq]) is saved.
//  - Backward: delta_i = rowsum(dO_i * O_i) first (attention_delta_kernel).
//    dK/dV: one block per key tile loops over the query heads of the kv
//    head's group and the query tiles from the diagonal on, recomputing
//    P = exp(S * scale - lse) and dS = P (dP - delta), accumulating
//    dV += P^T dO and dK += dS^T Q in registers; each dK/dV row is written
//    once. dQ: one block per query tile loops over key tiles up to the
//    diagonal, recomputing P and dS, accumulating dQ += dS K. There are no
//    atomics: the separate dQ pass costs one more S and dP product (7 tile
//    products instead of 5) and buys determinism. When few kv heads and a
//    small batch would leave SMs idle, the group's query heads are split
//    over blocks that write fp32 partial dK/dV, summed in a fixed order.
//  - Causal skipping: key tiles after a query tile are never visited; inside
//    the diagonal tiles each warp skips the 16-wide column groups that lie
//    wholly above the diagonal for its 16 rows (no MMA, no exp).
//  - Sliding window and packed documents (attention_mask.h, kernel_mask): query tiles start
//    their key loop at the tile holding their first row's first visible key,
//    key tiles (dK/dV) end their query loop after the last query that sees
//    their last key, and elements outside [first_visible_key, query] are
//    masked like those above the diagonal.
//  - A key block of its own (context parallelism: kv_seq keys, the mask's
//    q_offset / kv_offset placing both blocks in the whole sequence): the
//    same loops over block-local tiles, their ranges from the global
//    positions (attention_mask.h visible_block_keys for a query's keys,
//    attention_block_ranges.h for a key's queries and a tile's), so a tile pair
//    with nothing visible is never loaded. A row that sees no key of the
//    block gets out 0 and lse -inf (the cpu kernel's definition); backward
//    takes the merged out and lse and gives the block's share.
//  - Sinks (gpt-oss): the forward's running max starts at the head's sink
//    and the running sum at 1, so out and lse are the softmax with the sink
//    in its denominator; backward is unchanged given that lse, and the
//    sinks' own gradient is attention_sinks_backward_kernel.
//  - Any seq: tiles past the end are zero-filled on load and masked, lse and
//    outputs are written for rows < seq only. Any head_dim <= 128: tiles are
//    padded with zero columns to 64 or 128 (kD); others are kBadArgument.
//
// 16-bit (fp16, bf16) kernels: tensor cores through WMMA 16x16x16 fragments
// with fp32 accumulators. Each warp owns 16 rows. Scores leave the
// accumulators through a warp-private fp32 buffer (WMMA's register layout is
// opaque), the softmax runs two lanes per row, and P/dS go back to shared
// memory as 16-bit A operands. Accumulator rows are rescaled in registers
// using the fragment's row map (attention_tc.cuh: fragment_rows). Shared
// tiles have rows padded by 16 bytes (bank-conflict-free fragment loads).
//  - forward: block = 64 queries (4 warps, 128 threads), key tiles of 64.
//    Q fragments stay in registers for the whole loop (~200 registers per
//    thread at kD = 128, so two blocks share an SM and overlap loads).
//      shared = max(Q tile 64 x (kD+8) x 2, scores 4 x 16 x 68 x 4)
//             + K, V tiles 2 x 64 x (kD+8) x 2 + P 4 x 16 x 72 x 2 + 4 x 16 x 4
//      kD = 128: 17408 + 34816 + 9216 + 256 = 61696 bytes
//      kD = 64:  17408 + 18432 + 9216 + 256 = 45312 bytes
//  - backward dK/dV and dQ: block = 64 keys / 64 queries (4 warps, 128
//    threads), inner tiles of 64.
//      shared = 4 tiles 64 x (kD+8) x 2 (own K,V or Q,dO; step's Q,dO or K,V)
//             + lse, delta 2 x 64 x 4 + scores 4 x 16 x 68 x 4 + P/dS 4 x 16 x 72 x 2
//      kD = 128: 69632 + 512 + 17408 + 9216 = 96768 bytes
//      kD = 64:  36864 + 512 + 17408 + 9216 = 64000 bytes
//    All under the 99 KiB opt-in limit of sm_86/89. Occupancy at kD = 128:
//    dK/dV needs ~255 registers per thread (the dK and dV accumulators alone
//    are 128), dQ ~170; two blocks (8 warps) per SM on sm_90 (227 KiB of
//    shared memory), one on sm_80 (163 KiB), so on H100 one block's tile
//    loads overlap the other's tensor-core work.
// Not done (measure first): cp.async double buffering of the streamed tiles,
// keeping S/P in registers with raw mma.sync instead of WMMA's shared-memory
// round trip, and Hopper's wgmma/TMA.
// fp32 kernels (attention_f32.cu): CUDA-core FMA, 32 x 32 tiles, 128 threads
// (4 per row), fp32 tiles [32][kD+1]:
//      forward 3 tiles + P [32][33]: kD = 128: 53760 bytes
//      dK/dV 4 tiles + lse/delta + P, dS: 74752 bytes; dQ 4 tiles + dS: 70272 bytes.
#include "kernels/cuda/device.h"

namespace strata::ops::cuda {
namespace {

// One warp per (batch, position, head) row.
template <typename T>
__global__ void attention_delta_kernel(const T* dout, const T* out, int64_t rows, int64_t seq,
                                       int64_t heads, int64_t head_dim, float* delta) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       row < rows; row += warps) {
    const T* d = dout + row * head_dim;
    const T* o = out + row * head_dim;
    float acc = 0.0f;
    for (int64_t c = lane; c < head_dim; c += 32) acc += to_f(d[c]) * to_f(o[c]);
    acc = warp_sum(acc);
    if (lane == 0) {
      // row = (b * seq + i) * heads + h  ->  delta[(b * heads + h) * seq + i]
      const int64_t h = row % heads, bi = row / heads;
      const int64_t i = bi % seq, b = bi / seq;
      delta[(b * heads + h) * seq + i] = acc;
    }
  }
}

// dsinks[h] -= sum over rows of exp(sink_h - lse) (dO . O): one block per
// head, a warp per (batch, query) row at a time, the block's partial sums
// added in a fixed order (no atomics: bitwise repeatable).
template <typename T>
__global__ void attention_sinks_backward_kernel(const T* dout, const T* out, const float* lse,
                                                const float* sinks, int64_t batch, int64_t seq,
                                                int64_t heads, int64_t head_dim, float* dsinks) {
  __shared__ float warp_total[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t h = blockIdx.x;
  const float sink = sinks[h];
  float acc = 0.0f;  // lane 0's share
  for (int64_t row = warp; row < batch * seq; row += warps) {
    const int64_t b = row / seq, i = row % seq;
    const int64_t at = ((b * seq + i) * heads + h) * head_dim;
    float dot = 0.0f;
    for (int64_t c = lane; c < head_dim; c += 32) dot += to_f(dout[at + c]) * to_f(out[at + c]);
    dot = warp_sum(dot);
    acc += expf(sink - lse[(b * heads + h) * seq + i]) * dot;
  }
  if (lane == 0) warp_total[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += warp_total[w];
    dsinks[h] -= total;
  }
}

int current_sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 1;
  }
  return count;
}

size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

void launch_attention_delta(Storage t, const void* dout, const void* out, const AttentionDims& d,
                            float* delta, cudaStream_t stream) {
  const int64_t rows = d.batch * d.seq * d.heads;
  if (rows == 0) return;
  constexpr int kThreads = 256;
  STRATA_DISPATCH_T(t, T,
                    attention_delta_kernel<T>
                    <<<grid_for(rows, kThreads / 32), kThreads, 0, stream>>>(
                        static_cast<const T*>(dout), static_cast<const T*>(out), rows, d.seq,
                        d.heads, d.head_dim, delta));
}

void launch_attention_sinks_backward(Storage t, const void* dout, const void* out, const float* lse,
                                     const float* sinks, const AttentionDims& d, float* dsinks,
                                     cudaStream_t stream) {
  if (d.heads == 0) return;
  constexpr int kThreads = 256;
  STRATA_DISPATCH_T(t, T,
                    attention_sinks_backward_kernel<T><<<static_cast<unsigned>(d.heads), kThreads, 0, stream>>>(
                        static_cast<const T*>(dout), static_cast<const T*>(out), lse, sinks, d.batch, d.seq,
                        d.heads, d.head_dim, dsinks));
}

AttentionBackwardPlan plan_attention_backward(Storage t, const AttentionDims& d) {
  AttentionBackwardPlan plan;
  plan.splits = t == Storage::kF32 ? 1 : attention_dkdv_splits(d, current_sm_count());
  const size_t delta_nbytes = align256(static_cast<size_t>(d.batch * d.heads * d.seq) * 4);
  const size_t kv_numel = static_cast<size_t>(d.batch * d.keys() * d.kv_heads * d.head_dim);
  plan.workspace_nbytes =
      delta_nbytes + (plan.splits > 1 ? 2 * static_cast<size_t>(plan.splits) * kv_numel * 4 : 0);
  return plan;
}

cudaError_t launch_attention_forward(Storage t, const void* q, const void* k, const void* v,
                                     const AttentionDims& dims, void* out, float* lse,
                                     cudaStream_t stream) {
  if (dims.head_dim <= 0 || dims.head_dim > kMaxAttentionHeadDim) return cudaErrorInvalidValue;
  if (t == Storage::kF32) {
    return attention_forward_f32(static_cast<const float*>(q), static_cast<const float*>(k),
                                 static_cast<const float*>(v), dims, static_cast<float*>(out), lse,
                                 stream);
  }
  return attention_forward_tc(t, q, k, v, dims, out, lse, stream);
}

cudaError_t launch_attention_backward(Storage t, const void* dout, const void* q, const void* k,
                                      const void* v, const void* out, const float* lse,
                                      const AttentionDims& dims, void* dq, void* dk, void* dv,
                                      const AttentionBackwardPlan& plan, void* workspace,
                                      cudaStream_t stream) {
  if (dims.head_dim <= 0 || dims.head_dim > kMaxAttentionHeadDim) return cudaErrorInvalidValue;
  auto* delta = static_cast<float*>(workspace);
  launch_attention_delta(t, dout, out, dims, delta, stream);
  if (t == Storage::kF32) {
    return attention_backward_f32(static_cast<const float*>(dout), static_cast<const float*>(q),
                                  static_cast<const float*>(k), static_cast<const float*>(v), lse,
                                  delta, dims, static_cast<float*>(dq), static_cast<float*>(dk),
                                  static_cast<float*>(dv), stream);
  }
  float* partial = reinterpret_cast<float*>(
      static_cast<char*>(workspace) +
      align256(static_cast<size_t>(dims.batch * dims.heads * dims.seq) * 4));
  return attention_backward_tc(t, dout, q, k, v, lse, delta, dims, dq, dk, dv, partial, plan.splits,
                               stream);
}

}  // namespace strata::ops::cuda
