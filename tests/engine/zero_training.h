// Training helpers shared by the ZeRO engine tests: a tiny Llama trained a few
// steps through the ZeroEngine on N ranks (threads of run_zero_ranks), with
// the global batch split over ranks and micro-steps, the loss normalised by
// the global count of predicted tokens, and the final parameters assembled
// from every rank's owned ranges; and the reference they are held against,
// ONE rank with everything resident on the combined batch (train_resident).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <mutex>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/optimizer.h"
#include "nvme/io_backend.h"
#include "offload/optimizer_swapper.h"
#include "partition/layout.h"
#include "core/error.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/param_files.h"
#include "tests/engine/zero_rig.h"
#include "tests/nn/test_models.h"

namespace strata::test::zero {

using engine::ParamId;

inline constexpr int64_t kSequences = 4, kSeq = 12;
inline constexpr float kLr = 1e-2f;

inline nn::DecoderConfig model_config(bool tied) {
  nn::DecoderConfig c = nn::tiny_llama(40, 32, 64, 2, 4, 2);
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// model_config's shape as a Mixtral: `experts` SwiGLU experts of width
// `width` per layer, top 2, with the load-balancing loss when `aux`.
inline nn::DecoderConfig mixtral_config(int64_t experts, int64_t width, bool aux) {
  nn::DecoderConfig c = model_config(false);
  c.model_type = "mixtral";
  c.num_experts = experts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = width;
  c.norm_topk_prob = true;
  c.router_aux_loss_coef = aux ? 0.05 : 0;
  c.output_router_logits = aux;
  return c;
}

struct Batch {
  std::vector<int32_t> ids, targets;
  std::vector<int32_t> positions;  // packed documents (ForwardOptions::positions); empty: none
};

// Step `step`'s global batch: random tokens, the next token as target, about
// one target in four ignored (so ranks' counts differ).
inline Batch corpus(int step, int64_t vocab) {
  std::mt19937 gen(static_cast<uint32_t>(100 + step));
  Batch b;
  for (int64_t s = 0; s < kSequences; ++s) {
    std::vector<int32_t> tokens(kSeq + 1);
    for (auto& t : tokens) t = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
    for (int64_t i = 0; i < kSeq; ++i) {
      b.ids.push_back(tokens[i]);
      b.targets.push_back(gen() % 4 == 0 ? ops::kIgnoreIndex : tokens[i + 1]);
    }
  }
  return b;
}

// Every sequence one token repeated: all its positions have the same hidden
// state, so each sequence routes to 2 experts per layer and a step's 4
// sequences to at most 8 of 16 experts. The tokens change with the step, so the
// routed set does too (the last step's prediction is wrong in part).
inline Batch repeated_tokens(int step, int64_t vocab) {
  std::mt19937 gen(static_cast<uint32_t>(300 + step));
  Batch b;
  for (int64_t s = 0; s < kSequences; ++s) {
    const auto token = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
    for (int64_t i = 0; i < kSeq; ++i) {
      b.ids.push_back(token);
      b.targets.push_back(token);
    }
  }
  return b;
}

// Makes step `step`'s global batch (kSeq tokens per sequence) for a model of
// `vocab` tokens; empty: corpus.
using BatchFn = std::function<Batch(int step, int64_t vocab)>;
inline Batch batch_for(const BatchFn& batches, int step, int64_t vocab) {
  return batches ? batches(step, vocab) : corpus(step, vocab);
}
inline int64_t sequences_of(const Batch& b) { return static_cast<int64_t>(b.ids.size()) / kSeq; }

inline double counted(std::span<const int32_t> targets) {
  double n = 0;
  for (int32_t t : targets) n += t != ops::kIgnoreIndex;
  return n;
}

struct TrainSpec {
  int world = 1;
  // Tensor parallelism: world = tp x dp ranks (partition::ParallelLayout);
  // the batch is split over the dp ranks, and each parameter is assembled
  // from its tp shards into its whole tensor.
  int tp = 1;
  bool sequence_parallel = false;  // Megatron's, over the tp group (nn::DecoderModelOptions)
  // Context parallelism: world = dp x cp x tp ranks; the ranks of a cp group
  // get the same rows (the model takes its chunks), ZeRO runs over dp x cp.
  int cp = 1;
  nn::ContextMethod cp_method = nn::ContextMethod::kRing;
  nn::LoraSpec lora;  // adapters (the model then freezes the rest)
  double init_std = 0.02;  // nn::initialize_parameters' std of the matrices
  int micro_steps = 1;
  int steps = 3;
  bool tied = false;
  std::optional<nn::DecoderConfig> config;  // empty: model_config(tied)
  bool checkpoint_activations = false;
  engine::ZeroEngineOptions options;
  BatchFn batches;  // empty: corpus (kSequences sequences)
  // Call prepare_step before the last micro-step, as `strata finetune` does:
  // the optimizer may then overlap that backward (overlap_optimizer). On by
  // default, so every engine test also holds with the overlap.
  bool prepare_step = true;
  // The micro-step prepare_step precedes; -1: the last (more than one backward
  // after it is misuse the engine detects and redoes exactly).
  int prepare_micro = -1;
  // prepare_step before that micro-step's forward (as finetune does), or
  // right after it.
  bool prepare_before_forward = true;
  // How the optimizer uses the backward after prepare_step (ZeroEngine::set_overlap_policy).
  offload::OverlapPolicy overlap_policy = offload::OverlapPolicy::kAuto;
  // The model's dtype (parameters are read back widened to fp32).
  DType dtype = DType::kF32;
  // Per step (0-based): the lr step() gets (empty: options.adam.lr), the lr
  // prepare_step gets (empty: the step's), rank's ForwardOptions::grad_scale
  // (empty: 1; infinity makes that rank's gradients non-finite).
  std::function<float(int step)> lr, prepare_lr;
  std::function<float(int rank, int step)> grad_scale;
  // This step runs its micro-steps once, is abandoned (zero_grad), then runs for real.
  int abandoned_step = -1;
  // Parameters to freeze (Engine::freeze) by name; empty: none.
  std::function<bool(const std::string& name)> frozen;
  // Each parameter's lr scale (Engine::set_lr_scale) by name; empty: 1.
  std::function<float(const std::string& name)> lr_scale;
  // > 0: ZeroEngine::clip_grad_norm(clip_grad_norm) before each step (its
  // norm must be the step's grad_norm).
  double clip_grad_norm = 0;
  // Called on each rank after each step (0-based), before any checkpoint.
  std::function<void(int rank, int step, engine::ZeroEngine&)> after_step;
  // Rank-specific options (e.g. a fault-injecting I/O backend on one rank).
  std::function<void(int rank, engine::ZeroEngineOptions&)> per_rank;
  // Before these steps (0-based), each rank runs an evaluation forward
  // (ForwardOptions::backward = false) on its share of the batch.
  std::vector<int> eval_before;
  // ... bracketed by ZeroEngine::begin_evaluation / end_evaluation.
  bool eval_marked = false;
  // Communicator timeout (a failing rank's peers give up within it).
  std::chrono::milliseconds timeout{30000};
  // Catch each rank's error into TrainResult::errors instead of rethrowing.
  bool collect_errors = false;
  // Checkpoints: after step `save_after_step` (0-based) each rank saves its
  // state to save_dir/rank<r>; with load_dir, each rank loads
  // load_dir/rank<r> after initialisation and training starts at first_step.
  std::filesystem::path save_dir;
  int save_after_step = -1;
  std::filesystem::path load_dir;
  int first_step = 0;
  // > 0: DeepSeek's auxiliary-loss-free balancing after each step
  // (DecoderModel::update_correction_biases, as strata finetune runs it).
  float router_bias_update_rate = 0;
};

struct TrainResult {
  std::vector<std::string> names;          // every parameter's, in id order
  std::vector<std::vector<float>> params;  // every parameter, assembled from the ranks' owned ranges
  std::vector<std::vector<float>> initial_params;  // before training (train_resident only)
  std::vector<double> losses;              // global mean loss per step
  std::vector<double> grad_norms;
  std::vector<int> applied;
  std::vector<engine::StepResult> steps;   // rank 0, per step
  size_t peak_gathered_nbytes = 0, gathered_nbytes_after = 0, param_nbytes = 0;
  int64_t gathers = 0;  // allgathers rank 0 issued
  std::vector<engine::PrefetchStats> prefetch;  // rank 0, per step
  int64_t trace_drops = 0;                      // rank 0
  int expert_group_size = 1;                    // rank 0's Engine::expert_group().size
  int64_t held_expert_params = 0;               // rank 0: expert parameters it holds (owns_expert)
  size_t arena_nbytes = 0;                      // rank 0: DecoderModel::arena_nbytes()
  size_t context_buffer_nbytes = 0;             // rank 0: DecoderModel::context_buffer_nbytes()
  int64_t tp_replica_mismatches = 0;            // elements of a replicated tensor whose tp copies differ
  int tensor_group_size = 1;                    // rank 0's Engine::tensor_group().size
  engine::ZeroEngine::TensorTraffic tensor_traffic;  // rank 0's tp collectives over the run
  int64_t tp_split_elements = 0;                // rank 0: elements of the tp shards it holds
  // Rank 0's parameters as it declared them: (shape, tp_split) in id order.
  std::vector<std::pair<Shape, bool>> rank0_params;
  std::vector<std::exception_ptr> errors;       // per rank (collect_errors)
  std::vector<int> failed_step;                 // per rank: the step that threw, -1: none
};

// Every rank's I/O (or only rank `only`'s) through the fault backend
// following `plan` (one plan across ranks and queues: it counts them all).
inline void use_io_faults(TrainSpec& spec, std::shared_ptr<nvme::FaultPlan> plan, int only = -1) {
  spec.per_rank = [plan, only](int rank, engine::ZeroEngineOptions& o) {
    if (only >= 0 && rank != only) return;
    o.io_backend = [plan, engine = o.aio.engine] { return nvme::make_fault_backend(nvme::make_backend(engine), plan); };
  };
}

inline TrainResult train_zero(const TrainSpec& spec) {
  TrainResult result;
  result.errors.resize(static_cast<size_t>(spec.world));
  result.failed_step.assign(static_cast<size_t>(spec.world), -1);
  std::mutex mutex;
  test::run_zero_ranks(
      spec.world,
      [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
        engine::ZeroEngineOptions options = spec.options;
        if (spec.per_rank) spec.per_rank(rank, options);
        int step = -1;
        const int dp = spec.world / (spec.tp * spec.cp), dp_rank = rank / (spec.tp * spec.cp);
        const int cp_rank = rank / spec.tp % spec.cp;
        try {
          engine::ZeroEngine eng(accelerator, comms, options);
          eng.set_overlap_policy(spec.overlap_policy);
          const nn::DecoderConfig config = spec.config ? *spec.config : model_config(spec.tied);
          nn::DecoderModelOptions model_options = nn::model_options(spec.dtype, 16);
          model_options.checkpoint_activations = spec.checkpoint_activations;
          model_options.sequence_parallel = spec.sequence_parallel;
          model_options.context_method = spec.cp_method;
          model_options.lora = spec.lora;
          nn::DecoderModel model(eng, config, model_options);
          if (spec.frozen) {
            for (ParamId id = 0; id < eng.parameter_count(); ++id) {
              if (spec.frozen(eng.param_info(id).name)) eng.freeze(id);
            }
          }
          if (spec.lr_scale) {
            for (ParamId id = 0; id < eng.parameter_count(); ++id) {
              eng.set_lr_scale(id, spec.lr_scale(eng.param_info(id).name));
            }
          }
          eng.finalize();
          nn::initialize_parameters(eng, model.parameters(), 7, spec.init_std);
          const std::string rank_dir = "rank" + std::to_string(rank);
          if (!spec.load_dir.empty()) eng.load_state(spec.load_dir / rank_dir);
          std::vector<double> losses, norms;
          std::vector<int> applied;
          std::vector<engine::PrefetchStats> prefetch;
          std::vector<engine::StepResult> steps;
          for (step = spec.first_step; step < spec.steps; ++step) {
            const Batch batch = batch_for(spec.batches, step, config.vocab_size);
            const int64_t sequences = sequences_of(batch);
            STRATA_CHECK(sequences % (dp * spec.micro_steps) == 0, kBadArgument,
                         "{} dp ranks x {} micro-steps do not divide the batch's {} sequences", dp,
                         spec.micro_steps, sequences);
            const int64_t per_rank = sequences / dp, per_micro = per_rank / spec.micro_steps;
            const auto rows = [&](int micro) {
              return std::pair{static_cast<size_t>((dp_rank * per_rank + micro * per_micro) * kSeq),
                               static_cast<size_t>(per_micro * kSeq)};
            };
            const auto positions = [&](size_t first, size_t n) {
              return batch.positions.empty() ? std::span<const int32_t>{}
                                             : std::span<const int32_t>(batch.positions).subspan(first, n);
            };
            if (std::find(spec.eval_before.begin(), spec.eval_before.end(), step) != spec.eval_before.end()) {
              const size_t first = static_cast<size_t>(dp_rank * per_rank * kSeq), n = static_cast<size_t>(per_rank * kSeq);
              nn::ForwardOptions eval;
              eval.backward = false;
              eval.positions = positions(first, n);
              if (spec.eval_marked) eng.begin_evaluation();
              model.forward(std::span(batch.ids).subspan(first, n), std::span(batch.targets).subspan(first, n),
                            per_rank, kSeq, eval);
              model.loss_stats();
              if (spec.eval_marked) eng.end_evaluation();
            }
            double local_count = 0;
            // The members of a cp group hold the same rows: one counts them.
            for (int m = 0; m < spec.micro_steps && cp_rank == 0; ++m) {
              auto [first, n] = rows(m);
              local_count += counted(std::span(batch.targets).subspan(first, n));
            }
            const double global_count = eng.global_sum(local_count);
            const float lr = spec.lr ? spec.lr(step) : options.adam.lr;
            model.reset_router_load();
            const auto micro_steps = [&](double& loss_sum) {
              for (int m = 0; m < spec.micro_steps; ++m) {
                const int prepare_at = spec.prepare_micro >= 0 ? spec.prepare_micro : spec.micro_steps - 1;
                const bool prepare = spec.prepare_step && m == prepare_at;
                if (prepare && spec.prepare_before_forward) eng.prepare_step(spec.prepare_lr ? spec.prepare_lr(step) : lr);
                auto [first, n] = rows(m);
                nn::ForwardOptions forward;
                forward.normalizer = global_count;
                forward.positions = positions(first, n);
                if (spec.grad_scale) forward.grad_scale = spec.grad_scale(rank, step);
                model.forward(std::span(batch.ids).subspan(first, n), std::span(batch.targets).subspan(first, n),
                              per_micro, kSeq, forward);
                if (prepare && !spec.prepare_before_forward) eng.prepare_step(spec.prepare_lr ? spec.prepare_lr(step) : lr);
                model.backward();
                loss_sum += model.loss_stats().sum;
              }
            };
            double loss_sum = 0;
            if (step == spec.abandoned_step) {
              micro_steps(loss_sum);
              eng.zero_grad();  // abandoned after backward (what was speculated is undone)
              loss_sum = 0;
            }
            micro_steps(loss_sum);
            losses.push_back(eng.global_sum(loss_sum) / global_count);
            const double clip_norm = spec.clip_grad_norm > 0 ? eng.clip_grad_norm(spec.clip_grad_norm) : -1;
            const engine::StepResult r = eng.step(lr);
            STRATA_CHECK(clip_norm < 0 || clip_norm == r.grad_norm, kInternal,
                         "clip_grad_norm gave {}, the step's norm is {}", clip_norm, r.grad_norm);
            if (spec.router_bias_update_rate > 0 && r.applied) model.update_correction_biases(spec.router_bias_update_rate);
            steps.push_back(r);
            norms.push_back(r.grad_norm);
            applied.push_back(r.applied);
            prefetch.push_back(eng.last_step_prefetch());
            if (spec.after_step) spec.after_step(rank, step, eng);
            if (step == spec.save_after_step) {
              std::filesystem::create_directories(spec.save_dir / rank_dir);
              eng.save_state(spec.save_dir / rank_dir);
            }
          }
          step = -1;
          std::lock_guard lock(mutex);
          // Whole tensors: a tp shard's elements go where its slice places them.
          const auto tensor_numel = [](const engine::ParamInfo& p) {
            return p.tp_split ? shape_numel(p.slice->tensor_shape) : p.numel();
          };
          if (result.params.empty()) {
            for (ParamId id = 0; id < eng.parameter_count(); ++id) {
              const engine::ParamInfo& p = eng.param_info(id);
              result.names.push_back(p.name);
              result.params.emplace_back(static_cast<size_t>(tensor_numel(p)), std::nanf(""));
              result.param_nbytes += static_cast<size_t>(tensor_numel(p)) * dtype_nbytes(p.dtype);
            }
          }
          std::vector<float> widened;
          for (ParamId id = 0; id < eng.parameter_count(); ++id) {
            const engine::ParamInfo& p = eng.param_info(id);
            eng.for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
              widened.resize(static_cast<size_t>(host.numel()));
              convert(host.data, host.desc.dtype, widened.data(), DType::kF32, widened.size());
              if (!p.tp_split) {
                // Every tp rank holds a replicated tensor: its copies must agree bit for bit.
                float* out = result.params[id].data() + first;
                for (size_t i = 0; i < widened.size(); ++i) {
                  result.tp_replica_mismatches +=
                      !std::isnan(out[i]) && std::memcmp(&out[i], &widened[i], sizeof(float)) != 0;
                  out[i] = widened[i];
                }
                return;
              }
              // A block several tp ranks hold (a shared kv head): the copies must agree too.
              nn::for_each_tensor_run(p, first, host.numel(), [&](int64_t at, int64_t from, int64_t n) {
                float* out = result.params[id].data() + at;
                const float* in = widened.data() + (from - first);
                for (int64_t i = 0; i < n; ++i) {
                  result.tp_replica_mismatches += !std::isnan(out[i]) && std::memcmp(&out[i], &in[i], sizeof(float)) != 0;
                  out[i] = in[i];
                }
              });
            });
          }
          if (rank == 0) {
            result.losses = losses;
            result.steps = steps;
            result.grad_norms = norms;
            result.applied = applied;
            result.peak_gathered_nbytes = eng.peak_gathered_nbytes();
            result.gathered_nbytes_after = eng.gathered_nbytes();
            result.gathers = eng.gathers_issued();
            result.prefetch = prefetch;
            result.trace_drops = eng.trace_drops();
            result.expert_group_size = eng.expert_group().size;
            result.tensor_group_size = eng.tensor_group().size;
            result.tensor_traffic = eng.tensor_traffic();
            result.arena_nbytes = model.arena_nbytes();
            result.context_buffer_nbytes = model.context_buffer_nbytes();
            for (ParamId id = 0; id < eng.parameter_count(); ++id) {
              const engine::ParamInfo& info = eng.param_info(id);
              result.held_expert_params += info.expert >= 0 && eng.owns_expert(info.expert, info.experts);
              if (info.tp_split) result.tp_split_elements += info.numel();
              result.rank0_params.emplace_back(info.shape, info.tp_split);
            }
          }
        } catch (...) {
          if (!spec.collect_errors) throw;
          std::lock_guard lock(mutex);
          result.errors[static_cast<size_t>(rank)] = std::current_exception();
          result.failed_step[static_cast<size_t>(rank)] = step;
        }
      },
      spec.timeout, spec.options.expert_parallel_size, spec.tp, spec.cp);
  return result;
}

// The reference: ONE rank with everything resident (ResidentEngine) on the
// combined batch, and the optimizer the ZeroEngine runs (OptimizerSwapper, CPU
// Adam) over the same one-rank flat layout, with the engine's clipping: the
// global norm from kernels::grad_stats per optimizer sub-group, merged in
// order (one thread, as options_for's optimizer_threads: the f64 sum then
// runs in the engine's order), and kernels::combined_grad_scale folded into
// the update. One ZeRO rank without accumulation matches it bit for bit.
struct ResidentSpec {
  int steps = 3;
  bool tied = false;
  std::optional<nn::DecoderConfig> config;  // empty: model_config(tied)
  nn::DecoderModelOptions model = nn::model_options(DType::kF32, 16);
  uint64_t init_seed = 7;
  double init_std = 0.02;  // nn::initialize_parameters' std of the matrices
  kernels::AdamConfig adam;
  double gradient_clipping = 0;  // max global norm; 0: none
  int64_t sub_group_numel = 1'000'000'000;  // the engine's sub_group_size (norm summation order)
  BatchFn batches;               // empty: corpus
  // Parameters not trained (by name): left out of the optimizer's layout, as
  // the ZeroEngine leaves its frozen groups out of the optimizer.
  std::function<bool(const std::string& name)> frozen;
  float router_bias_update_rate = 0;  // as TrainSpec's
};

inline TrainResult train_resident(const ResidentSpec& spec) {
  auto accelerator = make_cpu_accelerator();
  engine::ResidentEngine eng(*accelerator);
  const nn::DecoderConfig config = spec.config ? *spec.config : model_config(spec.tied);
  nn::DecoderModel model(eng, config, spec.model);
  std::vector<ParamId> trained;  // the optimizer's parameters, in declaration order
  for (ParamId id = 0; id < eng.parameter_count(); ++id) {
    if (eng.param_info(id).frozen) continue;  // frozen by the model (a buffer: the correction bias)
    if (spec.frozen && spec.frozen(eng.param_info(id).name)) {
      eng.freeze(id);
    } else {
      trained.push_back(id);
    }
  }
  eng.finalize();
  nn::initialize_parameters(eng, model.parameters(), spec.init_seed, spec.init_std);
  std::vector<partition::ParamSpec> specs;
  for (ParamId id : trained) specs.push_back({eng.param_info(id).name, eng.param_info(id).shape, DType::kF32});
  partition::LayoutOptions layout_options;
  layout_options.sub_group_numel = spec.sub_group_numel;
  partition::PartitionLayout layout(specs, layout_options);
  const auto shard_numel = static_cast<size_t>(layout.shard_numel());
  offload::OptimizerSwapperOptions options;
  options.numel = shard_numel;
  options.sub_group_numel = shard_numel;
  options.adam = spec.adam;
  offload::OptimizerSwapper swapper(options, nullptr, nullptr);
  std::vector<float> master(shard_numel, 0.0f), grads(shard_numel, 0.0f);
  for (size_t i = 0; i < trained.size(); ++i) {
    layout.shard_param(i, eng.param_storage(trained[i]).data, 0, master.data());
  }
  swapper.initialize(master.data());
  TrainResult result;
  const auto snapshot = [&](std::vector<std::vector<float>>& out) {
    for (ParamId id = 0; id < eng.parameter_count(); ++id) {
      const float* p = eng.param_storage(id).as<float>();
      out.emplace_back(p, p + eng.param_info(id).numel());
    }
  };
  snapshot(result.initial_params);
  for (int step = 0; step < spec.steps; ++step) {
    const Batch batch = batch_for(spec.batches, step, config.vocab_size);
    eng.zero_grad();
    model.reset_router_load();
    nn::ForwardOptions forward;
    forward.positions = batch.positions;
    model.forward(batch.ids, batch.targets, sequences_of(batch), kSeq, forward);
    model.backward();
    result.losses.push_back(model.loss());
    eng.compute_stream().synchronize();
    for (size_t i = 0; i < trained.size(); ++i) {
      layout.shard_param(i, eng.grad_storage(trained[i]).data, 0, grads.data());
    }
    kernels::GradStats stats;
    size_t first = 0;
    for (const auto& sub_group : layout.sub_groups()) {
      const auto numel = static_cast<size_t>(sub_group.numel);
      stats = kernels::merge(stats, kernels::grad_stats(grads.data() + first, DType::kF32, numel, 1.0f, std::nullopt, 1));
      first += numel;
    }
    result.grad_norms.push_back(stats.norm());
    result.applied.push_back(1);
    swapper.set_lr(spec.adam.lr);
    offload::StepInputs inputs;  // the fp32 gradient shard, no 16-bit copy
    inputs.grad = grads.data();
    inputs.grad_dtype = DType::kF32;
    inputs.grad_scale = kernels::combined_grad_scale(stats, 1.0f, static_cast<float>(spec.gradient_clipping));
    swapper.step(inputs);
    swapper.load_state(master.data(), nullptr, nullptr);
    for (size_t i = 0; i < trained.size(); ++i) {
      layout.gather_param(i, {master.data()}, eng.param_storage(trained[i]).data);
    }
    if (spec.router_bias_update_rate > 0) model.update_correction_biases(spec.router_bias_update_rate);
  }
  for (ParamId id = 0; id < eng.parameter_count(); ++id) result.names.push_back(eng.param_info(id).name);
  snapshot(result.params);
  return result;
}

// Largest |a - b| over every element, and whether any element differs in its bits.
struct Diff {
  double max_abs = 0, max_ref = 0;
  bool identical = true;
};
inline Diff compare(const TrainResult& a, const TrainResult& b) {
  Diff d;
  REQUIRE(a.params.size() == b.params.size());
  // One assertion per parameter, not per element: Catch2 assertions cost
  // about a microsecond each, and the matrix compares millions of elements.
  for (size_t p = 0; p < a.params.size(); ++p) {
    REQUIRE(a.params[p].size() == b.params[p].size());
    size_t not_finite = 0;
    for (size_t i = 0; i < a.params[p].size(); ++i) {
      const float x = a.params[p][i], y = b.params[p][i];
      not_finite += !std::isfinite(x) || !std::isfinite(y);
      d.identical = d.identical && std::memcmp(&x, &y, sizeof(float)) == 0;
      d.max_abs = std::max(d.max_abs, static_cast<double>(std::fabs(x - y)));
      d.max_ref = std::max(d.max_ref, static_cast<double>(std::fabs(y)));
    }
    CAPTURE(p);
    REQUIRE(not_finite == 0);
  }
  return d;
}

inline engine::ZeroEngineOptions options_for(int stage) {
  engine::ZeroEngineOptions o;
  o.stage = stage;
  o.adam.lr = kLr;
  o.adam.weight_decay = 0.01f;
  o.reduce_bucket_numel = 3000;  // several buckets per backward
  o.persistence_threshold_numel = 0;
  o.optimizer_threads = 1;
  return o;
}

// options_for(stage) on these tiers (`swap` the NVMe directory when one is
// nvme), with Adam's eps 1: the equivalence tests against one resident rank
// compare to rounding, and a tiny eps would magnify rounding-size gradient
// differences into large updates.
inline engine::ZeroEngineOptions options_on(int stage, Tier param, Tier optimizer, const std::filesystem::path& swap) {
  engine::ZeroEngineOptions o = options_for(stage);
  o.adam.eps = 1.0f;
  o.param_tier = param;
  o.optimizer_tier = optimizer;
  if (param == Tier::kNvme || optimizer == Tier::kNvme) o.nvme_path = swap;
  return o;
}

// Stage 3 with nothing gathered ahead and nothing kept for a later use:
// every operator's parameters are gathered at its pre_op.
inline engine::ZeroEngineOptions prefetch_off(engine::ZeroEngineOptions o) {
  o.prefetch_bucket_numel = 0;
  o.max_reuse_distance_numel = 0;
  return o;
}

}  // namespace strata::test::zero
