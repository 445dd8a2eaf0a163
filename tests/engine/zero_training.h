// Training helpers shared by the ZeRO engine tests: a tiny Llama trained a few
// steps through the ZeroEngine on N ranks (threads of run_zero_ranks), with
// the global batch split over ranks and micro-steps, the loss normalised by
// the global count of predicted tokens, and the final parameters assembled
// from every rank's owned ranges.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/llama_model.h"
#include "tests/engine/zero_rig.h"
#include "tests/nn/test_models.h"

namespace strata::test::zero {

using engine::ParamId;

inline constexpr int64_t kSequences = 4, kSeq = 12;
inline constexpr float kLr = 1e-2f;

inline nn::LlamaConfig model_config(bool tied) {
  nn::LlamaConfig c = nn::tiny_llama(40, 32, 64, 2, 4, 2);
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

struct Batch {
  std::vector<int32_t> ids, targets;
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

inline double counted(std::span<const int32_t> targets) {
  double n = 0;
  for (int32_t t : targets) n += t != ops::kIgnoreIndex;
  return n;
}

struct TrainSpec {
  int world = 1;
  int micro_steps = 1;
  int steps = 3;
  bool tied = false;
  bool checkpoint_activations = false;
  engine::ZeroEngineOptions options;
  // Rank-specific options (e.g. a fault-injecting I/O backend on one rank).
  std::function<void(int rank, engine::ZeroEngineOptions&)> per_rank;
  // Before these steps (0-based), each rank runs an evaluation forward
  // (ForwardOptions::backward = false) on its share of the batch.
  std::vector<int> eval_before;
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
};

struct TrainResult {
  std::vector<std::vector<float>> params;  // every parameter, assembled from the ranks' owned ranges
  std::vector<double> losses;              // global mean loss per step
  std::vector<double> grad_norms;
  std::vector<int> applied;
  size_t peak_gathered_nbytes = 0, gathered_nbytes_after = 0, param_nbytes = 0;
  int64_t gathers = 0;  // allgathers rank 0 issued
  std::vector<engine::PrefetchStats> prefetch;  // rank 0, per step
  int64_t trace_drops = 0;                      // rank 0
  std::vector<std::exception_ptr> errors;       // per rank (collect_errors)
  std::vector<int> failed_step;                 // per rank: the step that threw, -1: none
};

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
        try {
          engine::ZeroEngine eng(accelerator, comms, options);
          const nn::LlamaConfig config = model_config(spec.tied);
          nn::LlamaModelOptions model_options = nn::model_options(DType::kF32, 16);
          model_options.checkpoint_activations = spec.checkpoint_activations;
          nn::LlamaModel model(eng, config, model_options);
          eng.finalize();
          nn::initialize_parameters(eng, model.parameters(), 7);
          const std::string rank_dir = "rank" + std::to_string(rank);
          if (!spec.load_dir.empty()) eng.load_state(spec.load_dir / rank_dir);
          const int64_t per_rank = kSequences / spec.world, per_micro = per_rank / spec.micro_steps;
          std::vector<double> losses, norms;
          std::vector<int> applied;
          std::vector<engine::PrefetchStats> prefetch;
          for (step = spec.first_step; step < spec.steps; ++step) {
            const Batch batch = corpus(step, config.vocab_size);
            const auto rows = [&](int micro) {
              return std::pair{static_cast<size_t>((rank * per_rank + micro * per_micro) * kSeq),
                               static_cast<size_t>(per_micro * kSeq)};
            };
            if (std::find(spec.eval_before.begin(), spec.eval_before.end(), step) != spec.eval_before.end()) {
              const size_t first = static_cast<size_t>(rank * per_rank * kSeq), n = static_cast<size_t>(per_rank * kSeq);
              nn::ForwardOptions eval;
              eval.backward = false;
              model.forward(std::span(batch.ids).subspan(first, n), std::span(batch.targets).subspan(first, n),
                            per_rank, kSeq, eval);
              model.loss_stats();
            }
            double local_count = 0;
            for (int m = 0; m < spec.micro_steps; ++m) {
              auto [first, n] = rows(m);
              local_count += counted(std::span(batch.targets).subspan(first, n));
            }
            const double global_count = eng.global_sum(local_count);
            double loss_sum = 0;
            for (int m = 0; m < spec.micro_steps; ++m) {
              auto [first, n] = rows(m);
              nn::ForwardOptions forward;
              forward.normalizer = global_count;
              model.forward(std::span(batch.ids).subspan(first, n), std::span(batch.targets).subspan(first, n),
                            per_micro, kSeq, forward);
              model.backward();
              loss_sum += model.loss_stats().sum;
            }
            losses.push_back(eng.global_sum(loss_sum) / global_count);
            const engine::StepResult r = eng.step(kLr);
            norms.push_back(r.grad_norm);
            applied.push_back(r.applied);
            prefetch.push_back(eng.last_step_prefetch());
            if (step == spec.save_after_step) {
              std::filesystem::create_directories(spec.save_dir / rank_dir);
              eng.save_state(spec.save_dir / rank_dir);
            }
          }
          step = -1;
          std::lock_guard lock(mutex);
          if (result.params.empty()) {
            for (ParamId id = 0; id < eng.parameter_count(); ++id) {
              result.params.emplace_back(static_cast<size_t>(eng.param_info(id).numel()), std::nanf(""));
              result.param_nbytes += eng.param_info(id).nbytes();
            }
          }
          for (ParamId id = 0; id < eng.parameter_count(); ++id) {
            eng.for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
              std::copy_n(host.as<float>(), host.numel(), result.params[id].begin() + first);
            });
          }
          if (rank == 0) {
            result.losses = losses;
            result.grad_norms = norms;
            result.applied = applied;
            result.peak_gathered_nbytes = eng.peak_gathered_nbytes();
            result.gathered_nbytes_after = eng.gathered_nbytes();
            result.gathers = eng.gathers_issued();
            result.prefetch = prefetch;
            result.trace_drops = eng.trace_drops();
          }
        } catch (...) {
          if (!spec.collect_errors) throw;
          std::lock_guard lock(mutex);
          result.errors[static_cast<size_t>(rank)] = std::current_exception();
          result.failed_step[static_cast<size_t>(rank)] = step;
        }
      },
      spec.timeout);
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
  for (size_t p = 0; p < a.params.size(); ++p) {
    REQUIRE(a.params[p].size() == b.params[p].size());
    for (size_t i = 0; i < a.params[p].size(); ++i) {
      const float x = a.params[p][i], y = b.params[p][i];
      REQUIRE(std::isfinite(x));
      REQUIRE(std::isfinite(y));
      d.identical = d.identical && std::memcmp(&x, &y, sizeof(float)) == 0;
      d.max_abs = std::max(d.max_abs, static_cast<double>(std::fabs(x - y)));
      d.max_ref = std::max(d.max_ref, static_cast<double>(std::fabs(y)));
    }
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

}  // namespace strata::test::zero
