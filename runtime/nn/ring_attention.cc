#include "runtime/nn/ring_attention.h"

#include <fmt/core.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"

namespace strata::nn {

namespace {
// Every buffer starts on a 256-byte boundary of the one allocation.
constexpr size_t kAlign = 256;
size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

// Where each buffer lies in the one allocation. The ring's key/value sets
// (first) serve forward and backward alike; behind them forward's buffers and
// backward's share one region, as large as the larger of the two.
struct RingAttention::Layout {
  Shape qs, ks, ls;
  DType dtype = DType::kF32;
  size_t q = 0, k = 0, lse = 0, q32 = 0;  // one buffer's bytes, aligned
  int kv_sets = 0;
  size_t phase = 0;  // where forward's and backward's own buffers start
  size_t total = 0;

  Layout(int cp, int64_t batch, int64_t chunk, int64_t heads, int64_t kv_heads, int64_t head_dim, DType dt)
      : qs{batch, chunk, heads, head_dim}, ks{batch, chunk, kv_heads, head_dim}, ls{batch, heads, chunk}, dtype(dt) {
    const auto bytes = [](const Shape& s, DType d) { return aligned(TensorDesc{d, s}.nbytes()); };
    q = bytes(qs, dt);
    k = bytes(ks, dt);
    lse = bytes(ls, DType::kF32);
    q32 = bytes(qs, DType::kF32);
    // The hop of step s fills set s % 2 while step s computes on the other
    // (a single hop at cp 2: one set; none at cp 1).
    kv_sets = std::clamp(cp - 1, 0, 2);
    phase = static_cast<size_t>(4 * kv_sets) * k;
    // Forward: a block's out and lse, both chunks' merged outputs in fp32.
    const size_t forward = q + lse + 2 * q32;
    // Backward: a block's dq, dk, dv and two sets of the dk/dv accumulators
    // (one sent while the other is received and then added to).
    const size_t backward = q + 2 * k + 8 * k;
    total = phase + std::max(forward, backward);
  }
  // Backward's block dq, dk, dv and dk/dv accumulator slot i (set * 4 + k0 k1 v0 v1).
  size_t part_dq() const { return phase; }
  size_t part_dk() const { return phase + q; }
  size_t part_dv() const { return phase + q + k; }
  size_t dkv(int i) const { return phase + q + 2 * k + static_cast<size_t>(i) * k; }
  // Forward's block out and lse, merged output l.
  size_t part_out() const { return phase; }
  size_t part_lse() const { return phase + q; }
  size_t acc_out(int l) const { return phase + q + lse + static_cast<size_t>(l) * q32; }
  bool same(const Layout& o) const { return qs == o.qs && ks == o.ks && dtype == o.dtype && total == o.total; }
};

size_t ring_buffer_nbytes(int cp, int64_t batch, int64_t chunk, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          DType dtype) {
  return RingAttention::Layout(cp, batch, chunk, heads, kv_heads, head_dim, dtype).total;
}

RingAttention::RingAttention(ops::Ops& ops, ops::ComputeContext& ctx, partition::Communicator& cp_group,
                             Stream& comm_stream)
    : ops_(&ops), ctx_(&ctx), cp_(&cp_group), comm_(&comm_stream) {}

RingAttention::~RingAttention() = default;

void RingAttention::lay_out(const RingChunks& t) {
  const Shape& qs = t.q[0].desc.shape;
  const Shape& ks = t.k[0].desc.shape;
  Layout want(cp_->world_size(), qs.at(0), qs.at(1), qs.at(2), ks.at(2), qs.at(3), t.q[0].desc.dtype);
  if (layout_ && layout_->same(want) && buffers_.defined()) return;
  // Buffers of another shape may still be read by earlier work of either stream.
  ctx_->stream().synchronize();
  comm_->synchronize();
  buffers_ = ctx_->accelerator().allocate_tensor(DType::kU8, {static_cast<int64_t>(want.total)});
  layout_ = std::make_unique<Layout>(std::move(want));
}

TensorView RingAttention::at(size_t offset, DType dtype, const Shape& shape) const {
  TensorView v = buffers_.view();
  v.desc.dtype = dtype;
  v.desc.shape = shape;
  STRATA_CHECK(offset + v.desc.nbytes() <= buffers_.nbytes(), kInternal,
               "ring attention: a buffer of {} bytes at {} lies outside the {} allocated", v.desc.nbytes(), offset,
               buffers_.nbytes());
  v.data = static_cast<char*>(buffers_.view().data) + offset;
  return v;
}

std::vector<TensorView> RingAttention::kv_set(int set) const {
  std::vector<TensorView> out;
  for (int i = 0; i < 4; ++i) out.push_back(at(static_cast<size_t>(set * 4 + i) * layout_->k, layout_->dtype, layout_->ks));
  return out;
}

std::vector<TensorView> RingAttention::dkv_set(int set) const {
  std::vector<TensorView> out;
  for (int i = 0; i < 4; ++i) out.push_back(at(layout_->dkv(set * 4 + i), layout_->dtype, layout_->ks));
  return out;
}

size_t RingAttention::buffer_nbytes() const { return buffers_.defined() ? buffers_.nbytes() : 0; }

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
  lay_out(t);
  const Layout& b = *layout_;
  const int cp = cp_->world_size(), me = cp_->rank();
  const int64_t chunk = b.qs.at(1);
  Stream& compute = ctx_->stream();
  auto reached = ctx_->accelerator().create_event();
  std::vector<TensorView> cur{t.k[0], t.k[1], t.v[0], t.v[1]};
  std::unique_ptr<Event> arrived;
  bool started[2] = {false, false};
  const TensorView part = at(b.part_out(), b.dtype, b.qs);
  const TensorView part_lse = at(b.part_lse(), DType::kF32, b.ls);
  const TensorView acc[2] = {at(b.acc_out(0), DType::kF32, b.qs), at(b.acc_out(1), DType::kF32, b.qs)};
  for (int s = 0; s < cp; ++s) {
    const int src = (me - s + cp) % cp;
    std::vector<TensorView> next;
    std::unique_ptr<Event> incoming;
    if (s + 1 < cp) {  // the next hop's keys/values move while this block is computed
      next = kv_set(s % 2);
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
  lay_out(t);
  const Layout& b = *layout_;
  const int cp = cp_->world_size(), me = cp_->rank();
  const int64_t chunk = b.qs.at(1);
  Stream& compute = ctx_->stream();
  Accelerator& acc = ctx_->accelerator();
  auto reached = acc.create_event();
  const TensorView pdq = at(b.part_dq(), b.dtype, b.qs), pdk = at(b.part_dk(), b.dtype, b.ks),
                   pdv = at(b.part_dv(), b.dtype, b.ks);
  for (int lq = 0; lq < 2; ++lq) acc.memset_async(dq[lq].data, 0, dq[lq].nbytes(), compute);
  const std::vector<TensorView> home{dk[0], dk[1], dv[0], dv[1]};
  std::vector<TensorView> cur{t.k[0], t.k[1], t.v[0], t.v[1]};
  std::unique_ptr<Event> kv_arrived, dkv_arrived;
  std::vector<TensorView> held;  // the accumulators for this step's src (received, or set 0 at step 0)
  int held_set = 0;
  for (int s = 0; s < cp; ++s) {
    const int src = (me - s + cp) % cp;
    std::vector<TensorView> next;
    std::unique_ptr<Event> kv_incoming;
    if (s + 1 < cp) {
      next = kv_set(s % 2);
      compute.record(*reached);
      kv_incoming = hop(cur, next, *reached, (static_cast<uint64_t>(s) << 8) | 0x20);
    }
    if (kv_arrived) compute.wait(*kv_arrived);
    // This step's share of src's dk, dv: at step 0 straight into accumulator
    // set 0 (nothing received yet); after that into dk, dv themselves (free
    // until the end), added to the received accumulators once they are here,
    // so that the hop before overlaps this step's blocks. A chunk's first
    // block writes its share, the next ones add theirs.
    const std::vector<TensorView> into = s == 0 ? dkv_set(0) : home;
    bool touched[2] = {false, false};
    for (int lq = 0; lq < 2; ++lq) {
      for (int lk = 0; lk < 2; ++lk) {
        const ops::AttentionMask m = pair_mask(mask, chunk, src, lq, lk);
        if (!ops::block_has_visible(m, chunk, chunk)) continue;
        const bool first = !touched[lk];
        ops_->attention_backward(*ctx_, dout[lq], t.q[lq], cur[lk], cur[2 + lk], t.out[lq], t.lse[lq], pdq,
                                 first ? into[lk] : pdk, first ? into[2 + lk] : pdv, m);
        ops_->add(*ctx_, dq[lq], pdq, dq[lq]);
        if (!first) {
          ops_->add(*ctx_, into[lk], pdk, into[lk]);
          ops_->add(*ctx_, into[2 + lk], pdv, into[2 + lk]);
        }
        touched[lk] = true;
      }
    }
    if (s == 0) {
      held = into;
      for (int lk = 0; lk < 2; ++lk) {
        if (touched[lk]) continue;
        acc.memset_async(held[lk].data, 0, held[lk].nbytes(), compute);
        acc.memset_async(held[2 + lk].data, 0, held[2 + lk].nbytes(), compute);
      }
    } else {
      // Add to what the ranks before have accumulated for src.
      compute.wait(*dkv_arrived);
      for (int lk = 0; lk < 2; ++lk) {
        if (!touched[lk]) continue;
        ops_->add(*ctx_, held[lk], into[lk], held[lk]);
        ops_->add(*ctx_, held[2 + lk], into[2 + lk], held[2 + lk]);
      }
    }
    // Pass them on (at the last step src is the next rank: the hop brings
    // this rank's home), receiving into the other set, whose hop the wait
    // above has seen complete.
    if (cp > 1) {
      const std::vector<TensorView> other = dkv_set(1 - held_set);
      compute.record(*reached);
      dkv_arrived = hop(held, other, *reached, (static_cast<uint64_t>(s) << 8) | 0x40);
      held = other;
      held_set = 1 - held_set;
    }
    kv_arrived = std::move(kv_incoming);
    if (s + 1 < cp) cur = std::move(next);
  }
  if (dkv_arrived) compute.wait(*dkv_arrived);
  for (size_t i = 0; i < home.size(); ++i) ops_->cast(*ctx_, held[i], home[i]);
}

}  // namespace strata::nn
