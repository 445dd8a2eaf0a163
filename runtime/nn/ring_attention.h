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
// s+1's blocks, whose share waits in the caller's dk, dv until it has come);
// after the last block a final hop brings every accumulator home. They are
// summed in the activation dtype, as Transformer Engine's
// AttnFuncWithCPAndKVP2P sums dKV in its bf16 p2p buffers.
//
// Buffers: one allocation for the shape in hand (ring_buffer_nbytes): the
// key/value ring sets (one at cp 2, two above) used by forward and backward,
// then one region that forward (a block's out and lse, the fp32 merged
// outputs) and backward (a block's dq, dk, dv, two sets of the dk/dv
// accumulators: one sent while the other is received) take in turn.
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

// The bytes of RingAttention's buffers for chunks of [batch, chunk, heads or
// kv_heads, head_dim] in `dtype` (what buffer_nbytes() holds once it has run
// on them; context_buffer_nbytes's ring figure).
size_t ring_buffer_nbytes(int cp, int64_t batch, int64_t chunk, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          DType dtype);

struct RingChunks {
  std::array<TensorView, 2> q, k, v, out;
  std::array<TensorView, 2> lse;  // fp32 [batch, heads, chunk]
};

class RingAttention {
 public:
  RingAttention(ops::Ops& ops, ops::ComputeContext& ctx, partition::Communicator& cp_group, Stream& comm_stream);
  ~RingAttention();
  RingAttention(const RingAttention&) = delete;
  RingAttention& operator=(const RingAttention&) = delete;

  // out and lse of both chunks, the attention over the whole sequence.
  void forward(const RingChunks& t, const ops::AttentionMask& mask);
  // dq, dk, dv of both chunks (overwritten) from dout and forward's out/lse.
  void backward(const RingChunks& t, const std::array<TensorView, 2>& dout, const std::array<TensorView, 2>& dq,
                const std::array<TensorView, 2>& dk, const std::array<TensorView, 2>& dv,
                const ops::AttentionMask& mask);

  // Bytes this rank has sent around the ring (keys, values, their gradients).
  uint64_t bytes_sent() const { return bytes_sent_; }
  // Bytes of the buffers it holds (ring_buffer_nbytes of the last shape it
  // ran on; 0 before the first call).
  size_t buffer_nbytes() const;
  // Chunk pairs computed and skipped (nothing visible) so far.
  int64_t pairs_computed() const { return pairs_computed_; }
  int64_t pairs_skipped() const { return pairs_skipped_; }

 // Where each buffer lies (ring_attention.cc); public so that
  // ring_buffer_nbytes can say the same bytes.
  struct Layout;

 private:
  // (Re)allocates the buffers for t's shape, after both streams are done with the old ones.
  void lay_out(const RingChunks& t);
  TensorView at(size_t offset, DType dtype, const Shape& shape) const;
  std::vector<TensorView> kv_set(int set) const;   // k0 k1 v0 v1 of the ring's set 0 or 1
  std::vector<TensorView> dkv_set(int set) const;  // dk0 dk1 dv0 dv1 of accumulator set 0 or 1
  ops::AttentionMask pair_mask(const ops::AttentionMask& mask, int64_t chunk, int src, int lq, int lk) const;
  // Sends `from` to the next rank and receives `into` from the previous one,
  // on the communication stream once the compute stream has passed `after`.
  std::unique_ptr<Event> hop(const std::vector<TensorView>& from, const std::vector<TensorView>& into, Event& after,
                             uint64_t tag);

  ops::Ops* ops_;
  ops::ComputeContext* ctx_;
  partition::Communicator* cp_;
  Stream* comm_;
  Tensor buffers_;
  std::unique_ptr<Layout> layout_;
  uint64_t bytes_sent_ = 0;
  int64_t pairs_computed_ = 0, pairs_skipped_ = 0;
};

}  // namespace strata::nn
