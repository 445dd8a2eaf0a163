// Engine base: declarations, ids, the compute stream and the count of
// backward uses that decides when a gradient is complete.
#include "runtime/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/trace_recorder.h"

namespace strata::engine {

Engine::Engine(Accelerator& accelerator)
    : accelerator_(accelerator),
      ops_impl_(ops::make_ops(accelerator)),
      compute_stream_(accelerator.create_stream()),
      compute_(ops_impl_->make_context(*compute_stream_)) {
  // A cpu stream runs its ops on a thread of its own: the timeline's track of
  // the model's ops and phases (core/stream_span.h). (A CUDA stream's host
  // functions share the driver's thread, which is not this stream's.)
  if (accelerator.host_addressable()) {
    compute_stream_->launch_host_func([] { trace::name_this_thread("compute stream", /*replace=*/false); });
  }
}

Engine::~Engine() {
  // Work still queued may use the context's scratch: let it finish first.
  try {
    compute_stream_->synchronize();
  } catch (...) {
    // The error was (or will never be) reported by the owner; nothing to do here.
  }
}

ParamId Engine::declare_parameter(ParamInfo info) {
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' declared after finalize()", info.name);
  STRATA_CHECK(!by_name_.contains(info.name), kBadArgument, "parameter name '{}' declared twice",
               info.name);
  STRATA_CHECK(!info.shape.empty() && info.numel() > 0, kBadArgument,
               "parameter '{}' has empty shape {}", info.name, shape_string(info.shape));
  for (int64_t d : info.shape) {
    STRATA_CHECK(d > 0, kBadArgument, "parameter '{}' has shape {} (dims must be positive)",
                 info.name, shape_string(info.shape));
  }
  STRATA_CHECK(is_float_storage(info.dtype), kBadArgument,
               "parameter '{}' has dtype {} (fp32, fp16 or bf16)", info.name,
               dtype_name(info.dtype));
  const auto id = static_cast<ParamId>(params_.size());
  by_name_.emplace(info.name, id);
  params_.push_back(std::move(info));
  uses_.push_back(0);
  backward_seen_.push_back(0);
  return id;
}

void Engine::freeze(ParamId id) {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "freeze: unknown parameter id {}", id);
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' frozen after finalize()", params_[id].name);
  params_[id].frozen = true;
}

void Engine::store_blocks(ParamId id, const kernels::QuantBlocks& blocks) {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "store_blocks: unknown parameter id {}", id);
  ParamInfo& p = params_[id];
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' asked to be kept in {} after finalize()", p.name,
               blocks.name());
  // A trained parameter needs exact masters and a gradient; only what never changes stays quantized.
  STRATA_CHECK(p.frozen, kBadArgument, "parameter '{}' is trained: only a frozen one can be kept in {}", p.name,
               blocks.name());
  if (blocks.format == kernels::QuantBlocks::Format::kFp8) {
    const kernels::Fp8Blocks& b = blocks.fp8;
    STRATA_CHECK(p.shape == Shape({b.rows, b.cols}) && b.block_rows > 0 && b.block_cols > 0, kBadArgument,
                 "parameter '{}' {} cannot be kept in FP8 as [{}, {}] in blocks of {} x {}: its own 2-D shape and "
                 "positive blocks",
                 p.name, shape_string(p.shape), b.rows, b.cols, b.block_rows, b.block_cols);
  } else {
    const kernels::Mxfp4Blocks& b = blocks.mxfp4;
    STRATA_CHECK(p.shape == Shape({b.rows, b.cols}) && b.cols % 32 == 0, kBadArgument,
                 "parameter '{}' {} cannot be kept in MXFP4 as [{}, {}]: its own 2-D shape, the rows in blocks of 32",
                 p.name, shape_string(p.shape), b.rows, b.cols);
  }
  p.blocks = blocks;
}

void Engine::write_blocks(ParamId id, const TensorView& /*scales*/, const RangeFn& /*fn*/) {
  raise(ErrorCategory::kBadArgument, "parameter '{}' is not kept block-quantized by this engine: write it with "
        "for_each_owned_range", param_info(id).name);
}

void Engine::set_weight_decay(ParamId id, float weight_decay) {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "set_weight_decay: unknown parameter id {}", id);
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' given a weight decay after finalize()", params_[id].name);
  STRATA_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, kBadArgument,
               "parameter '{}': weight decay {} must be finite and >= 0", params_[id].name, weight_decay);
  params_[id].weight_decay = weight_decay;
}

void Engine::set_lr_scale(ParamId id, float lr_scale) {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "set_lr_scale: unknown parameter id {}", id);
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' given an lr scale after finalize()", params_[id].name);
  STRATA_CHECK(std::isfinite(lr_scale) && lr_scale >= 0, kBadArgument,
               "parameter '{}': lr scale {} must be finite and >= 0", params_[id].name, lr_scale);
  params_[id].lr_scale = lr_scale;
}

void Engine::mark_expert(ParamId id, int expert, int experts) {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "mark_expert: unknown parameter id {}", id);
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' marked an expert's after finalize()", params_[id].name);
  STRATA_CHECK(experts > 0 && expert >= 0 && expert < experts, kBadArgument,
               "parameter '{}' marked expert {} of {}", params_[id].name, expert, experts);
  params_[id].expert = expert;
  params_[id].experts = experts;
}

void Engine::share_with_stage(ParamId id, partition::Communicator& pp, int peer) {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "share_with_stage: unknown parameter id {}", id);
  STRATA_CHECK(!finalized_, kBadArgument, "parameter '{}' shared with another stage after finalize()", params_[id].name);
  STRATA_CHECK(peer >= 0 && peer < pp.world_size() && peer != pp.rank(), kBadArgument,
               "parameter '{}' shared with pipeline stage {}: not another stage of {}", params_[id].name, peer,
               pp.world_size());
  STRATA_CHECK(stage_comm_ == nullptr || stage_comm_ == &pp, kBadArgument,
               "parameter '{}' shared over another pipeline group than the engine's other shared parameters",
               params_[id].name);
  stage_comm_ = &pp;
  params_[id].stage_peer = peer;
}

void Engine::sum_stage_gradients() {
  STRATA_CHECK(finalized_, kBadArgument, "sum_stage_gradients() before finalize()");
  for (ParamId id = 0; id < parameter_count(); ++id) {
    const ParamInfo& info = params_[static_cast<size_t>(id)];
    if (info.stage_peer < 0 || info.frozen) continue;
    const TensorView mine = stage_shared_grad(id);
    if (mine.data == nullptr) continue;
    // Each side sends its gradient and receives the other's, then adds: both
    // compute the same sum (fp32 addition commutes).
    Stream& stream = compute_stream();
    void* theirs = accelerator_.allocate(mine.nbytes());
    const TensorView other{mine.desc, theirs};
    const std::string what = fmt::format("gradient of {}, shared by two pipeline stages", info.name);
    // Tagged by the tensor's name: its id differs between the stages.
    uint32_t name_key = 2166136261u;
    for (char c : info.name) name_key = (name_key ^ static_cast<unsigned char>(c)) * 16777619u;
    const uint64_t tag = uint64_t{3} << 56 | name_key;
    const std::vector<partition::P2POp> ops = {
        partition::P2POp::send(info.stage_peer, mine.data, DType::kF32, mine.desc.shape, tag, what),
        partition::P2POp::recv(info.stage_peer, theirs, DType::kF32, mine.desc.shape, tag, what)};
    stage_comm_->exchange(ops, stream);
    ops_impl_->add(*compute_, mine, other, mine);
    auto done = accelerator_.create_event();
    stream.record(*done);
    accelerator_.deallocate_after(theirs, *done);
    on_stage_grad_summed(id);
  }
}

bool Engine::owns_expert(int expert, int experts) const {
  const int size = expert_group_.size;
  if (size == 1) return true;
  return expert / (experts / size) == expert_group_.member;
}

void Engine::check_owned(OpId op) const {
  if (expert_group_.size == 1) return;
  for (ParamId p : ops_[op].params) {
    const ParamInfo& info = params_[p];
    STRATA_CHECK(info.expert < 0 || owns_expert(info.expert, info.experts), kBadArgument,
                 "operator '{}' uses expert {} of {}, which ep member {} of {} does not hold", ops_[op].name,
                 info.expert, info.experts, expert_group_.member, expert_group_.size);
  }
}

void Engine::exchange_experts(const TensorView&, const TensorView&, const partition::AllToAllSplits&) {
  raise(ErrorCategory::kBadArgument, "exchange_experts: this engine has no expert parallelism (one ep member)");
}

void Engine::tp_allreduce(const TensorView&) {
  raise(ErrorCategory::kBadArgument, "tp_allreduce: this engine has no tensor parallelism (one tp rank)");
}

void Engine::tp_allgather(const TensorView&, const TensorView&) {
  raise(ErrorCategory::kBadArgument, "tp_allgather: this engine has no tensor parallelism (one tp rank)");
}

void Engine::tp_reduce_scatter(const TensorView&, const TensorView&) {
  raise(ErrorCategory::kBadArgument, "tp_reduce_scatter: this engine has no tensor parallelism (one tp rank)");
}

OpId Engine::declare_operator(std::string name, std::vector<ParamId> params) {
  STRATA_CHECK(!finalized_, kBadArgument, "operator '{}' declared after finalize()", name);
  for (ParamId p : params) {
    STRATA_CHECK(p >= 0 && p < parameter_count(), kBadArgument,
                 "operator '{}' lists unknown parameter id {}", name, p);
    ++uses_[p];
  }
  const auto id = static_cast<OpId>(ops_.size());
  ops_.push_back(OpInfo{std::move(name), std::move(params)});
  return id;
}

void Engine::finalize() {
  STRATA_CHECK(!finalized_, kBadArgument, "finalize() called twice");
  if (!keeps_blocks()) {
    for (ParamInfo& p : params_) p.blocks.reset();
  }
  on_finalize();
  finalized_ = true;
}

const ParamInfo& Engine::param_info(ParamId id) const {
  STRATA_CHECK(id >= 0 && id < parameter_count(), kBadArgument, "unknown parameter id {}", id);
  return params_[id];
}

const OpInfo& Engine::op_info(OpId id) const {
  STRATA_CHECK(id >= 0 && id < operator_count(), kBadArgument, "unknown operator id {}", id);
  return ops_[id];
}

ParamId Engine::find_parameter(const std::string& name) const {
  auto it = by_name_.find(name);
  STRATA_CHECK(it != by_name_.end(), kBadArgument, "no parameter named '{}'", name);
  return it->second;
}

int32_t Engine::uses_of(ParamId id) const {
  param_info(id);
  return uses_[id];
}

void Engine::check_hook(OpId op) const {
  STRATA_CHECK(finalized_, kBadArgument, "hook for operator {} before finalize()", op);
  op_info(op);
}

void Engine::open_window(OpId op, Phase phase) {
  check_hook(op);
  check_owned(op);
  open_windows_.push_back({op, phase});
}

void Engine::close_window(OpId op, Phase phase) {
  check_hook(op);
  // Any open window may close (an autograd engine finishes a module's backward
  // when its inputs' gradients are done, not in the reverse of the order they began).
  const auto it = std::find_if(open_windows_.begin(), open_windows_.end(),
                               [&](const Window& w) { return w.op == op && w.phase == phase; });
  STRATA_CHECK(it != open_windows_.end(), kBadArgument, "post_op({} '{}', {}) closes no open window", op,
               op_info(op).name, phase_name(phase));
  open_windows_.erase(it);
}

bool Engine::in_window(ParamId id, bool backward) const {
  return std::any_of(open_windows_.begin(), open_windows_.end(), [&](const Window& w) {
    if (backward && w.phase != Phase::kBackward) return false;
    const auto& params = ops_[w.op].params;
    return std::find(params.begin(), params.end(), id) != params.end();
  });
}

void Engine::skip_op(OpId op, Phase phase) {
  open_window(op, phase);
  on_skip_op(op, phase);
  close_window(op, phase);
  if (phase != Phase::kBackward) return;
  if (skip_point_ == nullptr) skip_point_ = accelerator_.create_event();
  compute_stream().record(*skip_point_);
  note_backward_done(op, *skip_point_);
}

void Engine::note_backward_done(OpId op, Event& ready) {
  for (ParamId p : ops_[op].params) {
    if (params_[p].frozen) continue;  // no gradient to hand on
    if (++backward_seen_[p] < uses_[p]) continue;
    backward_seen_[p] = 0;  // complete for this pass; the next backward counts afresh
    on_grad_ready(p, ready);
    if (grad_ready_) grad_ready_(p, ready);
  }
}

}  // namespace strata::engine
