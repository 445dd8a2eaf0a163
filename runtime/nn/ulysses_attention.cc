#include "runtime/nn/ulysses_attention.h"

#include "core/error.h"

namespace strata::nn {

struct UlyssesAttention::Dims {
  int cp;
  int64_t batch, chunk, seq, heads, kv_heads, head_dim;
  DType dtype;
};

namespace {
// Scratch slots: the whole-sequence tensors of this rank's heads, then the
// send/receive pairs of each all-to-all.
constexpr size_t kQ = 0, kK = 1, kV = 2, kOut = 3, kLse = 4, kDout = 5, kDq = 6, kDk = 7, kDv = 8;
constexpr size_t kMoveQ = 10, kMoveK = 12, kMoveV = 14, kMoveOut = 16, kMoveLse = 18, kMoveDout = 20;
constexpr size_t kSlots = 22;

char* at(const TensorView& t, int64_t element) {
  return static_cast<char*>(t.data) + element * static_cast<int64_t>(dtype_nbytes(t.desc.dtype));
}
}  // namespace

UlyssesAttention::UlyssesAttention(ops::Ops& ops, ops::ComputeContext& ctx, partition::Communicator& cp_group)
    : ops_(&ops), ctx_(&ctx), cp_(&cp_group), scratch_(kSlots) {}

UlyssesAttention::Dims UlyssesAttention::dims(const RingChunks& t) const {
  const Shape& q = t.q[0].desc.shape;
  const Shape& k = t.k[0].desc.shape;
  const int cp = cp_->world_size();
  STRATA_CHECK(q.size() == 4 && k.size() == 4, kBadArgument,
               "ulysses attention: q and k chunks must be [batch, chunk, heads, head_dim]");
  STRATA_CHECK(q[2] % cp == 0, kBadArgument,
               "ulysses attention: the {} attention heads do not divide by the context-parallel size {} (each rank "
               "takes heads / cp of them; use \"method\": \"ring\")",
               q[2], cp);
  STRATA_CHECK(k[2] % cp == 0, kBadArgument,
               "ulysses attention: the {} key/value heads do not divide by the context-parallel size {} (each rank "
               "takes kv_heads / cp of them; use \"method\": \"ring\")",
               k[2], cp);
  return {cp, q[0], q[1], 2 * cp * q[1], q[2], k[2], q[3], t.q[0].desc.dtype};
}

TensorView UlyssesAttention::scratch(size_t slot, DType dtype, const Shape& shape) {
  Tensor& t = scratch_.at(slot);
  if (!t.defined() || t.desc().dtype != dtype || t.desc().shape != shape) {
    ctx_->stream().synchronize();  // earlier work may still read the old buffer
    t = ctx_->accelerator().allocate_tensor(dtype, shape);
  }
  return t.view();
}

size_t UlyssesAttention::buffer_nbytes() const {
  size_t total = 0;
  for (const Tensor& t : scratch_) total += t.defined() ? t.nbytes() : 0;
  return total;
}

void UlyssesAttention::all_to_all(const TensorView& send, const TensorView& recv) {
  const int cp = cp_->world_size();
  const auto block = static_cast<size_t>(send.numel() / cp);
  cp_->all_to_all(send.data, recv.data, partition::AllToAllSplits::even(cp, block), send.desc.dtype,
                  ctx_->stream());
  bytes_sent_ += static_cast<uint64_t>(cp - 1) * block * dtype_nbytes(send.desc.dtype);
}

// Copies n elements between a run of the all-to-all's buffer and a run of
// another tensor, into the buffer or out of it.
void UlyssesAttention::copy_run(bool into_buffer, const TensorView& buffer, int64_t buffer_at, const TensorView& other,
                                int64_t other_at, int64_t n) {
  const size_t nbytes = static_cast<size_t>(n) * dtype_nbytes(buffer.desc.dtype);
  void* dst = into_buffer ? at(buffer, buffer_at) : at(other, other_at);
  const void* src = into_buffer ? at(other, other_at) : at(buffer, buffer_at);
  ctx_->accelerator().copy_async(dst, src, nbytes, CopyKind::kDeviceToDevice, ctx_->stream());
}

// Token-major tensors: chunks [batch, chunk, heads, d], whole [batch, seq,
// heads/cp, d]; the all-to-all's blocks [rank][local chunk][batch][chunk
// tokens][heads/cp][d]. To heads: each token's head slice of rank p into
// p's block, then every rank's chunks into their places in the sequence;
// to chunks the same runs the other way.
void UlyssesAttention::move_tokens(bool to_heads, const std::array<TensorView, 2>& chunks, const TensorView& whole,
                                   size_t slot) {
  const int cp = cp_->world_size();
  const Shape& s = chunks[0].desc.shape;
  const int64_t B = s[0], c = s[1], H = s[2], D = s[3], hs = H / cp, S = 2 * cp * c;
  const DType dt = chunks[0].desc.dtype;
  const TensorView send = scratch(slot, dt, {cp, 2, B, c, hs, D}), recv = scratch(slot + 1, dt, {cp, 2, B, c, hs, D});
  auto chunk_side = [&](const TensorView& buffer, bool into_buffer) {
    for (int64_t p = 0; p < cp; ++p)
      for (size_t l = 0; l < 2; ++l)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < c; ++i)
            copy_run(into_buffer, buffer, (((p * 2 + static_cast<int64_t>(l)) * B + b) * c + i) * hs * D, chunks[l],
                     ((b * c + i) * H + p * hs) * D, hs * D);
  };
  auto whole_side = [&](const TensorView& buffer, bool into_buffer) {
    for (int p = 0; p < cp; ++p)
      for (int l = 0; l < 2; ++l)
        for (int64_t b = 0; b < B; ++b)
          copy_run(into_buffer, buffer, (((p * 2 + l) * B + b) * c) * hs * D, whole,
                   (b * S + cp_chunk(cp, p, l) * c) * hs * D, c * hs * D);
  };
  if (to_heads) {
    chunk_side(send, true);
    all_to_all(send, recv);
    whole_side(recv, false);
  } else {
    whole_side(send, true);
    all_to_all(send, recv);
    chunk_side(recv, false);
  }
}

// lse (fp32): chunks [batch, heads, chunk], whole [batch, heads/cp, seq];
// blocks [rank][local chunk][batch][heads/cp][chunk tokens].
void UlyssesAttention::move_lse(bool to_heads, const std::array<TensorView, 2>& chunks, const TensorView& whole,
                                size_t slot) {
  const int cp = cp_->world_size();
  const Shape& s = chunks[0].desc.shape;
  const int64_t B = s[0], H = s[1], c = s[2], hs = H / cp, S = 2 * cp * c;
  const TensorView send = scratch(slot, DType::kF32, {cp, 2, B, hs, c}),
                   recv = scratch(slot + 1, DType::kF32, {cp, 2, B, hs, c});
  auto chunk_side = [&](const TensorView& buffer, bool into_buffer) {
    for (int64_t p = 0; p < cp; ++p)
      for (size_t l = 0; l < 2; ++l)
        for (int64_t b = 0; b < B; ++b)
          copy_run(into_buffer, buffer, ((p * 2 + static_cast<int64_t>(l)) * B + b) * hs * c, chunks[l],
                   (b * H + p * hs) * c, hs * c);
  };
  auto whole_side = [&](const TensorView& buffer, bool into_buffer) {
    for (int p = 0; p < cp; ++p)
      for (int l = 0; l < 2; ++l)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < hs; ++h)
            copy_run(into_buffer, buffer, (((p * 2 + l) * B + b) * hs + h) * c, whole,
                     (b * hs + h) * S + cp_chunk(cp, p, l) * c, c);
  };
  if (to_heads) {
    chunk_side(send, true);
    all_to_all(send, recv);
    whole_side(recv, false);
  } else {
    whole_side(send, true);
    all_to_all(send, recv);
    chunk_side(recv, false);
  }
}

void UlyssesAttention::forward(const RingChunks& t, const ops::AttentionMask& mask) {
  const Dims d = dims(t);
  const int64_t hs = d.heads / d.cp, hkv = d.kv_heads / d.cp;
  const TensorView q = scratch(kQ, d.dtype, {d.batch, d.seq, hs, d.head_dim}),
                   k = scratch(kK, d.dtype, {d.batch, d.seq, hkv, d.head_dim}),
                   v = scratch(kV, d.dtype, {d.batch, d.seq, hkv, d.head_dim}),
                   out = scratch(kOut, d.dtype, {d.batch, d.seq, hs, d.head_dim}),
                   lse = scratch(kLse, DType::kF32, {d.batch, hs, d.seq});
  move_tokens(true, t.q, q, kMoveQ);
  move_tokens(true, t.k, k, kMoveK);
  move_tokens(true, t.v, v, kMoveV);
  ops_->attention_forward(*ctx_, q, k, v, out, lse, mask);
  move_tokens(false, t.out, out, kMoveOut);
  move_lse(false, t.lse, lse, kMoveLse);
}

void UlyssesAttention::backward(const RingChunks& t, const std::array<TensorView, 2>& dout,
                                const std::array<TensorView, 2>& dq, const std::array<TensorView, 2>& dk,
                                const std::array<TensorView, 2>& dv, const ops::AttentionMask& mask) {
  const Dims d = dims(t);
  const int64_t hs = d.heads / d.cp, hkv = d.kv_heads / d.cp;
  const Shape qs{d.batch, d.seq, hs, d.head_dim}, ks{d.batch, d.seq, hkv, d.head_dim};
  const TensorView q = scratch(kQ, d.dtype, qs), k = scratch(kK, d.dtype, ks), v = scratch(kV, d.dtype, ks),
                   out = scratch(kOut, d.dtype, qs), lse = scratch(kLse, DType::kF32, {d.batch, hs, d.seq}),
                   dy = scratch(kDout, d.dtype, qs), gq = scratch(kDq, d.dtype, qs), gk = scratch(kDk, d.dtype, ks),
                   gv = scratch(kDv, d.dtype, ks);
  move_tokens(true, t.q, q, kMoveQ);
  move_tokens(true, t.k, k, kMoveK);
  move_tokens(true, t.v, v, kMoveV);
  move_tokens(true, t.out, out, kMoveOut);
  move_tokens(true, dout, dy, kMoveDout);
  move_lse(true, t.lse, lse, kMoveLse);
  ops_->attention_backward(*ctx_, dy, q, k, v, out, lse, gq, gk, gv, mask);
  move_tokens(false, dq, gq, kMoveQ);
  move_tokens(false, dk, gk, kMoveK);
  move_tokens(false, dv, gv, kMoveV);
}

}  // namespace strata::nn
