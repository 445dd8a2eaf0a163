#include "runtime/nn/context_attention.h"

#include <algorithm>

#include "core/error.h"

namespace strata::nn {

std::string_view context_method_name(ContextMethod method) {
  return method == ContextMethod::kUlysses ? "ulysses" : "ring";
}

ContextMethod parse_context_method(std::string_view name, const std::string& source) {
  if (name == "ring") return ContextMethod::kRing;
  if (name == "ulysses") return ContextMethod::kUlysses;
  raise(ErrorCategory::kBadArgument, "{}: \"{}\" is not a context-parallel method (\"ring\" or \"ulysses\")", source,
        name);
}

void check_context_parallel(int64_t heads, int64_t kv_heads, int cp, ContextMethod method, int tp) {
  if (method != ContextMethod::kUlysses) return;
  if (tp > 1) {
    // A tp rank's heads (tensor_parallel_share's: it refuses what does not split by tp).
    const int64_t rank_heads = heads / tp, rank_kv = std::max<int64_t>(kv_heads / tp, 1);
    STRATA_CHECK(rank_heads % cp == 0 && rank_kv % cp == 0, kBadArgument,
                 "context parallelism \"ulysses\" gives each of the {} ranks of a cp group 1/{} of its tensor-parallel "
                 "rank's heads, but with tensor parallelism {} a rank holds {} of the num_attention_heads {} and {} of "
                 "the num_key_value_heads {}{}, which do not both divide by {} (use \"method\": \"ring\")",
                 cp, cp, tp, rank_heads, heads, rank_kv, kv_heads, kv_heads < tp ? " (shared)" : "", cp);
    return;
  }
  STRATA_CHECK(heads % cp == 0 && kv_heads % cp == 0, kBadArgument,
               "context parallelism \"ulysses\" gives each of the {} ranks heads / {} of the attention heads, but the "
               "model's num_attention_heads {} and num_key_value_heads {} do not both divide by {} (use \"method\": "
               "\"ring\")",
               cp, cp, heads, kv_heads, cp);
}

ContextAttention::ContextAttention(engine::Engine& engine, ContextMethod method)
    : cp_(engine.context_group().size), method_(method) {
  const engine::Engine::ContextGroup& group = engine.context_group();
  STRATA_CHECK(group.size > 1 && group.comm != nullptr, kInternal, "context attention without a cp group");
  if (method == ContextMethod::kRing) {
    STRATA_CHECK(group.stream != nullptr, kInternal, "ring attention without the engine's cp stream");
    ring_ = std::make_unique<RingAttention>(engine.ops(), engine.compute(), *group.comm, *group.stream);
  } else {
    ulysses_ = std::make_unique<UlyssesAttention>(engine.ops(), engine.compute(), *group.comm);
  }
}

ContextAttention::~ContextAttention() = default;

namespace {
// Chunk l (0 or 1) of a chunk-major tensor: its second half or first, as [batch, chunk, rest...].
TensorView chunk_of(const TensorView& t, int l, Shape shape) {
  TensorView v = t;
  v.desc.shape = std::move(shape);
  STRATA_CHECK(2 * v.desc.numel() == t.desc.numel(), kInternal, "context attention: a chunk of {} elements is not half "
               "of {}", v.desc.numel(), t.desc.numel());
  v.data = static_cast<char*>(t.data) + static_cast<size_t>(l) * v.desc.nbytes();
  return v;
}

std::array<TensorView, 2> chunks(const TensorView& t, const Shape& shape) {
  return {chunk_of(t, 0, shape), chunk_of(t, 1, shape)};
}

struct Dims {
  int64_t chunk, heads, kv_heads, head_dim;
};

Dims dims_of(const TensorView& q, const TensorView& k, int64_t batch) {
  STRATA_CHECK(q.desc.shape.size() == 3 && k.desc.shape.size() == 3 && batch > 0 &&
                   q.desc.shape[0] % (2 * batch) == 0,
               kInternal, "context attention: q and k must be [rows, heads, head_dim] over 2 chunks of {} rows",
               batch);
  return {q.desc.shape[0] / (2 * batch), q.desc.shape[1], k.desc.shape[1], q.desc.shape[2]};
}

RingChunks ring_chunks(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, int64_t batch, const Dims& d) {
  const Shape qs{batch, d.chunk, d.heads, d.head_dim}, ks{batch, d.chunk, d.kv_heads, d.head_dim};
  return {chunks(q, qs), chunks(k, ks), chunks(v, ks), chunks(out, qs), chunks(lse, {batch, d.heads, d.chunk})};
}
}  // namespace

void ContextAttention::forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, int64_t batch, const ops::AttentionMask& mask) {
  const Dims d = dims_of(q, k, batch);
  const RingChunks t = ring_chunks(q, k, v, out, lse, batch, d);
  if (ring_) {
    ring_->forward(t, mask);
  } else {
    ulysses_->forward(t, mask);
  }
}

void ContextAttention::backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                const TensorView& v, const TensorView& out, const TensorView& lse,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv, int64_t batch,
                                const ops::AttentionMask& mask) {
  const Dims d = dims_of(q, k, batch);
  const RingChunks t = ring_chunks(q, k, v, out, lse, batch, d);
  const Shape qs{batch, d.chunk, d.heads, d.head_dim}, ks{batch, d.chunk, d.kv_heads, d.head_dim};
  if (ring_) {
    ring_->backward(t, chunks(dout, qs), chunks(dq, qs), chunks(dk, ks), chunks(dv, ks), mask);
  } else {
    ulysses_->backward(t, chunks(dout, qs), chunks(dq, qs), chunks(dk, ks), chunks(dv, ks), mask);
  }
}

uint64_t ContextAttention::bytes_sent() const { return ring_ ? ring_->bytes_sent() : ulysses_->bytes_sent(); }

size_t ContextAttention::buffer_nbytes() const {
  return ring_ ? ring_->buffer_nbytes() : ulysses_->buffer_nbytes();
}

size_t context_buffer_nbytes(ContextMethod method, int cp, int64_t batch, int64_t seq, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, DType dtype) {
  if (cp <= 1) return 0;
  const int64_t e = static_cast<int64_t>(dtype_nbytes(dtype)), f32 = 4;
  const int64_t tokens = batch * seq / cp;  // this rank's, both chunks
  if (method == ContextMethod::kUlysses) {
    // Per token of this rank's (b·s/cp = b·s x heads/cp / heads): q, out,
    // dout, dq and the send/receive blocks of q, out and dout; k, v, dk, dv
    // and those of k and v; lse and its blocks (fp32).
    return static_cast<size_t>(tokens * ((10 * heads + 8 * kv_heads) * head_dim * e + 3 * heads * f32));
  }
  // RingAttention's one allocation over a chunk's b·s/2cp tokens (ring_attention.cc).
  return ring_buffer_nbytes(cp, batch, seq / (2 * cp), heads, kv_heads, head_dim, dtype);
}

}  // namespace strata::nn
