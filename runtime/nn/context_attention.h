// Context parallelism in the decoder (issue 46; docs/DESIGN.md §5): the
// attention of a rank that holds two chunks of every sequence of its
// micro-batch, through the cp group (Engine::context_group()) by ring
// attention or Ulysses (ring_attention.h, ulysses_attention.h).
//
// Layout. A micro-batch of `batch` sequences of `seq` tokens is cut into
// 2·cp chunks of seq / (2·cp) tokens per sequence; cp rank c holds chunks c
// and 2cp−1−c (Megatron's causal load balance). Its rows — what every
// per-token piece of the model (embedding, norms, projections, MLP, loss)
// sees — are chunk-major: local row (l·batch + b)·chunk + i is token
// cp_chunk(cp, c, l)·chunk + i of sequence b (ContextLayout::whole_row), so
// each of its two chunks is one contiguous [batch, chunk, ...] block of a
// [rows, ...] tensor, which the ring and Ulysses take as they are.
//
// Ownership: borrows the engine's ops, compute context and cp group (which
// must outlive it); owns the ring's or Ulysses' buffers. Thread-safety: one
// thread. Errors: kBadArgument for a shape that does not split (refused
// before anything is enqueued); a failed transfer becomes the compute
// stream's error.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "runtime/engine/engine.h"
#include "runtime/nn/context_support.h"
#include "runtime/nn/ring_attention.h"
#include "runtime/nn/ulysses_attention.h"

namespace strata::nn {

// "context_parallel.method": keys and values around the ring, or heads for
// sequence by all-to-alls (heads and kv heads must divide by cp).
enum class ContextMethod : uint8_t { kRing, kUlysses };
std::string_view context_method_name(ContextMethod method);  // "ring", "ulysses"
// "ring" or "ulysses"; anything else refused naming `source` (a key or a flag).
ContextMethod parse_context_method(std::string_view name, const std::string& source);

// Where cp rank `rank` of `cp`'s rows are in a micro-batch of batch x seq
// tokens (seq divisible by 2·cp; cp 1: every row where it is).
struct ContextLayout {
  int cp = 1, rank = 0;
  int64_t batch = 0, seq = 0;
  int64_t chunk() const { return seq / (2 * cp); }
  int64_t local_seq() const { return seq / cp; }
  int64_t local_rows() const { return batch * local_seq(); }
  // The micro-batch's row (b·seq + position) that local row `row` holds.
  int64_t whole_row(int64_t row) const {
    if (cp == 1) return row;
    const int64_t c = chunk(), i = row % c, b = row / c % batch, l = row / (c * batch);
    return b * seq + cp_chunk(cp, rank, static_cast<int>(l)) * c + i;
  }
};

// Refuses, by name, a model whose attention context parallelism cannot split
// `cp` ways with `method` (Ulysses: heads and kv heads must divide by cp).
// With tensor parallelism `tp` the cp group of each tp rank splits that
// rank's share (tensor_parallel_share: heads / tp, and kv_heads / tp or one
// shared kv head), which is what must divide.
void check_context_parallel(int64_t heads, int64_t kv_heads, int cp, ContextMethod method, int tp = 1);

// The bytes of the ring's or Ulysses' buffers (outside the model's arena)
// once a forward and a backward have run over `batch` sequences of `seq`
// tokens (the whole sequence) on a rank whose attention has `heads` and
// `kv_heads` (its tp share) of `head_dim` in `dtype` — what
// ContextAttention::buffer_nbytes() then holds, exactly. Either way b·s/cp
// tokens' worth: ring attention a chunk's (b·s/2cp tokens) k/v ring buffers
// (one set at cp 2, two above) and beside them the larger of forward's (a
// block's output and lse, the fp32 merged outputs) and backward's (a block's
// gradients, two sets of the dk/dv accumulators), ring_buffer_nbytes;
// Ulysses this rank's heads / cp over the whole sequence (q, k, v, out, lse,
// their gradients) and each all-to-all's send and receive blocks. 0 at cp 1.
size_t context_buffer_nbytes(ContextMethod method, int cp, int64_t batch, int64_t seq, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, DType dtype);

class ContextAttention {
 public:
  // Over `engine`'s cp group (its size > 1).
  ContextAttention(engine::Engine& engine, ContextMethod method);
  ~ContextAttention();
  ContextAttention(const ContextAttention&) = delete;
  ContextAttention& operator=(const ContextAttention&) = delete;

  int size() const { return cp_; }
  ContextMethod method() const { return method_; }

  // Attention over the whole sequences of this rank's rows (chunk-major, see
  // above): q and out [rows, heads, head_dim] (out may be [rows, heads *
  // head_dim]), k and v [rows, kv_heads, head_dim], lse fp32 of batch x
  // heads x rows / batch elements ([2][batch][heads][chunk]). `mask`: the
  // layer's, its document arrays (if any) over the whole sequences (seq
  // entries per row), no offsets (set here per chunk pair).
  void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
               const TensorView& lse, int64_t batch, const ops::AttentionMask& mask);
  // dq, dk, dv (overwritten; shaped as q, k, v) from dout (shaped as out) and forward's out and lse.
  void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                const TensorView& dv, int64_t batch, const ops::AttentionMask& mask);

  // Bytes this rank has sent to the others of its cp group.
  uint64_t bytes_sent() const;
  // Bytes of the ring's or Ulysses' buffers it holds (context_buffer_nbytes).
  size_t buffer_nbytes() const;

 private:
  int cp_;
  ContextMethod method_;
  std::unique_ptr<RingAttention> ring_;
  std::unique_ptr<UlyssesAttention> ulysses_;
};

}  // namespace strata::nn
