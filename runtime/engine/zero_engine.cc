// ZeroEngine: a training step over partitioned, offloaded state, read top to
// bottom — finalize (homes, gradient shards, the coordinator, the optimizer),
// the hooks of forward and backward, then the step at the accumulation
// boundary. See zero_engine.h; checkpoints are in zero_engine_state.cc.
#include "runtime/engine/zero_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "nvme/aio_handle.h"
#include "nvme/swap_space.h"
#include "partition/layout.h"
#include "partition/process_groups.h"

namespace strata::engine {
namespace {

// Each full parameter and gradient starts on a 256-byte boundary (the
// accelerator's allocation alignment), as in the ResidentEngine.
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }


}  // namespace

double StepResult::optimizer_not_hidden_fraction() const {
  const double own =
      optimizer_seconds - optimizer_drain_seconds + optimizer_overlapped_seconds + previous_update_seconds;
  return own > 0 ? std::min(1.0, (optimizer_seconds + previous_update_wait_seconds) / own) : 1.0;
}

// ---- construction and finalize -----------------------------------------------------

ZeroEngine::ZeroEngine(Accelerator& accelerator, ZeroComms comms, ZeroEngineOptions options)
    : Engine(accelerator), comms_(comms), options_(std::move(options)) {
  options_.validate();
  if (options_.loss_scaling) loss_scaler_ = LossScaler(*options_.loss_scaling);
  STRATA_CHECK(comms_.gather != nullptr && comms_.reduce != nullptr && comms_.control != nullptr, kBadArgument,
               "ZeroEngine needs gather, reduce and control communicators");
  STRATA_CHECK(comms_.gather != comms_.reduce && comms_.gather != comms_.control && comms_.reduce != comms_.control,
               kBadArgument, "gather, reduce and control need three communicators (each runs on its own stream)");
  STRATA_CHECK(comms_.gather->world_size() == comms_.reduce->world_size() &&
                   comms_.gather->world_size() == comms_.control->world_size() &&
                   comms_.gather->rank() == comms_.reduce->rank() && comms_.gather->rank() == comms_.control->rank(),
               kBadArgument, "the three communicators disagree on rank or world size");
  // Expert parallelism: the ep group this rank exchanges tokens with, and the
  // expert-dp group its experts are partitioned over (process_groups.h's
  // layout, world = dp here); the communicators must be over exactly those.
  ExpertGroup experts;
  experts.dp_rank = rank();
  experts.dp_size = world_size();
  experts.ranks = {rank()};
  if (options_.expert_parallel_size > 1) {
    const int ep = options_.expert_parallel_size;
    STRATA_CHECK(comms_.expert_exchange != nullptr && comms_.expert_gather != nullptr &&
                     comms_.expert_reduce != nullptr && comms_.expert_gather != comms_.expert_reduce,
                 kBadArgument,
                 "moe.expert_parallel_size {} needs the ep group's communicator and two of the expert-dp group's",
                 ep);
    const partition::ParallelLayout layout(world_size(), 1, ep);
    const partition::ProcessGroup& ep_group = layout.group_of(partition::GroupKind::kExpert, rank());
    const partition::ProcessGroup& edp_group = layout.group_of(partition::GroupKind::kExpertData, rank());
    const auto matches = [&](const partition::Communicator* c, const partition::ProcessGroup& g) {
      return c->world_size() == static_cast<int>(g.ranks.size()) && c->rank() == g.member(rank());
    };
    STRATA_CHECK(matches(comms_.expert_exchange, ep_group) && matches(comms_.expert_gather, edp_group) &&
                     matches(comms_.expert_reduce, edp_group),
                 kBadArgument, "rank {}: the expert communicators are not over {} and {}", rank(), ep_group.name(),
                 edp_group.name());
    experts.size = ep;
    experts.member = ep_group.member(rank());
    experts.ranks = ep_group.ranks;
    exchange_stream_ = accelerator.create_stream();
  }
  set_expert_group(std::move(experts));
  if (comms_.tensor != nullptr && comms_.tensor->world_size() > 1) {
    STRATA_CHECK(comms_.tensor != comms_.gather && comms_.tensor != comms_.reduce && comms_.tensor != comms_.control,
                 kBadArgument, "the tp group needs a communicator of its own (it runs on its own stream)");
    STRATA_CHECK(options_.expert_parallel_size == 1, kBadArgument,
                 "tensor parallelism with expert parallelism is not implemented yet");
    set_tensor_group({comms_.tensor->world_size(), comms_.tensor->rank()});
    tensor_stream_ = accelerator.create_stream();
  }
  if (comms_.context != nullptr && comms_.context->world_size() > 1) {
    STRATA_CHECK(comms_.context != comms_.gather && comms_.context != comms_.reduce &&
                     comms_.context != comms_.control && comms_.context != comms_.tensor,
                 kBadArgument, "the cp group needs a communicator of its own (it runs on its own stream)");
    STRATA_CHECK(options_.expert_parallel_size == 1, kBadArgument,
                 "context parallelism with expert parallelism is not implemented yet");
    STRATA_CHECK(world_size() % comms_.context->world_size() == 0, kBadArgument,
                 "context parallelism: the {} ZeRO ranks are not a multiple of the context-parallel size {} (gather, "
                 "reduce and control must be the dp-cp group's)",
                 world_size(), comms_.context->world_size());
    context_stream_ = accelerator.create_stream();
    set_context_group({comms_.context->world_size(), comms_.context->rank(), comms_.context, context_stream_.get()});
  }
  if (comms_.pipeline != nullptr && comms_.pipeline->world_size() > 1) {
    STRATA_CHECK(comms_.pipeline != comms_.gather && comms_.pipeline != comms_.reduce &&
                     comms_.pipeline != comms_.control && comms_.pipeline != comms_.tensor,
                 kBadArgument, "the pp group needs a communicator of its own");
    pipeline_stream_ = accelerator.create_stream();
  }
  gather_stream_ = accelerator.create_stream();
  control_stream_ = accelerator.create_stream();
  home_stream_ = accelerator.create_stream();
  compute_point_ = accelerator.create_event();
  gather_point_ = accelerator.create_event();
  window_ = std::make_unique<offload::HostWindow>(accelerator);
}

ZeroEngine::~ZeroEngine() {
  if (optimizer_) {
    try {
      optimizer_->finish();  // an update overlapping a forward that never came: its state committed
    } catch (...) {
      // Reported (or never to be) on the caller's path.
    }
    optimizer_->stop();  // no sub-group is updated after this
  }
  // Queued work reads and writes the memory freed below.
  for (Stream* stream : {&compute_stream(), gather_stream_.get(), control_stream_.get(), home_stream_.get(),
                         exchange_stream_.get(), tensor_stream_.get(), context_stream_.get(), pipeline_stream_.get()}) {
    if (stream == nullptr) continue;
    try {
      stream->synchronize();
    } catch (...) {
      // Reported (or never to be) on the caller's path; the memory may go now.
    }
  }
  for (auto& g : groups_) g->reducer.reset();  // waits for its stream: nothing lands after this
  optimizer_.reset();
  coordinator_.reset();  // its read queue and reads in flight, then the gathered copies
  for (auto& g : groups_) g->grads.reset();
  for (float* grad : grad_full_) {
    if (grad != nullptr && options_.stage != 1) accelerator().deallocate(grad);
  }
  for (auto& g : groups_) {
    if (g->full_flat) accelerator().deallocate(g->full_flat);
    g->home.reset();
  }
  if (stage1_grads_) accelerator().deallocate(stage1_grads_);
  if (control_buffer_) accelerator().deallocate(control_buffer_);
  for (const auto& scales : kept_scales_) {
    if (scales && scales->device) accelerator().deallocate(scales->device);
  }
}

void ZeroEngine::on_finalize() {
  // Sizes the config left out, from the declared parameters' layers; every
  // layout, reducer and optimizer below uses the result. Logged once (rank 0).
  {
    std::vector<SizedParam> sized;
    for (ParamId id = 0; id < parameter_count(); ++id) {
      const ParamInfo& p = param_info(id);
      if (p.expert >= 0 && !owns_expert(p.expert, p.experts)) continue;
      sized.push_back({p.name, p.blocks ? p.blocks->stored_nbytes() : p.numel(),
                       p.blocks ? p.blocks->stored_dtype() : p.dtype, !p.frozen});
    }
    zero_sizes_ = choose_zero_sizes(sized, world_size(), options_.sub_group_numel, options_.reduce_bucket_numel,
                                    partition::kDefaultAlignmentNbytes);
    options_.sub_group_numel = zero_sizes_.sub_group_numel;
    options_.reduce_bucket_numel = zero_sizes_.reduce_bucket_numel;
    if (rank() == 0 && (zero_sizes_.sub_group_chosen || zero_sizes_.reduce_bucket_chosen)) {
      logger().info("ZeRO sizes: {}", zero_sizes_.describe());
    }
  }
  // Group parameters by dtype, frozen ones apart (they have no gradient path
  // and no optimizer), with expert parallelism the experts this rank holds
  // apart (partitioned over their expert-dp group) and the others left out,
  // with tensor parallelism the tp shards apart (the norm counts them
  // differently), in declaration order within a group.
  const int ep = options_.expert_parallel_size;
  const bool tp = tensor_group().size > 1;
  std::map<std::tuple<DType, bool, bool, bool, bool, bool, std::optional<float>, float>, size_t> group_index;
  const int stage = comms_.pipeline != nullptr ? comms_.pipeline->rank() : 0;
  group_of_.assign(static_cast<size_t>(parameter_count()), -1);
  index_in_group_.resize(static_cast<size_t>(parameter_count()));
  for (ParamId id = 0; id < parameter_count(); ++id) {
    const ParamInfo& info = param_info(id);
    const DType dtype = info.blocks ? info.blocks->stored_dtype() : info.dtype;  // as the home stores it
    const bool frozen = info.frozen;
    const bool expert = ep > 1 && info.expert >= 0;
    if (expert) {
      STRATA_CHECK(info.experts % ep == 0, kBadArgument,
                   "moe.expert_parallel_size {} does not divide the {} experts of the layer of '{}'", ep,
                   info.experts, info.name);
      if (!owns_expert(info.expert, info.experts)) continue;  // another ep member's
    }
    const bool tp_split = tp && info.tp_split;
    // A block several tp ranks hold counts in the norm on the first of them only.
    const bool tp_counted = !tp_split || info.tp_copies <= 1 || tensor_group().rank % info.tp_copies == 0;
    // A tensor two pipeline stages hold counts in the norm on the lower one only.
    const bool stage_copy = info.stage_peer >= 0 && info.stage_peer < stage;
    // A parameter with its own weight decay joins the others of that decay
    // (a frozen one has no optimizer: its decay does not matter).
    std::optional<float> decay = frozen ? std::nullopt : info.weight_decay;
    if (decay && *decay == options_.adam.weight_decay) decay.reset();
    // So does one with its own lr scale (a frozen one has no lr either).
    const float lr_scale = frozen ? 1.0f : info.lr_scale;
    auto [it, inserted] = group_index.emplace(
        std::tuple{dtype, frozen, expert, tp_split, tp_counted, stage_copy, decay, lr_scale},
                                              groups_.size());
    if (inserted) {
      groups_.push_back(std::make_unique<Group>());
      Group& g = *groups_.back();
      g.dtype = dtype;
      g.frozen = frozen;
      g.expert = expert;
      g.tp_split = tp_split;
      g.tp_counted = tp_counted;
      g.stage_copy = stage_copy;
      g.suffix = std::string(!tp_split ? "" : tp_counted ? "_tp" : "_tp_copy") + (stage_copy ? "_pp_copy" : "");
      g.weight_decay = decay;
      g.decay_suffix = decay ? fmt::format("_wd{}", *decay) : "";
      g.lr_scale = lr_scale;
      g.lr_suffix = lr_scale != 1.0f ? fmt::format("_lr{}", lr_scale) : "";
      // A uint8 home holds MXFP4's kept form (nothing else is stored as bytes).
      g.key = std::string(dtype == DType::kU8 ? "mxfp4" : dtype_name(dtype)) + (frozen ? "_frozen" : "") + (expert ? "_experts" : "") + g.suffix +
              g.decay_suffix + g.lr_suffix;
      g.gather_comm = expert ? comms_.expert_gather : comms_.gather;
      g.reduce_comm = expert ? comms_.expert_reduce : comms_.reduce;
    }
    Group& g = *groups_[it->second];
    group_of_[id] = static_cast<int>(it->second);
    index_in_group_[id] = g.params.size();
    g.params.push_back(id);
  }
  grad_full_.assign(static_cast<size_t>(parameter_count()), nullptr);
  if (options_.any_nvme()) {
    aio_ = std::make_unique<nvme::AioHandle>(options_.aio, options_.io_backend ? options_.io_backend() : nullptr);
  }
  // The optimizer on the accelerator reads the gradient shard and writes the
  // parameter home in accelerator memory, so a trained group's home is there
  // (trained_param_tier); offload_param then moves only frozen groups, and a
  // model with none would offload nothing while keeping 12 bytes of optimizer
  // state per element on the accelerator to spare 2 to 4.
  if (options_.optimizer_tier == Tier::kDevice && options_.param_tier != Tier::kDevice) {
    const bool any_frozen = std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g->frozen; });
    STRATA_CHECK(any_frozen, kBadArgument,
                 "offload_optimizer.device none keeps the optimizer state on the accelerator, which needs the "
                 "trained parameters there too, but offload_param.device is {} and no parameter is frozen: offload "
                 "the optimizer as well (offload_optimizer.device cpu or nvme), keep the parameters "
                 "(offload_param.device none), or freeze those to offload (LoRA, finetune --freeze)",
                 tier_name(options_.param_tier));
  }
  for (auto& g : groups_) create_group(*g);

  if (options_.stage == 3) {
    // The coordinator sees each parameter as a slice of its group's home.
    std::vector<offload::CoordinatedParam> params(static_cast<size_t>(parameter_count()));
    for (ParamId id = 0; id < parameter_count(); ++id) {
      if (!holds(id)) continue;  // never used here: no home
      const Group& g = group_of(id);
      const partition::ParamSlot& slot = g.layout->param(index_in_group_[id]);
      params[id] = {g.home.get(), static_cast<size_t>(slot.slice_numel), static_cast<size_t>(slot.shard_offset_numel),
                    param_info(id).numel(), g.expert ? g.gather_comm : nullptr};
      const ParamInfo& info = param_info(id);
      if (!info.blocks) continue;
      // Kept block-quantized: its whole scale grid on every rank (filled by
      // write_blocks), and each gather dequantized on the gather stream.
      if (kept_scales_.empty()) kept_scales_.resize(static_cast<size_t>(parameter_count()));
      if (gather_ctx_ == nullptr) gather_ctx_ = ops().make_context(*gather_stream_);
      const kernels::QuantBlocks& b = *info.blocks;
      auto scales = std::make_unique<KeptScales>();
      const size_t grid_nbytes = static_cast<size_t>(shape_numel(b.scale_shape())) * dtype_nbytes(b.scale_dtype());
      scales->host.assign(grid_nbytes, 0);
      params[id].expanded_nbytes = info.nbytes();
      if (b.format == kernels::QuantBlocks::Format::kFp8) {
        scales->device = accelerator().allocate(grid_nbytes);
        accelerator().memset_async(scales->device, 0, grid_nbytes, compute_stream());
        params[id].expand = [this, id, device = scales->device](const void* stored, void* full, Stream&) {
          const ParamInfo& p = param_info(id);
          const kernels::Fp8Blocks& f = p.blocks->fp8;
          ops().dequantize_fp8_blocks(
              *gather_ctx_, TensorView{TensorDesc{DType::kF8E4M3, p.shape, Tier::kDevice}, const_cast<void*>(stored)},
              TensorView{TensorDesc{DType::kF32, {f.grid_rows(), f.grid_cols()}, Tier::kDevice}, device},
              f.block_rows, f.block_cols, TensorView{TensorDesc{p.dtype, p.shape, Tier::kDevice}, full});
        };
      } else {
        // The gathered kept form: the codes, then the scales (kernels/mxfp4_blocks.h).
        params[id].expand = [this, id](const void* stored, void* full, Stream&) {
          const ParamInfo& p = param_info(id);
          const kernels::Mxfp4Blocks& m = p.blocks->mxfp4;
          auto* bytes = static_cast<uint8_t*>(const_cast<void*>(stored));
          ops().dequantize_mxfp4_blocks(
              *gather_ctx_, TensorView{TensorDesc{DType::kU8, {m.packed_nbytes()}, Tier::kDevice}, bytes},
              TensorView{TensorDesc{DType::kU8, p.blocks->scale_shape(), Tier::kDevice}, bytes + m.packed_nbytes()},
              TensorView{TensorDesc{p.dtype, p.shape, Tier::kDevice}, full});
        };
      }
      kept_scales_[id] = std::move(scales);
    }
    std::vector<offload::CoordinatedOp> ops;
    for (OpId op = 0; op < operator_count(); ++op) {
      ops.push_back({op_info(op).name, op_info(op).params, layer_index_of(op_info(op).name)});
    }
    offload::CoordinatorOptions coordinator;
    coordinator.prefetch_bucket_numel = options_.prefetch_bucket_numel;
    coordinator.max_live_parameters_numel = options_.max_live_parameters_numel;
    coordinator.max_reuse_distance_numel = options_.max_reuse_distance_numel;
    coordinator.persistence_threshold_numel = options_.persistence_threshold_numel;
    coordinator.param_buffer_count = options_.param_buffer_count;
    coordinator.param_buffer_numel = options_.param_buffer_numel;
    coordinator_ = std::make_unique<offload::ParamCoordinator>(accelerator(), compute_stream(), *gather_stream_,
                                                               *comms_.gather, coordinator, std::move(params),
                                                               std::move(ops));
  }

  offload::ShardOptimizerOptions optimizer;
  optimizer.tier = options_.optimizer_tier;
  optimizer.adam = options_.adam;
  optimizer.sub_group_numel = options_.sub_group_numel;
  optimizer.threads = options_.optimizer_threads;
  optimizer.buffer_count = options_.optimizer_buffer_count;
  optimizer.nvme_path = options_.nvme_path;
  optimizer.rank = job_rank();
  optimizer.keep_files = options_.keep_swap_files;
  optimizer.overlap = options_.stage > 1 && options_.overlap_optimizer;
  optimizer.clipping = options_.gradient_clipping > 0;
  optimizer.policy = overlap_policy_;
  std::vector<offload::OptimizedShard> shards;
  for (auto& g : groups_) {
    if (g->frozen) continue;
    g->shard = static_cast<int>(shards.size());
    shards.push_back({g->dtype, g->layout.get(), g->home.get(), g->grads.get(), g->reducer.get(),
                      std::string(dtype_name(g->dtype)) + (g->expert ? "_experts" : "") + g->suffix +
                          g->decay_suffix + g->lr_suffix,
                      g->weight_decay, g->lr_scale});
  }
  optimizer_ = std::make_unique<offload::ShardOptimizer>(accelerator(), ops(), *home_stream_, aio_.get(), optimizer,
                                                std::move(shards));

  if (options_.stage == 1) {
    // Every full fp32 gradient, resident and accumulating over micro-steps.
    std::vector<size_t> offsets;
    for (ParamId id = 0; id < parameter_count(); ++id) {
      offsets.push_back(stage1_grads_nbytes_);
      if (holds(id) && !param_info(id).frozen) {
        stage1_grads_nbytes_ += align_up(static_cast<size_t>(param_info(id).numel()) * sizeof(float));
      }
    }
    stage1_grads_ = accelerator().allocate(std::max<size_t>(stage1_grads_nbytes_, 1));
    accelerator().memset_async(stage1_grads_, 0, stage1_grads_nbytes_, compute_stream());
    for (ParamId id = 0; id < parameter_count(); ++id) {
      if (!holds(id) || param_info(id).frozen) continue;
      grad_full_[id] = reinterpret_cast<float*>(static_cast<char*>(stage1_grads_) + offsets[id]);
    }
  }
  compute_stream().synchronize();
  full_params_stale_ = false;
}

void ZeroEngine::create_group(Group& g) {
  std::vector<partition::ParamSpec> specs;
  for (ParamId id : g.params) {
    const ParamInfo& info = param_info(id);
    specs.push_back({info.name, info.blocks ? info.blocks->stored_shape() : info.shape, g.dtype});
  }
  partition::LayoutOptions layout_options;
  layout_options.world_size = g.gather_comm->world_size();
  layout_options.sub_group_numel = options_.sub_group_numel;
  g.layout = std::make_unique<partition::PartitionLayout>(std::move(specs), layout_options);

  // The home is read and written in sub-group chunks (the optimizer) and
  // whole slices (for_each_owned_range).
  offload::ParamHomeOptions home;
  home.tier = g.frozen ? options_.param_tier : trained_param_tier();
  home.dtype = g.dtype;
  home.numel = static_cast<size_t>(g.layout->shard_numel());
  home.chunk_numel = offload::sub_group_stride(*g.layout, g.dtype, options_.sub_group_numel);
  home.max_range_numel = home.chunk_numel;
  for (const auto& slot : g.layout->params()) {
    home.max_range_numel = std::max(home.max_range_numel, static_cast<size_t>(slot.slice_numel));
  }
  home.nvme_path = options_.nvme_path;
  home.key = g.key;
  home.rank = job_rank();
  home.keep_files = options_.keep_swap_files;
  // The update overlapping the next forward writes a sub-group's new values
  // to an NVMe home just before that forward's gathers read them: the last
  // few stay in pinned memory, and the gathers take them from there.
  if (!g.frozen) home.cached_writes = cached_param_writes(options_, home.tier, home.chunk_numel, home.max_range_numel);
  g.home = offload::make_param_home(home, accelerator(), *home_stream_, *window_, aio_.get());

  if (g.frozen) {
    // No gradient path; full copies (stages 1/2) as for every group.
  } else if (options_.grad_tier == Tier::kNvme) {
    if (grad_swap_ == nullptr) {
      grad_swap_ = std::make_unique<nvme::SwapSpace>(
          nvme::SwapSpaceOptions{options_.nvme_path, "grad", job_rank(), true, options_.keep_swap_files});
    }
    g.grads = std::make_unique<offload::GradShard>(accelerator(), ops(), *g.layout, *aio_, *grad_swap_, g.key);
  } else {
    g.grads = std::make_unique<offload::GradShard>(accelerator(), ops(), *g.layout);
  }
  if (g.grads) {
    // Groups reduced over the same communicator share its stream, so its
    // collectives run in the order backward submits them on every rank.
    std::unique_ptr<Stream>& stream = reduce_streams_[g.reduce_comm];
    if (stream == nullptr) stream = accelerator().create_stream();
    g.reducer = std::make_unique<offload::BucketReducer>(accelerator(), ops(), *g.reduce_comm, *g.layout,
                                                         options_.reduce_bucket_numel, *g.grads, stream.get());
  }

  if (options_.stage < 3) {
    size_t total = 0;
    for (ParamId id : g.params) {
      g.full_offset.push_back(total);
      total += align_up(param_info(id).nbytes());
    }
    g.full_flat = accelerator().allocate(total);
    accelerator().memset_async(g.full_flat, 0, total, compute_stream());
  }
}

// ---- forward and backward ------------------------------------------------------------

void ZeroEngine::pre_op(OpId op, Phase phase) {
  STRATA_CHECK(!boundary_, kBadArgument,
               "operator '{}' opened a {} window between clip_grad_norm() and step(): the gradients are final "
               "there (step() or zero_grad() first)",
               op_info(op).name, phase_name(phase));
  STRATA_CHECK(!evaluating_ || phase == Phase::kForward, kBadArgument,
               "operator '{}' opened a {} window during an evaluation pass (forward only): end_evaluation() first",
               op_info(op).name, phase_name(phase));
  // Backward lands gradients in the shards the update reads: it waits for the update to end.
  if (update_pending_ && phase != Phase::kForward) finish_update();
  open_window(op, phase);
  if (coordinator_) {
    coordinator_->pre_op(op, phase);
  } else if (full_params_stale_) {
    sync_full_params();
  }
}

void ZeroEngine::post_op(OpId op, Phase phase) {
  close_window(op, phase);
  compute_stream().record(*compute_point_);
  if (phase == Phase::kBackward) note_backward_done(op, *compute_point_);
  if (coordinator_) coordinator_->post_op(op, phase);
}

void ZeroEngine::on_skip_op(OpId op, Phase phase) {
  STRATA_CHECK(!evaluating_ || phase == Phase::kForward, kBadArgument,
               "operator '{}' skipped a {} window during an evaluation pass (forward only): end_evaluation() first",
               op_info(op).name, phase_name(phase));
  if (coordinator_) coordinator_->skip_op(op, phase);
}

void ZeroEngine::plan_skip(std::span<const OpId> ops, std::span<const uint8_t> skipped) {
  STRATA_CHECK(ops.size() == skipped.size(), kBadArgument, "plan_skip: {} operators but {} flags", ops.size(),
               skipped.size());
  if (coordinator_) coordinator_->plan_skip(ops, skipped);
}

void ZeroEngine::sum_over_ranks(double* values, size_t count) {
  if (count > 0) allreduce_f64(values, count);
}

void ZeroEngine::exchange_experts(const TensorView& send, const TensorView& recv,
                                  const partition::AllToAllSplits& splits) {
  if (exchange_stream_ == nullptr) Engine::exchange_experts(send, recv, splits);  // refuses
  STRATA_CHECK(send.desc.dtype == recv.desc.dtype, kBadArgument, "exchange_experts: send is {}, recv {}",
               dtype_name(send.desc.dtype), dtype_name(recv.desc.dtype));
  STRATA_CHECK(splits.send_total() <= static_cast<size_t>(send.numel()) &&
                   splits.recv_total() <= static_cast<size_t>(recv.numel()),
               kBadArgument, "exchange_experts: {} elements to send from {}, {} to receive into {}",
               splits.send_total(), send.numel(), splits.recv_total(), recv.numel());
  // After compute's writes of `send` and reads of `recv`; compute reads `recv` after it.
  compute_stream().record(*compute_point_);
  exchange_stream_->wait(*compute_point_);
  const std::unique_ptr<Event> done =
      comms_.expert_exchange->all_to_all(send.data, recv.data, splits, send.desc.dtype, *exchange_stream_);
  compute_stream().wait(*done);
}

void ZeroEngine::tp_allreduce(const TensorView& view) {
  if (tensor_stream_ == nullptr) Engine::tp_allreduce(view);  // refuses
  STRATA_CHECK(is_float_storage(view.desc.dtype), kBadArgument, "tp_allreduce: {} is not a float dtype",
               dtype_name(view.desc.dtype));
  ++tensor_traffic_.allreduces;
  tensor_traffic_.bytes += view.nbytes();
  on_tensor_stream([&] {
    return comms_.tensor->allreduce(view.data, view.data, static_cast<size_t>(view.numel()), view.desc.dtype,
                                    partition::ReduceOp::kSum, *tensor_stream_);
  });
}

template <typename Submit>
void ZeroEngine::on_tensor_stream(Submit&& submit) {
  // After compute's writes of the buffers; compute's later reads wait for the result.
  compute_stream().record(*compute_point_);
  tensor_stream_->wait(*compute_point_);
  compute_stream().wait(*submit());
}

void ZeroEngine::tp_allgather(const TensorView& local, const TensorView& full) {
  if (tensor_stream_ == nullptr) Engine::tp_allgather(local, full);  // refuses
  check_tp_pair("tp_allgather", local, full);
  ++tensor_traffic_.allgathers;
  tensor_traffic_.bytes += full.nbytes();
  on_tensor_stream([&] {
    return comms_.tensor->allgather(local.data, full.data, static_cast<size_t>(local.numel()), local.desc.dtype,
                                    *tensor_stream_);
  });
}

void ZeroEngine::tp_reduce_scatter(const TensorView& full, const TensorView& local) {
  if (tensor_stream_ == nullptr) Engine::tp_reduce_scatter(full, local);  // refuses
  check_tp_pair("tp_reduce_scatter", local, full);
  ++tensor_traffic_.reduce_scatters;
  tensor_traffic_.bytes += full.nbytes();
  on_tensor_stream([&] {
    return comms_.tensor->reduce_scatter(full.data, local.data, static_cast<size_t>(local.numel()), local.desc.dtype,
                                         partition::ReduceOp::kSum, *tensor_stream_);
  });
}

void ZeroEngine::check_tp_pair(const char* op, const TensorView& local, const TensorView& full) const {
  STRATA_CHECK(is_float_storage(local.desc.dtype) && local.desc.dtype == full.desc.dtype, kBadArgument,
               "{}: {} and {} must be one float dtype", op, dtype_name(local.desc.dtype),
               dtype_name(full.desc.dtype));
  STRATA_CHECK(full.numel() == local.numel() * tensor_group().size, kBadArgument,
               "{}: the full tensor has {} elements, not {} x {}", op, full.numel(), tensor_group().size,
               local.numel());
}

TensorView ZeroEngine::param(ParamId id) {
  STRATA_CHECK(in_window(id, false), kBadArgument,
               "parameter '{}' used outside a hook window of an operator that lists it", param_info(id).name);
  const ParamInfo& info = param_info(id);
  void* data = coordinator_ ? coordinator_->full(id)
                            : static_cast<char*>(group_of(id).full_flat) + group_of(id).full_offset[index_in_group_[id]];
  return TensorView{TensorDesc{info.dtype, info.shape, Tier::kDevice}, data};
}

TensorView ZeroEngine::grad(ParamId id) { return grad_buffer(id, /*for_host=*/false); }

TensorView ZeroEngine::host_grad(ParamId id) {
  STRATA_CHECK(accelerator().host_addressable(), kBadArgument,
               "host_grad('{}'): the {} accelerator's memory is not host memory", param_info(id).name,
               accelerator().name());
  return grad_buffer(id, /*for_host=*/true);
}

TensorView ZeroEngine::grad_buffer(ParamId id, bool for_host) {
  STRATA_CHECK(in_window(id, true), kBadArgument,
               "gradient of '{}' used outside a backward window of an operator that lists it", param_info(id).name);
  const ParamInfo& info = param_info(id);
  if (info.frozen) return TensorView{};  // not trained: no gradient
  float*& grad = grad_full_[id];
  if (grad == nullptr) {  // stages 2/3: exists from its first use in backward to its reduction
    const size_t nbytes = static_cast<size_t>(info.numel()) * sizeof(float);
    grad = static_cast<float*>(accelerator().allocate(nbytes));
    // A new block is nobody's (allocate hands out none a queued free still
    // waits on): the caller's thread may zero it itself, with no hand-off to
    // the compute stream's thread.
    if (for_host) {
      std::memset(grad, 0, nbytes);
    } else {
      accelerator().memset_async(grad, 0, nbytes, compute_stream());
    }
  } else if (for_host) {
    compute_stream().synchronize();  // its earlier work on the buffer (returns at once when there is none)
  }
  return TensorView{TensorDesc{DType::kF32, info.shape, Tier::kDevice}, grad};
}

void ZeroEngine::on_grad_ready(ParamId id, Event& ready) {
  if (options_.stage == 1) return;  // reduced at the boundary from the resident gradients
  // Shared with another pipeline stage: held, accumulating over the step's
  // micro-batches, until sum_stage_gradients adds the peer's and reduces it.
  if (param_info(id).stage_peer >= 0) return;
  float* grad = grad_full_[id];
  if (grad == nullptr) return;  // the op never asked for this gradient
  grad_full_[id] = nullptr;
  group_of(id).reducer->add(index_in_group_[id], grad, ready,
                            [this, grad](Event& consumed) { accelerator().deallocate_after(grad, consumed); });
}

TensorView ZeroEngine::stage_shared_grad(ParamId id) {
  if (!holds(id) || param_info(id).frozen) return TensorView{};
  const ParamInfo& info = param_info(id);
  float*& grad = grad_full_[id];
  if (grad == nullptr) {  // no use added to it this step
    const size_t nbytes = static_cast<size_t>(info.numel()) * sizeof(float);
    grad = static_cast<float*>(accelerator().allocate(nbytes));
    accelerator().memset_async(grad, 0, nbytes, compute_stream());
  }
  return TensorView{TensorDesc{DType::kF32, info.shape, Tier::kDevice}, grad};
}

void ZeroEngine::on_stage_grad_summed(ParamId id) {
  if (options_.stage == 1) return;  // step() reduces every resident gradient
  float* grad = grad_full_[id];
  grad_full_[id] = nullptr;
  compute_stream().record(*compute_point_);
  group_of(id).reducer->add(index_in_group_[id], grad, *compute_point_,
                            [this, grad](Event& consumed) { accelerator().deallocate_after(grad, consumed); });
}

// ---- the step ---------------------------------------------------------------------

void ZeroEngine::prepare_step(float lr, int backwards) {
  STRATA_CHECK(finalized(), kBadArgument, "prepare_step() before finalize()");
  STRATA_CHECK(!evaluating_, kBadArgument, "prepare_step() during an evaluation pass: end_evaluation() first");
  prepared_backwards_ = backwards;
  // Layer-major: a parameter's m gradient blocks come in a row, so an NVMe
  // gradient shard sums them in host memory and writes each slice once
  // (GradShard::hold_blocks) instead of m read-add-writes.
  for (auto& g : groups_) {
    if (!g->frozen && g->grads && g->grads->on_nvme()) g->grads->hold_blocks(backwards);
  }
  if (update_pending_) {
    // The last step's update may still overlap this forward: the countdown is
    // armed at the join (the first backward window: the lm_head's, inside
    // forward()), before any gradient of this step lands.
    STRATA_CHECK(!deferred_prepare_, kBadArgument, "prepare_step() twice without a step() between");
    kernels::AdamConfig adam = options_.adam;
    adam.lr = lr;
    adam.validate();  // a bad lr fails here, not at the join
    deferred_prepare_ = lr;
    return;
  }
  arm_step(lr);
}

void ZeroEngine::arm_step(float lr) {
  // What the step will apply when clipping does not fire: the loss scale divided out.
  const double loss_scale = loss_scaler_.scale();
  const float grad_scale = kernels::combined_grad_scale(kernels::GradStats{0.0, true}, static_cast<float>(loss_scale),
                                                        static_cast<float>(options_.gradient_clipping));
  optimizer_->prepare(lr, grad_scale, loss_scale, prepared_backwards_);
}

void ZeroEngine::set_overlap_policy(offload::OverlapPolicy policy) {
  overlap_policy_ = policy;
  if (optimizer_) optimizer_->set_policy(policy);
}

bool ZeroEngine::step_prepared() const { return deferred_prepare_.has_value() || (optimizer_ && optimizer_->prepared()); }

void ZeroEngine::begin_evaluation() {
  STRATA_CHECK(finalized(), kBadArgument, "begin_evaluation() before finalize()");
  STRATA_CHECK(!evaluating_, kBadArgument, "begin_evaluation() twice without end_evaluation()");
  check_not_prepared("begin_evaluation");
  check_no_backward("begin_evaluation");
  evaluating_ = true;
  if (coordinator_) coordinator_->set_trace_paused(true);
}

void ZeroEngine::end_evaluation() {
  STRATA_CHECK(evaluating_, kBadArgument, "end_evaluation() without begin_evaluation()");
  evaluating_ = false;
  if (coordinator_) coordinator_->set_trace_paused(false);
}

double ZeroEngine::clip_grad_norm(double max_norm) {
  STRATA_CHECK(finalized(), kBadArgument, "clip_grad_norm() before finalize()");
  STRATA_CHECK(!evaluating_, kBadArgument, "clip_grad_norm() during an evaluation pass: end_evaluation() first");
  check_no_backward("clip_grad_norm");
  STRATA_CHECK(!std::isnan(max_norm), kBadArgument, "clip_grad_norm(): max_norm is NaN");
  finish_update();
  if (!boundary_) {
    try {
      boundary_ = reach_boundary();
    } catch (...) {
      optimizer_->abort();  // as a failed step() leaves it
      throw;
    }
  }
  clip_override_ = max_norm > 0 ? max_norm : 0.0;
  const GradBoundary& b = *boundary_;
  return b.global.finite ? b.global.norm() / loss_scaler_.scale() : std::numeric_limits<double>::infinity();
}

ZeroEngine::GradBoundary ZeroEngine::reach_boundary() {
  GradBoundary b;
  // The step boundary: the operator trace closes, no read of a home is left in flight.
  if (coordinator_) coordinator_->end_step();
  if (options_.stage > 1) {
    for (ParamId id = 0; id < parameter_count(); ++id) {
      STRATA_CHECK(param_info(id).stage_peer < 0 || grad_full_[id] == nullptr, kBadArgument,
                   "the gradient of '{}', which another pipeline stage holds too, was not summed with that stage's "
                   "(sum_stage_gradients() comes after the last backward, before step() or clip_grad_norm())",
                   param_info(id).name);
    }
  }
  if (options_.stage == 1) {
    compute_stream().record(*compute_point_);
    for (ParamId id = 0; id < parameter_count(); ++id) {
      if (holds(id) && !param_info(id).frozen) {
        group_of(id).reducer->add(index_in_group_[id], grad_full_[id], *compute_point_);
      }
    }
  }

  // The gradient shards are final once every bucket has landed, and with
  // them every sub-group the optimizer thread could update during backward.
  auto start = Clock::now();
  for (auto& g : groups_) {
    if (g->reducer) g->reducer->synchronize();
  }
  b.grad_wait_seconds = seconds_since(start);
  start = Clock::now();
  b.drain_seconds = optimizer_->settle();

  // Global norm and finiteness: one f64 allreduce of (sum of squares, non-finite ranks).
  double reduced[2];
  // A tensor another pipeline stage holds too counts on the lower stage only.
  std::vector<uint8_t> counted;
  for (const auto& g : groups_) {
    if (g->shard >= 0) counted.push_back(!g->stage_copy);
  }
  if (tensor_group().size == 1) {
    const kernels::GradStats local = optimizer_->grad_stats(counted);
    reduced[0] = local.finite ? local.sum_sq : 0.0;
    reduced[1] = local.finite ? 0.0 : 1.0;
  } else {
    // The tp shards' sums over the tp group first; the replicated groups
    // hold the same gradient on every tp rank, so they count once.
    // A block several tp ranks hold (shared kv heads) counts on the first of them only.
    std::vector<uint8_t> split, replicated;
    for (const auto& g : groups_) {
      if (g->shard < 0) continue;
      split.push_back(g->tp_split && g->tp_counted && !g->stage_copy);
      replicated.push_back(!g->tp_split && !g->stage_copy);
    }
    const kernels::GradStats shards = optimizer_->grad_stats(split);
    const kernels::GradStats same = optimizer_->grad_stats(replicated);
    double tp_sum[2] = {shards.finite ? shards.sum_sq : 0.0, shards.finite ? 0.0 : 1.0};
    allreduce_f64(tp_sum, 2, comms_.tensor, tensor_stream_.get());
    reduced[0] = tp_sum[0] + (same.finite ? same.sum_sq : 0.0);
    reduced[1] = tp_sum[1] + (same.finite ? 0.0 : 1.0);
  }
  allreduce_f64(reduced, 2);
  if (pipeline_stream_ != nullptr) allreduce_f64(reduced, 2, comms_.pipeline, pipeline_stream_.get());  // every stage's
  b.global.sum_sq = reduced[0];
  b.global.finite = reduced[1] == 0.0 && std::isfinite(reduced[0]);
  b.nonfinite_ranks = reduced[1];
  b.norm_seconds = seconds_since(start);
  return b;
}

StepResult ZeroEngine::step(float lr) {
  STRATA_CHECK(finalized(), kBadArgument, "step() before finalize()");
  STRATA_CHECK(!evaluating_, kBadArgument, "step() during an evaluation pass: end_evaluation() first");
  check_no_backward("step");
  finish_update();  // a step with no backward since the last one
  StepResult result;
  // The boundary clip_grad_norm() reached, if it did, and its clipping: this step's only.
  std::optional<GradBoundary> reached = std::exchange(boundary_, std::nullopt);
  const double clipping = std::exchange(clip_override_, std::nullopt).value_or(options_.gradient_clipping);
  // Whatever fails from here on, what the optimizer opened does not stay behind.
  struct AbortOnError {
    offload::ShardOptimizer& optimizer;
    bool armed = true;
    ~AbortOnError() {
      if (!armed) return;
      try {
        optimizer.abort();
      } catch (...) {
        // The step's own error is the one reported.
      }
    }
  } guard{*optimizer_};
  const auto start = Clock::now();
  const GradBoundary boundary = reached ? *reached : reach_boundary();
  // Reached by clip_grad_norm(): its wait and norm were spent before this call.
  result.grad_wait_seconds = reached ? 0.0 : boundary.grad_wait_seconds;
  const auto optimizer_seconds = [&] { return seconds_since(start) - result.grad_wait_seconds; };
  // The last step's update overlapped this step's forward: what it cost and
  // what compute waited for (the stall log is final: every bucket waited for compute).
  result.previous_update_seconds = update_seconds_;
  if (join_reached_ != nullptr) {
    // The join held compute only from when the stream ran out of the work queued before it.
    const int64_t reached = join_reached_->load();
    if (reached > 0 && reached < join_end_ns_) {
      result.previous_update_wait_seconds = static_cast<double>(join_end_ns_ - reached) * 1e-9;
    }
    join_reached_.reset();
  }
  if (coordinator_ && update_seconds_ > 0) {
    result.previous_update_wait_seconds += coordinator_->last_step().update_stall_seconds();
  }
  update_seconds_ = 0;
  result.optimizer_drain_seconds = boundary.drain_seconds;
  const kernels::GradStats global = boundary.global;
  const double loss_scale = loss_scaler_.scale();
  result.loss_scale = loss_scale;
  // The gradients hold loss_scale x the true ones; report the true norm.
  result.grad_norm = global.finite ? global.norm() / loss_scale : std::numeric_limits<double>::infinity();

  if (!global.finite) {
    // Every rank saw the same reduced flags, so every rank skips and backs off alike.
    result.rolled_back = optimizer_->abort();
    guard.armed = false;
    if (options_.loss_scaling) {
      logger().info("step {}: the gradients overflow at loss scale {} on {} rank(s); the step is skipped", steps_ + 1,
                    loss_scale, boundary.nonfinite_ranks);
    } else {
      logger().warn("step {}: a gradient is not finite on {} rank(s); the step is skipped", steps_ + 1,
                    boundary.nonfinite_ranks);
    }
    zero_grad();
    loss_scaler_.update(true);  // throws at the minimum scale: no progress is possible
    result.step = steps_;
    result.optimizer_seconds = optimizer_seconds();
    return result;
  }
  loss_scaler_.update(false);
  result.grad_scale = kernels::combined_grad_scale(global, static_cast<float>(loss_scale),
                                                   static_cast<float>(clipping));

  // The optimizer writes the homes: after compute's and the gathers' last reads of them.
  const bool overlap_forward = update_can_overlap_forward();
  offload::AppliedStep applied;
  if (overlap_forward) {
    // The optimizer thread waits for those reads itself; step() returns once it has the work.
    std::vector<std::shared_ptr<Event>> readers;
    for (Stream* stream : {&compute_stream(), gather_stream_.get()}) {
      readers.push_back(accelerator().create_event());
      stream->record(*readers.back());
    }
    applied = optimizer_->apply_async(lr, result.grad_scale, loss_scale, std::move(readers));
  } else {
    compute_stream().record(*compute_point_);
    home_stream_->wait(*compute_point_);
    gather_stream_->record(*gather_point_);
    home_stream_->wait(*gather_point_);
    applied = optimizer_->apply(lr, result.grad_scale, loss_scale);
  }
  guard.armed = false;
  if (applied.redo_reason != nullptr && applied.rolled_back) {
    logger().debug("step {}: {}; the sub-group(s) updated during backward are rolled back and redone", steps_ + 1,
                   applied.redo_reason);
  }
  if (applied.landed_twice) {
    logger().warn("step {}: more than one backward after prepare_step(); call it before the last", steps_ + 1);
  }
  ++steps_;
  result.applied = true;
  result.step = steps_;
  result.sub_groups = applied.sub_groups;
  result.sub_groups_overlapped = applied.sub_groups_overlapped;
  result.optimizer_overlapped_seconds = applied.overlapped_seconds;
  result.rolled_back = applied.rolled_back;
  result.overlap_mode = applied.mode;
  result.sub_groups_read_ahead = applied.sub_groups_read_ahead;
  result.sub_groups_prefetched = applied.sub_groups_prefetched;
  result.update_overlaps_forward = overlap_forward;
  result.optimizer_seconds = optimizer_seconds();

  refresh_copies();
  if (overlap_forward) {
    // The next forward's gathers of a sub-group wait for its update; the
    // gradient shards are zeroed once the update has read them (finish_update).
    std::vector<offload::HomeUpdate> updates;
    for (const auto& g : groups_) {
      if (g->shard < 0) continue;
      const auto s = static_cast<size_t>(g->shard);
      updates.push_back({g->home.get(), optimizer_->home_stride(s), optimizer_->home_ready(s)});
    }
    coordinator_->set_home_updates(std::move(updates));
    update_pending_ = true;
    return result;
  }
  zero_grad();
  return result;
}

void ZeroEngine::zero_grad_shards() {
  for (auto& g : groups_) {
    if (g->frozen) continue;
    g->reducer->synchronize();
    g->grads->zero(g->reducer->stream());
  }
}

void ZeroEngine::zero_grad() {
  STRATA_CHECK(finalized(), kBadArgument, "zero_grad() before finalize()");
  finish_update();
  boundary_.reset();  // clip_grad_norm's boundary and clipping go with the gradients
  clip_override_.reset();
  optimizer_->abort();  // a step prepared and abandoned: its speculative updates are undone
  zero_grad_shards();
  if (options_.stage == 1) {
    accelerator().memset_async(stage1_grads_, 0, stage1_grads_nbytes_, compute_stream());
    return;
  }
  // A backward abandoned half way: its partial gradients are dropped.
  compute_stream().record(*compute_point_);
  for (float*& grad : grad_full_) {
    if (grad == nullptr) continue;
    accelerator().deallocate_after(grad, *compute_point_);
    grad = nullptr;
  }
}

void ZeroEngine::refresh_copies() {
  // Copies of the old values are stale: stages 1/2 re-gather now (collective),
  // stage 3 releases them and gathers again at the next use.
  if (coordinator_) {
    coordinator_->release_all();
  } else {
    sync_full_params();
  }
}

void ZeroEngine::sync_full_params() {
  // The gather stream writes the full copies: after compute's last read of them.
  compute_stream().record(*compute_point_);
  gather_stream_->wait(*compute_point_);
  for (auto& gp : groups_) {
    Group& g = *gp;
    const int world = g.gather_comm->world_size();
    const size_t shard_nbytes = g.layout->shard_nbytes();
    const size_t element_nbytes = dtype_nbytes(g.dtype);
    void* all = accelerator().allocate(shard_nbytes * static_cast<size_t>(world));
    g.gather_comm->allgather(g.home->memory(), all, static_cast<size_t>(g.layout->shard_numel()), g.dtype,
                             *gather_stream_);
    for (size_t i = 0; i < g.params.size(); ++i) {
      const partition::ParamSlot& slot = g.layout->param(i);
      char* full = static_cast<char*>(g.full_flat) + g.full_offset[i];
      for (int r = 0; r < world; ++r) {
        const int64_t owned = slot.owned_numel(r);
        if (owned <= 0) continue;
        accelerator().copy_async(full + static_cast<size_t>(slot.owned_begin(r)) * element_nbytes,
                                 static_cast<char*>(all) + static_cast<size_t>(r) * shard_nbytes +
                                     slot.shard_offset_nbytes,
                                 static_cast<size_t>(owned) * element_nbytes, CopyKind::kDeviceToDevice,
                                 *gather_stream_);
      }
    }
    auto done = accelerator().create_event();
    gather_stream_->record(*done);
    accelerator().deallocate_after(all, *done);
  }
  gather_stream_->record(*compute_point_);
  compute_stream().wait(*compute_point_);
  full_params_stale_ = false;
}

// ---- init, load and save -------------------------------------------------------------

void ZeroEngine::for_each_owned_range(ParamId id, Access access, const RangeFn& fn) {
  STRATA_CHECK(finalized(), kBadArgument, "for_each_owned_range before finalize()");
  const ParamInfo& info = param_info(id);
  if (!info.blocks) {
    owned_home_range(id, access, info.dtype, fn);
    return;
  }
  const kernels::QuantBlocks& b = *info.blocks;
  STRATA_CHECK(access == Access::kRead, kBadArgument,
               "parameter '{}' is kept in {} (a frozen weight of a quantized checkpoint): write it with write_blocks",
               info.name, b.name());
  // Its owned stored bytes dequantized on the host, with the kernels the gathers' ops share.
  const uint8_t* grid = kept_scales_[static_cast<size_t>(id)]->host.data();
  owned_home_range(id, Access::kRead, b.stored_dtype(), [&](int64_t first, const TensorView& bytes) {
    int64_t element = first, n = bytes.numel();
    if (b.format == kernels::QuantBlocks::Format::kMxfp4) {
      // Bytes of the codes hold two elements each; the scales' bytes none.
      element = 2 * first;
      n = 2 * std::max<int64_t>(0, std::min(first + bytes.numel(), b.mxfp4.packed_nbytes()) - first);
      if (n == 0) return;
    }
    std::vector<char> values(static_cast<size_t>(n) * dtype_nbytes(info.dtype));
    if (b.format == kernels::QuantBlocks::Format::kFp8) {
      kernels::dequantize_fp8_blocks(bytes.as<uint8_t>(), reinterpret_cast<const float*>(grid), b.fp8, first, n,
                                     values.data(), info.dtype);
    } else {
      kernels::dequantize_mxfp4(bytes.as<uint8_t>(), grid, element, n, values.data(), info.dtype);
    }
    fn(element, TensorView{TensorDesc{info.dtype, {n}, Tier::kCpu}, values.data()});
  });
}

void ZeroEngine::write_blocks(ParamId id, const TensorView& scales, const RangeFn& fn) {
  STRATA_CHECK(finalized(), kBadArgument, "write_blocks before finalize()");
  const ParamInfo& info = param_info(id);
  if (!info.blocks) Engine::write_blocks(id, scales, fn);  // refuses
  const kernels::QuantBlocks& b = *info.blocks;
  STRATA_CHECK(scales.desc.dtype == b.scale_dtype() && scales.desc.shape == b.scale_shape() && scales.data != nullptr,
               kBadArgument, "write_blocks('{}'): the scales are {} {}, not the {} grid {} of its {} blocks", info.name,
               dtype_name(scales.desc.dtype), shape_string(scales.desc.shape), dtype_name(b.scale_dtype()),
               shape_string(b.scale_shape()), b.name());
  if (holds(id)) {
    check_not_prepared("write_blocks");
    finish_update();
    // Gathers in flight read the device grid: they finish first.
    compute_stream().synchronize();
    gather_stream_->synchronize();
    KeptScales& kept = *kept_scales_[static_cast<size_t>(id)];
    std::memcpy(kept.host.data(), scales.data, kept.host.size());
    if (kept.device != nullptr) {
      accelerator().copy_async(kept.device, kept.host.data(), kept.host.size(), CopyKind::kHostToDevice,
                               *home_stream_);
      home_stream_->synchronize();
    }
  }
  owned_home_range(id, Access::kWrite, b.stored_dtype(), fn);
}

void ZeroEngine::owned_home_range(ParamId id, Access access, DType dtype, const RangeFn& fn) {
  check_not_prepared("for_each_owned_range");
  finish_update();
  if (!holds(id)) {
    // Another ep member's expert: its owners have every element of it.
    if (access == Access::kWrite && !coordinator_) full_params_stale_ = true;
    return;
  }
  Group& g = group_of(id);
  const partition::ParamSlot& slot = g.layout->param(index_in_group_[id]);
  const int member = g.gather_comm->rank();
  const int64_t owned = slot.owned_numel(member);
  if (owned <= 0) {
    // Nothing to write here, but every rank must agree that copies are stale
    // (stages 1/2 re-gather collectively at the next pre_op).
    if (access == Access::kWrite) note_written(id);
    return;
  }
  // Nothing queued may touch the home while the host does, and nothing
  // staged may outlive a write.
  compute_stream().synchronize();
  gather_stream_->synchronize();
  if (coordinator_) coordinator_->quiesce();
  const size_t first = static_cast<size_t>(slot.shard_offset_numel), numel = static_cast<size_t>(slot.slice_numel);
  void* host = g.home->host_range(first, numel, /*load=*/true);
  const TensorView view{TensorDesc{dtype, {owned}, Tier::kCpu}, host};
  fn(slot.owned_begin(member), view);
  if (access == Access::kRead) return;
  g.home->store_host_range(first, numel);
  note_written(id);
}

void ZeroEngine::note_written(ParamId id) {
  // Copies made from the old values are stale now.
  if (!coordinator_) {
    full_params_stale_ = true;
  } else if (coordinator_->gathered(id)) {
    STRATA_CHECK(!in_window(id, false), kBadArgument, "parameter '{}' written inside a hook window that uses it",
                 param_info(id).name);
    coordinator_->release(id);
  }
  if (!param_info(id).frozen) optimizer_->mark_stale();  // a frozen parameter has no master weights
}

void ZeroEngine::check_not_prepared(const char* what) const {
  STRATA_CHECK(!step_prepared(), kBadArgument,
               "{}() between prepare_step() and step(): the optimizer may be updating the parameters; call it "
               "between steps",
               what);
}

void ZeroEngine::check_no_backward(const char* what) const {
  STRATA_CHECK(options_.stage == 1 || std::all_of(grad_full_.begin(), grad_full_.end(), [](float* g) { return g == nullptr; }),
               kBadArgument, "{}() with a backward pass not finished (a gradient is still being accumulated)", what);
}

// ---- collectives and counters ----------------------------------------------------------

double ZeroEngine::global_sum(double value) {
  double sum = value;
  allreduce_f64(&sum, 1);
  return sum;
}

double ZeroEngine::job_sum(double value) {
  double sum = value;
  allreduce_f64(&sum, 1);
  if (tensor_stream_ != nullptr) allreduce_f64(&sum, 1, comms_.tensor, tensor_stream_.get());
  if (pipeline_stream_ != nullptr) allreduce_f64(&sum, 1, comms_.pipeline, pipeline_stream_.get());
  return sum;
}

void ZeroEngine::allreduce_f64(double* values, size_t count, partition::Communicator* comm, Stream* stream) {
  if (comm == nullptr) comm = comms_.control;
  if (stream == nullptr) stream = control_stream_.get();
  const size_t nbytes = count * sizeof(double);
  // One small accelerator buffer serves every call (two or three a step, and
  // one per MoE layer's routing), grown to the largest count asked for; each
  // call synchronizes its stream, so no two use it at once.
  if (count > control_slots_) {
    if (control_buffer_ != nullptr) {
      control_stream_->synchronize();
      accelerator().deallocate(control_buffer_);
    }
    control_slots_ = std::max<size_t>(count, 4);
    control_buffer_ = accelerator().allocate(control_slots_ * sizeof(double));
  }
  accelerator().copy_async(control_buffer_, values, nbytes, CopyKind::kHostToDevice, *stream);
  comm->allreduce(control_buffer_, control_buffer_, count, DType::kF64, partition::ReduceOp::kSum, *stream);
  accelerator().copy_async(values, control_buffer_, nbytes, CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
}

int ZeroEngine::rank() const { return comms_.control->rank(); }
int ZeroEngine::world_size() const { return comms_.control->world_size(); }
int ZeroEngine::job_rank() const {
  const int stage = comms_.pipeline != nullptr ? comms_.pipeline->rank() : 0;
  return (stage * world_size() + rank()) * tensor_group().size + tensor_group().rank;
}
int ZeroEngine::job_size() const {
  return world_size() * tensor_group().size * (comms_.pipeline != nullptr ? comms_.pipeline->world_size() : 1);
}
int64_t ZeroEngine::step_count() const { return steps_; }
uint64_t ZeroEngine::nvme_bytes_read() const { return aio_ ? aio_->stats().bytes_read : 0; }
uint64_t ZeroEngine::nvme_bytes_written() const { return aio_ ? aio_->stats().bytes_written : 0; }
size_t ZeroEngine::gathered_nbytes() const { return coordinator_ ? coordinator_->gathered_nbytes() : 0; }
size_t ZeroEngine::peak_gathered_nbytes() const { return coordinator_ ? coordinator_->peak_gathered_nbytes() : 0; }
int64_t ZeroEngine::gathers_issued() const { return coordinator_ ? coordinator_->gathers_issued() : 0; }
PrefetchStats ZeroEngine::last_step_prefetch() const { return coordinator_ ? coordinator_->last_step() : PrefetchStats{}; }
PrefetchStats ZeroEngine::current_prefetch() const { return coordinator_ ? coordinator_->current_step() : PrefetchStats{}; }
int64_t ZeroEngine::trace_drops() const { return coordinator_ ? coordinator_->trace_drops() : 0; }

}  // namespace strata::engine
