// MoeMlp: the router, the permutation by expert, one GEMM per expert and
// projection, and the weighted combine (moe_mlp.h).
#include "runtime/nn/moe_mlp.h"

#include <fmt/format.h>

#include <vector>

#include "core/error.h"

namespace strata::nn {

MoeMlp::MoeMlp(engine::Engine& engine, std::string name, const LlamaConfig& c, DType dtype, bool skip_unrouted)
    : Module(engine, std::move(name)),
      hidden_(c.hidden_size),
      inter_(c.moe_intermediate_size),
      experts_(c.num_experts),
      top_k_(c.num_experts_per_tok),
      renormalize_(c.norm_topk_prob),
      skip_unrouted_(skip_unrouted) {
  STRATA_CHECK(c.moe(), kBadArgument, "{}: model_type {} has no experts", name_, c.model_type);
  const MoeNames n = moe_names(c);
  router_ = std::make_unique<Linear>(engine, child_name("gate"), hidden_, experts_, false, dtype);
  add_child(*router_);
  for (int64_t e = 0; e < experts_; ++e) {
    const std::string p = child_name(fmt::format("experts.{}.", e));
    Expert x;
    x.gate = std::make_unique<Linear>(engine, p + n.gate, hidden_, inter_, false, dtype);
    x.up = std::make_unique<Linear>(engine, p + n.up, hidden_, inter_, false, dtype);
    x.down = std::make_unique<Linear>(engine, p + n.down, inter_, hidden_, false, dtype);
    for (Linear* l : {x.gate.get(), x.up.get(), x.down.get()}) add_child(*l);
    experts_list_.push_back(std::move(x));
  }
}

MatView MoeMlp::block(const TensorView& t, size_t e, const MoeActs& a) const {
  return MatView::of(t).row_block(a.host_offsets[e], a.host_offsets[e + 1]);
}

void MoeMlp::forward(const TensorView& x, const MoeActs& a, const MoeAux& aux, const TensorView& y,
                     Phase phase) {
  router_->forward(MatView::of(x), MatView::of(a.logits), phase);
  // A recompute routes again (the same bytes give the same choice) but must
  // not count its assignments into the load-balancing statistics twice.
  const TensorView stats = phase == Phase::kRecompute ? TensorView{} : aux.stats;
  ops().moe_route(ctx(), a.logits, top_k_, renormalize_, a.probs, a.indices, a.weights, a.offsets,
                  a.slots, a.tokens, stats);
  // The one host synchronisation of the layer (moe_mlp.h): the row blocks' sizes.
  engine_.accelerator().copy_async(a.host_offsets, a.offsets.data, a.offsets.nbytes(),
                                   CopyKind::kDeviceToHost, ctx().stream());
  ctx().stream().synchronize();
  // A recompute reproduces forward's routing: the agreement stands.
  if (phase == Phase::kForward) agree_routing(a);
  ops().moe_gather(ctx(), x, a.tokens, a.xp);
  for (size_t e = 0; e < experts_list_.size(); ++e) {
    const Expert& x_e = experts_list_[e];
    if (!routed_[e]) {
      for (const Linear* l : {x_e.gate.get(), x_e.up.get()}) engine_.skip_op(l->op(), phase);
      continue;
    }
    x_e.gate->forward(block(a.xp, e, a), block(a.gate, e, a), phase);
    x_e.up->forward(block(a.xp, e, a), block(a.up, e, a), phase);
  }
  ops().swiglu_forward(ctx(), a.gate, a.up, a.act);
  for (size_t e = 0; e < experts_list_.size(); ++e) {
    if (!routed_[e]) {
      engine_.skip_op(experts_list_[e].down->op(), phase);
      continue;
    }
    experts_list_[e].down->forward(block(a.act, e, a), block(a.yp, e, a), phase);
  }
  ops().moe_combine(ctx(), a.yp, a.slots, a.weights, y);
}

void MoeMlp::agree_routing(const MoeActs& a) {
  std::vector<double> rows(experts_list_.size());
  for (size_t e = 0; e < rows.size(); ++e) rows[e] = a.host_offsets[e + 1] - a.host_offsets[e];
  engine_.sum_over_ranks(rows.data(), rows.size());
  load_.resize(rows.size(), 0.0);
  for (size_t e = 0; e < rows.size(); ++e) load_[e] += rows[e];
  if (!skip_unrouted_) {
    routed_.assign(experts_list_.size(), 1);
    return;
  }
  routed_.resize(rows.size());
  std::vector<OpId> ops;
  std::vector<uint8_t> skipped;
  for (size_t e = 0; e < rows.size(); ++e) {
    routed_[e] = rows[e] > 0 ? 1 : 0;
    const Expert& x = experts_list_[e];
    for (const Linear* l : {x.gate.get(), x.up.get(), x.down.get()}) {
      ops.push_back(l->op());
      skipped.push_back(routed_[e] ? 0 : 1);
    }
  }
  engine_.plan_skip(ops, skipped);
}

void MoeMlp::backward(const TensorView& dy, const TensorView& x, const MoeActs& a, const MoeGrads& g,
                      const MoeAux& aux, const TensorView& dx, bool accumulate_dx) {
  STRATA_CHECK(routed_.size() == experts_list_.size(), kBadArgument, "{}: backward before forward", name_);
  ops().moe_combine_backward(ctx(), dy, a.yp, a.slots, a.weights, g.dyp, g.dweights);
  for (size_t e = experts_list_.size(); e-- > 0;) {
    if (!routed_[e]) {
      engine_.skip_op(experts_list_[e].down->op(), Phase::kBackward);
      continue;
    }
    experts_list_[e].down->backward(block(g.dyp, e, a), block(a.act, e, a), block(g.dact, e, a), false);
  }
  ops().swiglu_backward(ctx(), g.dact, a.gate, a.up, g.dgate, g.dup);
  for (size_t e = experts_list_.size(); e-- > 0;) {
    const Expert& x_e = experts_list_[e];
    if (!routed_[e]) {
      for (const Linear* l : {x_e.up.get(), x_e.gate.get()}) engine_.skip_op(l->op(), Phase::kBackward);
      continue;
    }
    x_e.up->backward(block(g.dup, e, a), block(a.xp, e, a), block(g.dxp, e, a), false);
    x_e.gate->backward(block(g.dgate, e, a), block(a.xp, e, a), block(g.dxp, e, a), true);
  }
  ops().moe_gather_backward(ctx(), g.dxp, a.slots, dx, accumulate_dx);
  ops().moe_route_backward(ctx(), a.probs, a.indices, a.weights, g.dweights, renormalize_, aux.aux_grad,
                           g.dlogits);
  router_->backward(MatView::of(g.dlogits), MatView::of(x), MatView::of(dx), true);
}

}  // namespace strata::nn
