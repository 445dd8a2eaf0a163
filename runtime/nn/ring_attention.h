// Ring attention (context parallelism, issue 46): the sequence of every layer
// cut into 2·cp chunks, rank r of the cp group holding chunks r and 2cp−1−r
// (Megatron's load balance for causal masks: every rank gets one early and
// one late chunk, so the causal work is even). Each rank attends its two
// query chunks to every rank's key/value chunks, which travel around the ring
// (rank r sends to r+1 and receives from r−1, cp−1 hops) with
// Communicator::exchange on a stream of their own, so that the next hop's
// transfer runs while the block in hand is computed (double buffers). Only
// the kv heads travel (GQA). The block attention is Ops::attention_forward
// with global offsets (kernels/attention_mask.h); a chunk pair with nothing
// visible is skipped; the partial outputs are merged by their log-sum-exps
// in fp32 (Ops::attention_merge).
//
// Backward: the key/value chunks travel the ring again; each rank computes
// its query chunks' share of every block's dq, dk, dv from the merged output
// and lse (the FlashAttention recurrence), and the dk/dv accumulators travel
// the same way one hop behind (the hop of step s's accumulator overlaps step
// s+1's blocks); after the last block a final hop brings every accumulator
// home.
//
// Tensors: a rank's chunk i (i = 0: chunk r, i = 1: chunk 2cp−1−r) of q and
// out [batch, chunk, heads, head_dim], of k and v [batch, chunk, kv_heads,
// head_dim], one activation dtype; lse fp32 [batch, heads, chunk]. The mask's
// window and documents are over the whole sequence (document arrays of
// 2·cp·chunk entries per row); its offsets are set here.
//
// Ownership: borrows the Ops, the context, the communicator (the cp group)
// and the communication stream, which must outlive it; holds its ring
// buffers between calls. Thread-safety: one thread at a time.
// Errors: a failed transfer or op becomes its stream's error (rethrown by
// the caller's synchronize).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/accelerator.h"
#include "kernels/ops.h"
#include "partition/communicator.h"

namespace strata::nn {

// The global chunk (of 2·cp) that rank `rank` holds as its chunk `local` (0 or 1).
inline int64_t cp_chunk(int cp, int rank, int local) { return local == 0 ? rank : 2 * cp - 1 - rank; }

struct RingChunks {
  std::array<TensorView, 2> q, k, v, out;
  std::array<TensorView, 2> lse;  // fp32 [batch, heads, chunk]
};

class RingAttention {
 public:
  RingAttention(ops::Ops& ops, ops::ComputeContext& ctx, partition::Communicator& cp_group, Stream& comm_stream);

  // out and lse of both chunks, the attention over the whole sequence.
  void forward(const RingChunks& t, const ops::AttentionMask& mask);
  // dq, dk, dv of both chunks (overwritten) from dout and forward's out/lse.
  void backward(const RingChunks& t, const std::array<TensorView, 2>& dout, const std::array<TensorView, 2>& dq,
                const std::array<TensorView, 2>& dk, const std::array<TensorView, 2>& dv,
                const ops::AttentionMask& mask);

  // Bytes this rank has sent around the ring (keys, values, their gradients).
  uint64_t bytes_sent() const { return bytes_sent_; }
  // Bytes of the buffers it holds (ring buffers, block outputs and
  // gradients, the fp32 accumulators): context_buffer_nbytes's figure once a
  // forward and a backward have run.
  size_t buffer_nbytes() const;
  // Chunk pairs computed and skipped (nothing visible) so far.
  int64_t pairs_computed() const { return pairs_computed_; }
  int64_t pairs_skipped() const { return pairs_skipped_; }

 private:
  struct Ring;  // one kv (and dkv) buffer set
  TensorView scratch(size_t slot, DType dtype, const Shape& shape);
  // Four buffers (k0 k1 v0 v1, or their gradients) of slots first .. first + 3.
  std::vector<TensorView> buffer_set(size_t first, DType dtype, const Shape& shape);
  ops::AttentionMask pair_mask(const ops::AttentionMask& mask, int64_t chunk, int src, int lq, int lk) const;
  // Sends `from` to the next rank and receives `into` from the previous one,
  // on the communication stream once the compute stream has passed `after`.
  std::unique_ptr<Event> hop(const std::vector<TensorView>& from, const std::vector<TensorView>& into, Event& after,
                             uint64_t tag);

  ops::Ops* ops_;
  ops::ComputeContext* ctx_;
  partition::Communicator* cp_;
  Stream* comm_;
  std::vector<Tensor> scratch_;
  uint64_t bytes_sent_ = 0;
  int64_t pairs_computed_ = 0, pairs_skipped_ = 0;
};

}  // namespace strata::nn
