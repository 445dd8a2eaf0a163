// MoeMlp: the router, the permutation by expert, one GEMM per expert and
// projection, and the weighted combine (moe_mlp.h).
#include "runtime/nn/moe_mlp.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace strata::nn {

namespace {

// Expert e's projection to `out` features as views of the stacked tensor
// `tensor` [E, in, width] (x W) and its bias "<tensor>_bias" [E, width]:
// columns first, first + step, ... of block e (out of them), transposed into
// the Linear's [out, in] -- element (o, i) is block e's (i, first + o step).
LinearSlices stacked_slices(const std::string& tensor, int64_t experts, int64_t e, int64_t in, int64_t width,
                            int64_t first, int64_t step) {
  LinearSlices s;
  s.weight.tensor = tensor;
  s.weight.tensor_shape = {experts, in, width};
  s.weight.strides = {step, width};
  s.weight.base = e * in * width + first;
  s.bias.tensor = tensor + "_bias";
  s.bias.tensor_shape = {experts, width};
  s.bias.strides = {step};
  s.bias.base = e * width + first;
  return s;
}

}  // namespace

MoeMlp::MoeMlp(engine::Engine& engine, std::string name, const DecoderConfig& c, DType dtype, bool skip_unrouted)
    : Module(engine, std::move(name)),
      hidden_(c.hidden_size),
      inter_(c.moe_intermediate_size),
      experts_(c.num_experts),
      top_k_(c.num_experts_per_tok),
      renormalize_(c.norm_topk_prob),
      rule_(c.router()),
      act_(c.expert_act),
      clamp_(c.glu_clamp),
      skip_unrouted_(skip_unrouted) {
  STRATA_CHECK(c.moe(), kBadArgument, "{}: model_type {} has no experts", name_, c.model_type);
  const MoeNames n = moe_names(c);
  if (c.sigmoid_router) {
    // transformers keeps the correction bias (and the router's weight) in
    // fp32 whatever the model's dtype; the bias selects experts, never
    // trained (a buffer: frozen, exported as loaded).
    correction_bias_ = add_parameter("gate.e_score_correction_bias", DType::kF32, {experts_});
    engine.freeze(correction_bias_);
    route_op_ = add_operator({correction_bias_}, "route");
  }
  router_ = std::make_unique<Linear>(engine, child_name(n.router), hidden_, experts_, c.router_bias,
                                     c.sigmoid_router ? DType::kF32 : dtype);
  add_child(*router_);
  for (int64_t e = 0; e < experts_; ++e) {
    const std::string p = child_name(fmt::format("experts.{}.", e));
    Expert x;
    if (c.stacked_experts) {
      // gpt-oss: gate and up are the even and odd columns of gate_up_proj[e]
      // ([hidden, 2 I], x W), down is down_proj[e] ([I, hidden]), each
      // transposed into a Linear's [out, in], with the bias entries alike.
      const std::string stack = child_name("experts.");
      const LinearSlices gate = stacked_slices(stack + n.gate, experts_, e, hidden_, 2 * inter_, 0, 2);
      const LinearSlices up = stacked_slices(stack + n.up, experts_, e, hidden_, 2 * inter_, 1, 2);
      const LinearSlices down = stacked_slices(stack + n.down, experts_, e, inter_, hidden_, 0, 1);
      x.gate = std::make_unique<Linear>(engine, p + "gate", hidden_, inter_, true, dtype, nullptr, TensorSplit::kNone,
                                        TpBlock{}, &gate);
      x.up = std::make_unique<Linear>(engine, p + "up", hidden_, inter_, true, dtype, nullptr, TensorSplit::kNone,
                                      TpBlock{}, &up);
      x.down = std::make_unique<Linear>(engine, p + "down", inter_, hidden_, true, dtype, nullptr,
                                        TensorSplit::kNone, TpBlock{}, &down);
    } else {
      x.gate = std::make_unique<Linear>(engine, p + n.gate, hidden_, inter_, false, dtype);
      x.up = std::make_unique<Linear>(engine, p + n.up, hidden_, inter_, false, dtype);
      x.down = std::make_unique<Linear>(engine, p + n.down, inter_, hidden_, false, dtype);
    }
    for (Linear* l : {x.gate.get(), x.up.get(), x.down.get()}) {
      add_child(*l);
      engine.mark_expert(l->weight(), static_cast<int>(e), static_cast<int>(experts_));
      if (l->bias() >= 0) engine.mark_expert(l->bias(), static_cast<int>(e), static_cast<int>(experts_));
    }
    experts_list_.push_back(std::move(x));
  }
  if (c.shared_expert()) {
    // Declared after the experts, as Qwen2MoeSparseMoeBlock (and hf_tensors) order them.
    shared_ = std::make_unique<Mlp>(engine, child_name(n.shared), c, dtype, MlpTiling{}, nullptr,
                                    c.shared_expert_intermediate_size);
    add_child(*shared_);
    if (c.shared_expert_gated()) {
      shared_gate_ = std::make_unique<Linear>(engine, child_name("shared_expert_gate"), hidden_, 1, false, dtype);
      add_child(*shared_gate_);
    }
  }
}

namespace {

// The first `rows` rows of a [capacity, cols] buffer.
TensorView first_rows(const TensorView& t, int64_t rows) {
  TensorView v = t;
  if (t.desc.shape.size() == 1) {
    v.desc.shape = {rows};  // a permutation: one index per row
  } else {
    v.desc.shape = {rows, t.desc.shape.back()};
  }
  return v;
}

// Rows [r0, r1) of a buffer, as the experts' GEMMs take them.
MatView rows_of(const TensorView& t, int64_t r0, int64_t r1) { return MatView::of(t).row_block(r0, r1); }

}  // namespace

size_t MoeMlp::first_expert() const {
  return static_cast<size_t>(engine_.expert_group().member) * held_experts();
}

size_t MoeMlp::held_experts() const {
  return experts_list_.size() / static_cast<size_t>(engine_.expert_group().size);
}

void MoeMlp::forward(const TensorView& x, const MoeActs& a, const MoeAux& aux, const TensorView& y,
                     Phase phase) {
  if (a.x32.data != nullptr) ops().cast(ctx(), x, a.x32);
  router_->forward(MatView::of(a.x32.data != nullptr ? a.x32 : x), MatView::of(a.logits), phase);
  // A recompute routes again (the same bytes give the same choice) but must
  // not count its assignments into the load-balancing statistics twice.
  const TensorView stats = phase == Phase::kRecompute ? TensorView{} : aux.stats;
  if (route_op_ >= 0) {
    run(route_op_, phase, [&] {
      ops().moe_route(ctx(), a.logits, top_k_, rule_, param(correction_bias_), a.probs, a.indices, a.weights,
                      a.offsets, a.slots, a.tokens, stats);
    });
  } else {
    ops().moe_route(ctx(), a.logits, top_k_, renormalize_, a.probs, a.indices, a.weights, a.offsets,
                    a.slots, a.tokens, stats);
  }
  // The one host synchronisation of the layer (moe_mlp.h): the row blocks' sizes.
  engine_.accelerator().copy_async(a.host_offsets, a.offsets.data, a.offsets.nbytes(),
                                   CopyKind::kDeviceToHost, ctx().stream());
  ctx().stream().synchronize();
  // A recompute reproduces forward's routing: the agreement stands (and with
  // expert parallelism the permutation is uploaded again: with activation
  // checkpointing the layers share these buffers).
  if (phase == Phase::kForward) {
    agree_routing(a);
  } else if (expert_parallel()) {
    plan_exchange({}, a);
  }
  ops().moe_gather(ctx(), x, a.tokens, a.xp);
  if (!expert_parallel()) {
    experts_forward(a.xp, a, a.yp, a.host_offsets, phase);
  } else {
    // Each member's experts' rows to it; what comes back is by source member.
    MoeRouting& m = routing(a);
    const int64_t r = m.received;
    engine_.exchange_experts(a.xp, a.exchange, m.to_owners);
    if (r > 0) ops().moe_gather(ctx(), first_rows(a.exchange, r), first_rows(a.perm, r), first_rows(a.xr, r));
    experts_forward(a.xr, a, a.expert_out, m.held_offsets.data(), phase);
    if (r > 0) {
      ops().moe_gather(ctx(), first_rows(a.expert_out, r), first_rows(a.inverse, r), first_rows(a.exchange, r));
    }
    engine_.exchange_experts(a.exchange, a.yp, m.to_owners.reversed());
  }
  ops().moe_combine(ctx(), a.yp, a.slots, a.weights, y);
  if (shared_) {
    // y += sigmoid(shared_expert_gate(x)) * shared_expert(x), on this rank's
    // rows (DeepSeek: y += shared_experts(x), ungated).
    shared_->forward(x, a.shared, a.shared_out, phase);
    if (shared_gate_) {
      shared_gate_->forward(MatView::of(x), MatView::of(a.shared_logit), phase);
      ops().sigmoid_gated_add(ctx(), a.shared_out, a.shared_logit, y);
    } else {
      ops().add(ctx(), y, a.shared_out, y);
    }
  }
}

void MoeMlp::experts_forward(const TensorView& in, const MoeActs& a, const TensorView& out, const int32_t* offsets,
                             Phase phase) {
  const size_t first = first_expert(), held = held_experts();
  const std::vector<uint8_t>& routed = routing(a).routed;
  for (size_t j = 0; j < held; ++j) {
    const Expert& x_e = experts_list_[first + j];
    if (!routed[first + j]) {
      for (const Linear* l : {x_e.gate.get(), x_e.up.get()}) engine_.skip_op(l->op(), phase);
      continue;
    }
    x_e.gate->forward(rows_of(in, offsets[j], offsets[j + 1]), rows_of(a.gate, offsets[j], offsets[j + 1]), phase);
    x_e.up->forward(rows_of(in, offsets[j], offsets[j + 1]), rows_of(a.up, offsets[j], offsets[j + 1]), phase);
  }
  const int64_t rows = offsets[held];
  if (rows > 0) {
    ops().swiglu_forward(ctx(), first_rows(a.gate, rows), first_rows(a.up, rows), first_rows(a.act, rows), act_,
                         clamp_);
  }
  for (size_t j = 0; j < held; ++j) {
    Linear& down = *experts_list_[first + j].down;
    if (!routed[first + j]) {
      engine_.skip_op(down.op(), phase);
      continue;
    }
    down.forward(rows_of(a.act, offsets[j], offsets[j + 1]), rows_of(out, offsets[j], offsets[j + 1]), phase);
  }
}

void MoeMlp::agree_routing(const MoeActs& a) {
  const size_t experts = experts_list_.size();
  const auto& group = engine_.expert_group();
  // Every rank's per-expert row counts (expert parallelism: each rank fills
  // its own row of a dp_size x E matrix) or their sum (without: E values).
  const size_t ranks = expert_parallel() ? static_cast<size_t>(group.dp_size) : 1;
  const size_t own = expert_parallel() ? static_cast<size_t>(group.dp_rank) : 0;
  std::vector<double> counts(ranks * experts, 0.0);
  for (size_t e = 0; e < experts; ++e) counts[own * experts + e] = a.host_offsets[e + 1] - a.host_offsets[e];
  engine_.sum_over_ranks(counts.data(), counts.size());
  std::vector<double> rows(experts, 0.0);
  for (size_t r = 0; r < ranks; ++r) {
    for (size_t e = 0; e < experts; ++e) rows[e] += counts[r * experts + e];
  }
  load_.resize(rows.size(), 0.0);
  for (size_t e = 0; e < rows.size(); ++e) load_[e] += rows[e];
  std::vector<uint8_t>& routed = routing(a).routed;
  routed.resize(experts);
  for (size_t e = 0; e < experts; ++e) routed[e] = !skip_unrouted_ || rows[e] > 0 ? 1 : 0;
  if (expert_parallel()) plan_exchange(counts, a);
  if (!skip_unrouted_) return;
  // The advice covers the windows this rank opens: the experts it holds.
  std::vector<OpId> ops;
  std::vector<uint8_t> skipped;
  for (size_t e = first_expert(); e < first_expert() + held_experts(); ++e) {
    const Expert& x = experts_list_[e];
    for (const Linear* l : {x.gate.get(), x.up.get(), x.down.get()}) {
      ops.push_back(l->op());
      skipped.push_back(routed[e] ? 0 : 1);
    }
  }
  engine_.plan_skip(ops, skipped);
}

void MoeMlp::plan_exchange(const std::vector<double>& counts, const MoeActs& a) {
  const auto& group = engine_.expert_group();
  const size_t members = static_cast<size_t>(group.size), held = held_experts(), first = first_expert();
  const size_t experts = experts_list_.size();
  const auto hidden = static_cast<size_t>(hidden_);
  MoeRouting& m = routing(a);
  if (!counts.empty()) {
    // rows[q][j]: what member q sends for this member's expert j.
    std::vector<size_t> send(members), recv(members);
    std::vector<std::vector<int64_t>> from(members, std::vector<int64_t>(held));
    for (size_t q = 0; q < members; ++q) {
      const int32_t* off = a.host_offsets;
      send[q] = static_cast<size_t>(off[(q + 1) * held] - off[q * held]) * hidden;
      const size_t source = static_cast<size_t>(group.ranks[q]);
      for (size_t j = 0; j < held; ++j) {
        from[q][j] = static_cast<int64_t>(counts[source * experts + first + j]);
        recv[q] += static_cast<size_t>(from[q][j]) * hidden;
      }
    }
    m.to_owners = partition::AllToAllSplits::packed(std::move(send), std::move(recv));
    // The received rows are by source member, then expert; the experts want
    // them by expert, then source member.
    m.offsets.assign(held + 1, 0);
    for (size_t j = 0; j < held; ++j) {
      int64_t n = 0;
      for (size_t q = 0; q < members; ++q) n += from[q][j];
      m.offsets[j + 1] = m.offsets[j] + n;
    }
    m.received = m.offsets[held];
    const int64_t capacity = a.xr.desc.shape.front();
    STRATA_CHECK(m.received <= capacity, kBadArgument,
                 "{}: {} token rows routed to ep member {}'s experts, more than the {} its buffers hold (every "
                 "member's micro-batch must be at most this one's)",
                 name_, m.received, group.member, capacity);
    m.held_offsets.assign(m.offsets.begin(), m.offsets.end());
    const auto r = static_cast<size_t>(m.received);
    m.perm.resize(2 * r);  // the permutation, then its inverse
    std::vector<int64_t> next(m.offsets.begin(), m.offsets.end() - 1);
    int32_t source_row = 0;
    for (size_t q = 0; q < members; ++q) {
      for (size_t j = 0; j < held; ++j) {
        for (int64_t i = 0; i < from[q][j]; ++i, ++source_row) {
          const auto expert_row = static_cast<size_t>(next[j]++);
          m.perm[expert_row] = source_row;
          m.perm[r + static_cast<size_t>(source_row)] = static_cast<int32_t>(expert_row);
        }
      }
    }
  }
  // Uploaded on the compute stream through pinned memory the layers share
  // (activation checkpointing: the recompute uploads again), written only
  // after this forward synchronised that stream, so no upload still reads it.
  const int64_t r = m.received;
  if (r == 0) return;
  std::copy(m.perm.begin(), m.perm.end(), a.host_perm);
  const size_t nbytes = static_cast<size_t>(r) * sizeof(int32_t);
  engine_.accelerator().copy_async(a.perm.data, a.host_perm, nbytes, CopyKind::kHostToDevice, ctx().stream());
  engine_.accelerator().copy_async(a.inverse.data, a.host_perm + r, nbytes, CopyKind::kHostToDevice,
                                   ctx().stream());
}

void MoeMlp::backward(const TensorView& dy, const TensorView& x, const MoeActs& a, const MoeGrads& g,
                      const MoeAux& aux, const TensorView& dx, bool accumulate_dx) {
  MoeRouting& m = routing(a);
  STRATA_CHECK(m.routed.size() == experts_list_.size(), kBadArgument, "{}: backward before forward", name_);
  if (shared_gate_) {
    // The shared expert first (forward ran it last); the routed path then adds into dx.
    ops().sigmoid_gated_add_backward(ctx(), dy, a.shared_out, a.shared_logit, g.dshared_out, g.dshared_logit);
    shared_gate_->backward(MatView::of(g.dshared_logit), MatView::of(x), MatView::of(dx), accumulate_dx);
    shared_->backward(g.dshared_out, x, a.shared, g.shared, dx, true);
    accumulate_dx = true;
  } else if (shared_) {
    shared_->backward(dy, x, a.shared, g.shared, dx, accumulate_dx);
    accumulate_dx = true;
  }
  ops().moe_combine_backward(ctx(), dy, a.yp, a.slots, a.weights, g.dyp, g.dweights);
  if (!expert_parallel()) {
    experts_backward(g.dyp, a.xp, a, g, g.dxp, a.host_offsets);
  } else {
    // dyp to the experts' members, in expert order there; dxp back.
    const int64_t r = m.received;
    engine_.exchange_experts(g.dyp, a.exchange, m.to_owners);
    if (r > 0) ops().moe_gather(ctx(), first_rows(a.exchange, r), first_rows(a.perm, r), first_rows(a.expert_out, r));
    experts_backward(a.expert_out, a.xr, a, g, g.dxr, m.held_offsets.data());
    if (r > 0) ops().moe_gather(ctx(), first_rows(g.dxr, r), first_rows(a.inverse, r), first_rows(a.exchange, r));
    engine_.exchange_experts(a.exchange, g.dxp, m.to_owners.reversed());
  }
  ops().moe_gather_backward(ctx(), g.dxp, a.slots, dx, accumulate_dx);
  ops().moe_route_backward(ctx(), a.probs, a.indices, a.weights, g.dweights, rule_, aux.aux_grad, g.dlogits);
  if (route_op_ >= 0) engine_.skip_op(route_op_, Phase::kBackward);  // the bias has no gradient
  if (a.x32.data != nullptr) {
    // The fp32 router's input gradient, rounded once and added.
    router_->backward(MatView::of(g.dlogits), MatView::of(a.x32), MatView::of(g.dx32), false);
    ops().cast(ctx(), g.dx32, g.dx16);
    ops().add(ctx(), dx, g.dx16, dx);
  } else {
    router_->backward(MatView::of(g.dlogits), MatView::of(x), MatView::of(dx), true);
  }
}

std::vector<float> correction_bias_steps(const std::vector<double>& load, float rate) {
  // sign(mean - load_i) = sign(total - E load_i): whole token counts, compared exactly.
  double total = 0;
  for (double n : load) total += n;
  const auto experts = static_cast<double>(load.size());
  std::vector<float> steps(load.size(), 0.0f);
  for (size_t e = 0; e < load.size(); ++e) {
    const double offset = total - experts * load[e];
    steps[e] = offset > 0 ? rate : offset < 0 ? -rate : 0.0f;
  }
  return steps;
}

void MoeMlp::update_correction_bias(float rate) {
  STRATA_CHECK(correction_bias_ >= 0, kBadArgument,
               "{}: the router has no e_score_correction_bias to update (only DeepSeek's sigmoid router does)", name_);
  if (load_.empty()) return;  // no forward since reset_load(): nothing to balance
  const std::vector<float> steps = correction_bias_steps(load_, rate);
  // The current values first (a resident engine's write range starts empty), then the sum, in fp32.
  std::vector<float> bias(steps.size(), 0.0f);
  engine_.for_each_owned_range(correction_bias_, engine::Engine::Access::kRead,
                               [&](int64_t first, const TensorView& host) {
                                 std::copy_n(host.as<float>(), host.numel(), bias.begin() + first);
                               });
  engine_.for_each_owned_range(correction_bias_, engine::Engine::Access::kWrite,
                               [&](int64_t first, const TensorView& host) {
                                 float* out = host.as<float>();
                                 for (int64_t i = 0; i < host.numel(); ++i) {
                                   const auto e = static_cast<size_t>(first + i);
                                   out[i] = steps[e] == 0.0f ? bias[e] : bias[e] + steps[e];
                                 }
                               });
}

void MoeMlp::experts_backward(const TensorView& dout, const TensorView& in, const MoeActs& a, const MoeGrads& g,
                              const TensorView& din, const int32_t* offsets) {
  const size_t first = first_expert(), held = held_experts();
  const auto rows = [&](const TensorView& t, size_t j) { return rows_of(t, offsets[j], offsets[j + 1]); };
  const std::vector<uint8_t>& routed = routing(a).routed;
  for (size_t j = held; j-- > 0;) {
    Linear& down = *experts_list_[first + j].down;
    if (!routed[first + j]) {
      engine_.skip_op(down.op(), Phase::kBackward);
      continue;
    }
    down.backward(rows(dout, j), rows(a.act, j), rows(g.dact, j), false);
  }
  const int64_t n = offsets[held];
  if (n > 0) {
    ops().swiglu_backward(ctx(), first_rows(g.dact, n), first_rows(a.gate, n), first_rows(a.up, n),
                          first_rows(g.dgate, n), first_rows(g.dup, n), act_, clamp_);
  }
  for (size_t j = held; j-- > 0;) {
    const Expert& x_e = experts_list_[first + j];
    if (!routed[first + j]) {
      for (const Linear* l : {x_e.up.get(), x_e.gate.get()}) engine_.skip_op(l->op(), Phase::kBackward);
      continue;
    }
    x_e.up->backward(rows(g.dup, j), rows(in, j), rows(din, j), false);
    x_e.gate->backward(rows(g.dgate, j), rows(in, j), rows(din, j), true);
  }
}

}  // namespace strata::nn
