#include "runtime/nn/ring_attention.h"

#include <fmt/core.h>

#include <string>
#include <utility>

#include "core/error.h"

namespace strata::nn {

// Scratch slots: the ring buffers (two sets of k0 k1 v0 v1 each for keys/values
// and for their gradients), a block's output and gradients, the fp32 accumulators.
namespace {
constexpr size_t kKv = 0;         // 8 slots: set * 4 + (0 k0, 1 k1, 2 v0, 3 v1)
constexpr size_t kDkvRecv = 8;    // 8 slots, the same for the received dk/dv accumulators
constexpr size_t kDkvPart = 16;   // 8 slots: this step's accumulators, by set
constexpr size_t kPartOut = 24;   // a block's out [batch, chunk, heads, head_dim]
constexpr size_t kPartLse = 25;   // a block's lse
constexpr size_t kAccOut = 26;    // 2 slots: the merged outputs in fp32
constexpr size_t kPartDq = 28, kPartDk = 29, kPartDv = 30;
constexpr size_t kSlots = 31;
}  // namespace

RingAttention::RingAttention(ops::Ops& ops, ops::ComputeContext& ctx, partition::Communicator& cp_group,
                             Stream& comm_stream)
    : ops_(&ops), ctx_(&ctx), cp_(&cp_group), comm_(&comm_stream), scratch_(kSlots) {}

TensorView RingAttention::scratch(size_t slot, DType dtype, const Shape& shape) {
  Tensor& t = scratch_.at(slot);
  if (!t.defined() || t.desc().dtype != dtype || t.desc().shape != shape) {
    // A buffer of another shape may still be read by earlier work of either stream.
    ctx_->stream().synchronize();
    comm_->synchronize();
    t = ctx_->accelerator().allocate_tensor(dtype, shape);
  }
  return t.view();
}

size_t RingAttention::buffer_nbytes() const {
  size_t total = 0;
  for (const Tensor& t : scratch_) total += t.defined() ? t.nbytes() : 0;
  return total;
}

std::vector<TensorView> RingAttention::buffer_set(size_t first, DType dtype, const Shape& shape) {
  return {scratch(first, dtype, shape), scratch(first + 1, dtype, shape), scratch(first + 2, dtype, shape),
          scratch(first + 3, dtype, shape)};
}

ops::AttentionMask RingAttention::pair_mask(const ops::AttentionMask& mask, int64_t chunk, int src, int lq,
                                            int lk) const {
  ops::AttentionMask m = mask;
  m.q_offset = cp_chunk(cp_->world_size(), cp_->rank(), lq) * chunk;
  m.kv_offset = cp_chunk(cp_->world_size(), src, lk) * chunk;
  return m;
}

std::unique_ptr<Event> RingAttention::hop(const std::vector<TensorView>& from, const std::vector<TensorView>& into,
                                          Event& after, uint64_t tag) {
  const int cp = cp_->world_size(), me = cp_->rank();
  const int next = (me + 1) % cp, prev = (me + cp - 1) % cp;
  comm_->wait(after);
  std::vector<partition::P2POp> ops;
  for (size_t i = 0; i < from.size(); ++i) {
    ops.push_back(partition::P2POp::send(next, from[i].data, from[i].desc.dtype, from[i].desc.shape, tag + i,
                                         fmt::format("ring attention block {} of hop {}", i, tag >> 8)));
    ops.push_back(partition::P2POp::recv(prev, into[i].data, into[i].desc.dtype, into[i].desc.shape, tag + i,
                                         fmt::format("ring attention block {} of hop {}", i, tag >> 8)));
    bytes_sent_ += from[i].nbytes();
  }
  return cp_->exchange(ops, *comm_);
}

void RingAttention::forward(const RingChunks& t, const ops::AttentionMask& mask) {
  const int cp = cp_->world_size(), me = cp_->rank();
  const Shape& qs = t.q[0].desc.shape;
  const Shape& ks = t.k[0].desc.shape;
  const DType dt = t.q[0].desc.dtype;
  const int64_t chunk = qs.at(1);
  Stream& compute = ctx_->stream();
  auto reached = ctx_->accelerator().create_event();
  std::vector<TensorView> cur{t.k[0], t.k[1], t.v[0], t.v[1]};
  std::unique_ptr<Event> arrived;
  bool started[2] = {false, false};
  const TensorView part = scratch(kPartOut, dt, qs);
  const TensorView part_lse = scratch(kPartLse, DType::kF32, t.lse[0].desc.shape);
  const TensorView acc[2] = {scratch(kAccOut, DType::kF32, qs), scratch(kAccOut + 1, DType::kF32, qs)};
  for (int s = 0; s < cp; ++s) {
    const int src = (me - s + cp) % cp;
    std::vector<TensorView> next;
    std::unique_ptr<Event> incoming;
    if (s + 1 < cp) {  // the next hop's keys/values move while this block is computed
      next = buffer_set(kKv + static_cast<size_t>(s % 2) * 4, dt, ks);
      compute.record(*reached);
      incoming = hop(cur, next, *reached, (static_cast<uint64_t>(s) << 8) | 0x10);
    }
    if (arrived) compute.wait(*arrived);
    for (int lq = 0; lq < 2; ++lq) {
      // The diagonal block first: every query sees itself, so it starts the row's lse.
      for (int lk : {lq, 1 - lq}) {
        const ops::AttentionMask m = pair_mask(mask, chunk, src, lq, lk);
        if (!ops::block_has_visible(m, chunk, chunk)) {
          ++pairs_skipped_;
          continue;
        }
        ++pairs_computed_;
        if (!started[lq]) {
          ops_->attention_forward(*ctx_, t.q[lq], cur[lk], cur[2 + lk], part, t.lse[lq], m);
          ops_->cast(*ctx_, part, acc[lq]);
          started[lq] = true;
        } else {
          ops_->attention_forward(*ctx_, t.q[lq], cur[lk], cur[2 + lk], part, part_lse, m);
          ops_->attention_merge(*ctx_, acc[lq], t.lse[lq], part, part_lse);
        }
      }
    }
    arrived = std::move(incoming);
    if (s + 1 < cp) cur = std::move(next);
  }
  for (int lq = 0; lq < 2; ++lq) ops_->cast(*ctx_, acc[lq], t.out[lq]);
}

void RingAttention::backward(const RingChunks& t, const std::array<TensorView, 2>& dout,
                             const std::array<TensorView, 2>& dq, const std::array<TensorView, 2>& dk,
                             const std::array<TensorView, 2>& dv, const ops::AttentionMask& mask) {
  const int cp = cp_->world_size(), me = cp_->rank();
  const Shape& qs = t.q[0].desc.shape;
  const Shape& ks = t.k[0].desc.shape;
  const DType dt = t.q[0].desc.dtype;
  const int64_t chunk = qs.at(1);
  Stream& compute = ctx_->stream();
  Accelerator& acc = ctx_->accelerator();
  auto reached = acc.create_event();
  const TensorView pdq = scratch(kPartDq, dt, qs), pdk = scratch(kPartDk, dt, ks), pdv = scratch(kPartDv, dt, ks);
  for (int lq = 0; lq < 2; ++lq) acc.memset_async(dq[lq].data, 0, dq[lq].nbytes(), compute);
  std::vector<TensorView> cur{t.k[0], t.k[1], t.v[0], t.v[1]};
  std::unique_ptr<Event> kv_arrived, dkv_arrived;
  std::vector<TensorView> dkv_in;  // the accumulators received at the previous step
  for (int s = 0; s < cp; ++s) {
    const int src = (me - s + cp) % cp;
    std::vector<TensorView> next;
    std::unique_ptr<Event> kv_incoming;
    if (s + 1 < cp) {
      next = buffer_set(kKv + static_cast<size_t>(s % 2) * 4, dt, ks);
      compute.record(*reached);
      kv_incoming = hop(cur, next, *reached, (static_cast<uint64_t>(s) << 8) | 0x20);
    }
    if (kv_arrived) compute.wait(*kv_arrived);
    // This step's share of src's dk, dv (set s % 2: the hop of step s - 2 that sent it has completed,
    // as step s - 1 waited for it).
    const std::vector<TensorView> part = buffer_set(kDkvPart + static_cast<size_t>(s % 2) * 4, dt, ks);
    for (const TensorView& p : part) acc.memset_async(p.data, 0, p.nbytes(), compute);
    for (int lq = 0; lq < 2; ++lq) {
      for (int lk = 0; lk < 2; ++lk) {
        const ops::AttentionMask m = pair_mask(mask, chunk, src, lq, lk);
        if (!ops::block_has_visible(m, chunk, chunk)) continue;
        ops_->attention_backward(*ctx_, dout[lq], t.q[lq], cur[lk], cur[2 + lk], t.out[lq], t.lse[lq], pdq, pdk,
                                 pdv, m);
        ops_->add(*ctx_, dq[lq], pdq, dq[lq]);
        ops_->add(*ctx_, part[lk], pdk, part[lk]);
        ops_->add(*ctx_, part[2 + lk], pdv, part[2 + lk]);
      }
    }
    // Add what the ranks before have accumulated for src, then pass it on:
    // at the last step src is the next rank, so the hop brings it home.
    if (dkv_arrived) {
      compute.wait(*dkv_arrived);
      for (size_t i = 0; i < part.size(); ++i) ops_->add(*ctx_, part[i], dkv_in[i], part[i]);
    }
    if (cp > 1) {
      std::vector<TensorView> into = buffer_set(kDkvRecv + static_cast<size_t>(s % 2) * 4, dt, ks);
      compute.record(*reached);
      dkv_arrived = hop(part, into, *reached, (static_cast<uint64_t>(s) << 8) | 0x40);
      dkv_in = std::move(into);
    } else {
      dkv_in = part;
    }
    kv_arrived = std::move(kv_incoming);
    if (s + 1 < cp) cur = std::move(next);
  }
  if (dkv_arrived) compute.wait(*dkv_arrived);
  for (int lk = 0; lk < 2; ++lk) {
    ops_->cast(*ctx_, dkv_in[lk], dk[lk]);
    ops_->cast(*ctx_, dkv_in[2 + lk], dv[lk]);
  }
}

}  // namespace strata::nn
