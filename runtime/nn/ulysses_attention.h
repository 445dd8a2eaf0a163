// Ulysses attention (context parallelism, issue 46 item 2; DeepSpeed
// Ulysses): the sequence sharded over the cp group as for ring attention
// (rank c holding chunks c and 2cp−1−c: one layout for both methods), an
// all-to-all turns each rank's sequence shard of every head into the whole
// sequence of heads/cp heads (and kv_heads/cp kv heads), the attention runs
// there over the whole sequence (its mask as given, no offsets), and an
// all-to-all turns the output back. Backward: q, k, v, out, dout and lse to
// heads, the whole sequence's backward, dq, dk, dv back to the chunks.
// Heads and kv heads must divide by cp (refused by name). Tensors as
// RingChunks (ring_attention.h). The moves between the layouts are copies of
// contiguous runs (Accelerator::copy_async) around Communicator::all_to_all,
// on the compute stream. Ownership, thread-safety and errors as RingAttention's.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "runtime/nn/ring_attention.h"

namespace strata::nn {

class UlyssesAttention {
 public:
  UlyssesAttention(ops::Ops& ops, ops::ComputeContext& ctx, partition::Communicator& cp_group);

  void forward(const RingChunks& t, const ops::AttentionMask& mask);
  void backward(const RingChunks& t, const std::array<TensorView, 2>& dout, const std::array<TensorView, 2>& dq,
                const std::array<TensorView, 2>& dk, const std::array<TensorView, 2>& dv,
                const ops::AttentionMask& mask);

  // Bytes this rank has sent to other ranks (its own block excluded).
  uint64_t bytes_sent() const { return bytes_sent_; }
  // Bytes of the buffers it holds (this rank's heads over the whole sequence,
  // the all-to-alls' send and receive blocks).
  size_t buffer_nbytes() const;

 private:
  struct Dims;
  Dims dims(const RingChunks& t) const;
  TensorView scratch(size_t slot, DType dtype, const Shape& shape);
  // Between [batch, chunk, heads, d] chunks and this rank's heads over the
  // whole sequence [batch, seq, heads/cp, d] (to_heads: chunks -> whole).
  void move_tokens(bool to_heads, const std::array<TensorView, 2>& chunks, const TensorView& whole, size_t slot);
  // The same for lse: [batch, heads, chunk] chunks <-> [batch, heads/cp, seq].
  void move_lse(bool to_heads, const std::array<TensorView, 2>& chunks, const TensorView& whole, size_t slot);
  void copy_run(bool into_buffer, const TensorView& buffer, int64_t buffer_at, const TensorView& other,
                int64_t other_at, int64_t n);
  void all_to_all(const TensorView& send, const TensorView& recv);

  ops::Ops* ops_;
  ops::ComputeContext* ctx_;
  partition::Communicator* cp_;
  std::vector<Tensor> scratch_;
  uint64_t bytes_sent_ = 0;
};

}  // namespace strata::nn
