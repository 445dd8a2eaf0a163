// strata-train --pp: the pipeline benchmark (pipeline_bench.h).
#include "bench/strata-train/pipeline_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "bench/common/json_output.h"
#include "bench/common/stats.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/ops.h"
#include "partition/process_groups.h"
#include "partition/rendezvous.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/pipeline/executor.h"
#include "runtime/train/zero_config.h"

namespace strata::bench::train {
namespace {

constexpr auto kTimeout = std::chrono::milliseconds(600'000);  // a slow step on a loaded machine is not a dead peer

// What each stage reports per step (gathered over the pipeline group).
enum Figure : size_t { kBusy, kWindow, kForward, kBackward, kWeight, kActivation, kSlots, kFigures };

double median_of(std::vector<double> v) { return v.empty() ? 0.0 : median(v); }

}  // namespace

void add_pipeline_flags(CLI::App& app, PipelineFlags& f) {
  app.add_option("--pp", f.stages,
                 "pipeline parallelism: this many stages split the layers, one rank each per pipeline "
                 "(`strata run -n pp x dp -- strata-train --pp N ...`; resident stages, or --zero over each stage's "
                 "dp ranks); prints each stage's idle share of the step against the schedule's formula")
      ->check(CLI::Range(2, 1 << 10));
  app.add_option("--pp-schedule", f.schedule, "--pp: the schedule")
      ->capture_default_str()
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1"}));
  app.add_option("--virtual-stages", f.virtual_stages, "--pp: chunks of layers per rank (interleaved)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--micro-batches", f.micro_batches,
                 "micro-batches per step, their gradients accumulated (--pp: default 2 x --pp; --zero: default 1, "
                 "in --micro-batch-order); --batch is each micro-batch's sequences")
      ->check(CLI::Range(0, 1 << 16));
}

int run_pipeline(const ModelRun& run, const PipelineFlags& flags, const ZeroFlags& zero) {
  STRATA_CHECK(std::getenv("RANK") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr, kBadArgument,
               "--pp {}: the stages are processes: run `strata run -n {} -- strata-train --pp {} ...`", flags.stages,
               flags.stages, flags.stages);
  const partition::RankInfo info = partition::RankInfo::from_env();
  STRATA_CHECK(info.world_size % flags.stages == 0, kBadArgument, "--pp {} does not divide the {} ranks (-n)",
               flags.stages, info.world_size);
  const partition::ParallelLayout layout(info.world_size, 1, 1, flags.stages);
  const int dp = layout.dp_size();
  STRATA_CHECK(zero.stage > 0 || dp == 1, kBadArgument,
               "--pp {} on {} ranks is {} data-parallel pipelines: give --zero N (the resident engine runs one "
               "pipeline)",
               flags.stages, info.world_size, dp);
  const auto kind = pipeline::parse_schedule(flags.schedule);
  const int m = flags.micro_batches > 0 ? flags.micro_batches : 2 * flags.stages;
  const pipeline::ScheduleSpec spec{*kind, flags.stages, m, flags.virtual_stages};
  spec.check();
  set_log_rank(info.rank, info.world_size);
  if (run.threads > 0) ops::set_cpu_threads(run.threads);
  std::unique_ptr<Accelerator> accelerator = make_accelerator(run.accelerator);
  partition::Rendezvous rendezvous(info, kTimeout);

  std::unique_ptr<engine::Engine> eng;
  strata::train::ZeroCommunicators comms;
  std::unique_ptr<partition::Communicator> resident_pp;
  partition::Communicator* pipe = nullptr;
  engine::ZeroEngine* zero_engine = nullptr;
  if (zero.stage > 0) {
    comms = strata::train::make_zero_communicators(*accelerator, rendezvous.store(), info.rank, info.world_size,
                                                   kTimeout, "strata-train/pipeline", 1, 1, flags.stages);
    pipe = comms.pipeline.get();
    auto z = std::make_unique<engine::ZeroEngine>(*accelerator, comms.comms(), zero_options(run, zero));
    zero_engine = z.get();
    eng = std::move(z);
  } else {
    partition::CommunicatorOptions options;
    options.rank = info.rank;
    options.world_size = info.world_size;
    options.timeout = kTimeout;
    options.prefix = "strata-train/pipeline";
    resident_pp = partition::make_group_communicator(*accelerator, rendezvous.store(), options,
                                                     layout.group_of(partition::GroupKind::kPipeline, info.rank));
    pipe = resident_pp.get();
    eng = std::make_unique<engine::ResidentEngine>(*accelerator);
  }
  const auto models = pipeline::make_stage_models(*eng, run.config, model_options(run), spec, *pipe);
  eng->finalize();
  std::vector<nn::DecoderModel*> chunks;
  for (const auto& model : models) {
    nn::initialize_parameters(*eng, model->parameters(), 0);
    chunks.push_back(model.get());
  }
  pipeline::PipelineExecutor executor(*eng, *pipe, spec, chunks);
  // Each micro-batch: --batch sequences of random tokens (the same every step).
  std::mt19937 gen(static_cast<uint32_t>(1 + layout.dp_rank(info.rank)));
  const auto rows = static_cast<size_t>(run.batch * run.seq);
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(m)), targets(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) {
    for (size_t r = 0; r < rows; ++r) {
      ids[static_cast<size_t>(i)].push_back(static_cast<int32_t>(gen() % static_cast<uint32_t>(run.config.vocab_size)));
      targets[static_cast<size_t>(i)].push_back(
          static_cast<int32_t>(gen() % static_cast<uint32_t>(run.config.vocab_size)));
    }
  }
  const double count = static_cast<double>(rows) * m * dp;
  const auto micro_batch = [&](int i) {
    return pipeline::MicroBatch{ids[static_cast<size_t>(i)], targets[static_cast<size_t>(i)], {}, run.batch, run.seq};
  };
  const int p = flags.stages, stage = pipe->rank();
  const bool leader = info.rank == 0;
  if (leader) {
    const std::vector<int64_t> split =
        pipeline::split_layers(run.config.num_hidden_layers, p, spec.virtual_stages);
    std::string layers;
    for (int64_t n : split) layers += (layers.empty() ? "" : ",") + std::to_string(n);
    fmt::print("strata-train --pp {}: {} | hidden {} layers {} ({} per {}stage) heads {} vocab {} | micro-batch {} x "
               "{} tokens, {} micro-batches, {} data-parallel pipeline(s) | {} | {} | {} thread(s) per rank\n",
               p, accelerator->name(), run.config.hidden_size, run.config.num_hidden_layers, layers,
               spec.virtual_stages > 1 ? "virtual " : "", run.config.num_attention_heads, run.config.vocab_size,
               run.batch, run.seq, m, dp,
               fmt::format("{}{}", pipeline::schedule_name(spec.kind),
                           spec.virtual_stages > 1 ? fmt::format(" v {}", spec.virtual_stages) : std::string()),
               zero.stage > 0 ? fmt::format("ZeRO-{} over each stage's {} dp rank(s)", zero.stage, dp)
                              : std::string("resident stages"),
               run.threads);
  }
  // Per step, every stage's figures and its compute actions' times in list
  // order (rank 0's pipeline).
  std::vector<std::vector<double>> steps, action_steps;
  const pipeline::Schedule schedule = pipeline::make_schedule(spec);
  size_t computes = 0;
  for (const pipeline::Action& a : schedule.ranks.front()) computes += a.compute();
  auto stream = accelerator->create_stream();
  std::vector<double> round_step;
  nlohmann::json rounds = nlohmann::json::array();
  for (int round = 0; round < run.rounds; ++round) {
    std::vector<double> windows;
    for (int s = 0; s < (round == 0 ? run.warmup : 0) + run.steps; ++s) {
      if (zero_engine == nullptr) eng->zero_grad();
      nn::ForwardOptions forward;
      forward.normalizer = count;
      const pipeline::StepStats stats = executor.run(micro_batch, forward);
      if (zero_engine != nullptr) zero_engine->step(1e-4f);
      std::vector<double> mine(kFigures + computes), all((kFigures + computes) * static_cast<size_t>(p));
      mine[kBusy] = stats.busy_seconds;
      mine[kWindow] = stats.step_seconds;
      mine[kForward] = stats.forward_seconds;
      mine[kBackward] = stats.backward_seconds;
      mine[kWeight] = stats.weight_seconds;
      mine[kActivation] = static_cast<double>(stats.activation_nbytes);
      double slots = 0;
      for (int n : stats.slots) slots = std::max(slots, static_cast<double>(n));
      mine[kSlots] = slots;
      size_t at = kFigures;
      for (size_t i = 0; i < stats.action_seconds.size(); ++i) {
        if (schedule.ranks[static_cast<size_t>(stage)][i].compute()) mine[at++] = stats.action_seconds[i];
      }
      const size_t width = kFigures + computes;
      // Host figures through accelerator memory (the communicator's contract).
      void* device = accelerator->allocate((width + width * static_cast<size_t>(p)) * sizeof(double));
      double* send = static_cast<double*>(device);
      double* recv = send + width;
      accelerator->copy_async(send, mine.data(), width * sizeof(double), CopyKind::kHostToDevice, *stream);
      pipe->allgather(send, recv, width, DType::kF64, *stream);
      accelerator->copy_async(all.data(), recv, all.size() * sizeof(double), CopyKind::kDeviceToHost, *stream);
      stream->synchronize();
      accelerator->deallocate(device);
      if (round == 0 && s < run.warmup) continue;
      std::vector<double> figures, times;
      for (int q = 0; q < p; ++q) {
        const double* row = all.data() + static_cast<size_t>(q) * width;
        figures.insert(figures.end(), row, row + kFigures);
        times.insert(times.end(), row + kFigures, row + width);
      }
      steps.push_back(figures);
      action_steps.push_back(times);
      double window = 0;
      for (int q = 0; q < p; ++q) window = std::max(window, figures[static_cast<size_t>(q) * kFigures + kWindow]);
      windows.push_back(window);
    }
    const double med = median_of(windows);
    round_step.push_back(med);
    if (leader) {
      fmt::print("round {}: median step {:.4f} s, {:.1f} tokens/s\n", round, med,
                 static_cast<double>(run.batch * run.seq) * m * dp / med);
    }
    rounds.push_back({{"round", round}, {"step_s", windows}});
  }
  if (!leader) return 0;
  (void)stage;
  // Per stage: idle = 1 - busy / the step's window (the slowest stage's: the
  // pipeline's step), medians over the timed steps; the action costs, mean
  // over the stages, give the formula and the simulation with measured costs.
  const double actions = static_cast<double>(m) * spec.virtual_stages;
  std::vector<double> cost(3, 0.0);
  nlohmann::json per_stage = nlohmann::json::array();
  std::vector<double> idle_median(static_cast<size_t>(p));
  // Each timed step replayed: the schedule run with its actions' measured
  // times (no transfer cost): the idle the schedule itself implies for them.
  std::vector<std::vector<double>> replayed(static_cast<size_t>(p));
  for (const std::vector<double>& times : action_steps) {
    std::vector<std::vector<size_t>> ordinal(static_cast<size_t>(p));
    for (int q = 0; q < p; ++q) {
      size_t n = 0;
      for (const pipeline::Action& a : schedule.ranks[static_cast<size_t>(q)]) ordinal[static_cast<size_t>(q)].push_back(a.compute() ? n++ : 0);
    }
    const pipeline::Simulation replay = pipeline::simulate(schedule, [&](int rank, size_t index) {
      return times[static_cast<size_t>(rank) * computes + ordinal[static_cast<size_t>(rank)][index]];
    });
    const std::vector<double> idle = replay.idle_fraction();
    for (int q = 0; q < p; ++q) replayed[static_cast<size_t>(q)].push_back(idle[static_cast<size_t>(q)]);
  }
  for (int q = 0; q < p; ++q) {
    std::vector<double> idle, f, b, w;
    for (const std::vector<double>& all : steps) {
      double window = 0;
      for (int r = 0; r < p; ++r) window = std::max(window, all[static_cast<size_t>(r) * kFigures + kWindow]);
      const double* mine = all.data() + static_cast<size_t>(q) * kFigures;
      idle.push_back(1.0 - mine[kBusy] / window);
      f.push_back(mine[kForward] / actions);
      b.push_back(mine[kBackward] / actions);
      w.push_back(mine[kWeight] / actions);
    }
    idle_median[static_cast<size_t>(q)] = median_of(idle);
    cost[0] += median_of(f) / p;
    cost[1] += median_of(b) / p;
    cost[2] += median_of(w) / p;
    const double* last = steps.back().data() + static_cast<size_t>(q) * kFigures;
    per_stage.push_back({{"stage", q},
                         {"idle_fraction", idle_median[static_cast<size_t>(q)]},
                         {"idle_fraction_replayed", median_of(replayed[static_cast<size_t>(q)])},
                         {"forward_s", median_of(f)},
                         {"backward_s", median_of(b)},
                         {"weight_s", median_of(w)},
                         {"activation_bytes", last[kActivation]},
                         {"micro_batches_in_flight", last[kSlots]},
                         {"promised_in_flight", pipeline::promised_in_flight(spec, q)}});
  }
  // Without a split backward the measured B is the whole backward.
  const pipeline::Costs measured = spec.split_backward() ? pipeline::Costs{cost[0], cost[1], cost[2], 0}
                                                         : pipeline::Costs{cost[0], cost[1], 0, 0};
  const double formula = pipeline::bubble_formula(spec, measured);
  const pipeline::Simulation sim = pipeline::simulate(pipeline::make_schedule(spec), measured);
  const std::vector<double> simulated = sim.idle_fraction();
  fmt::print("per action (mean over stages): F {:.2f} ms, B {:.2f} ms{}\n", cost[0] * 1e3, cost[1] * 1e3,
             spec.split_backward() ? fmt::format(", W {:.2f} ms", cost[2] * 1e3) : std::string());
  fmt::print("{:>5} {:>8} {:>9} {:>10} {:>9} {:>13} {:>12} {:>13}\n", "stage", "idle", "replayed", "simulated",
             "formula", "idle/formula", "in flight", "activations");
  for (int q = 0; q < p; ++q) {
    const nlohmann::json& s = per_stage[static_cast<size_t>(q)];
    fmt::print("{:>5} {:>8.3f} {:>9.3f} {:>10.3f} {:>9.3f} {:>13.2f} {:>6} of {:<3} {:>9.2f} MiB\n", q,
               idle_median[static_cast<size_t>(q)], s["idle_fraction_replayed"].get<double>(),
               simulated[static_cast<size_t>(q)], formula, idle_median[static_cast<size_t>(q)] / formula,
               s["micro_batches_in_flight"].get<double>(), pipeline::promised_in_flight(spec, q),
               s["activation_bytes"].get<double>() / (1 << 20));
  }
  const double worst = *std::max_element(idle_median.begin(), idle_median.end());
  double worst_replayed = 0;
  for (const nlohmann::json& s : per_stage) worst_replayed = std::max(worst_replayed, s["idle_fraction_replayed"].get<double>());
  fmt::print("pipeline idle (the most idle stage) {:.3f}: formula {:.3f} ({:+.1f}%), the schedule with the mean costs "
             "{:.3f}, with each step's own action times {:.3f}; median step {:.4f} s\n",
             worst, formula, 100.0 * (worst / formula - 1.0), sim.max_idle_fraction(), worst_replayed,
             median_of(round_step));
  const nlohmann::json out = {
      {"schedule", pipeline::schedule_name(spec.kind)},
      {"stages", p},
      {"micro_batches", m},
      {"virtual_stages", spec.virtual_stages},
      {"data_parallel", dp},
      {"config", {{"hidden", run.config.hidden_size}, {"layers", run.config.num_hidden_layers},
                  {"vocab", run.config.vocab_size}, {"batch", run.batch}, {"seq", run.seq}}},
      {"zero_stage", zero.stage},
      {"costs_s", {{"forward", cost[0]}, {"backward", cost[1]}, {"weight", cost[2]}}},
      {"bubble_formula", formula},
      {"bubble_simulated", sim.max_idle_fraction()},
      {"idle_fraction", worst},
      {"idle_fraction_replayed", worst_replayed},
      {"per_stage", per_stage},
      {"rounds", rounds},
      {"step_s", median_of(round_step)}};
  write_json_output(run.json, out, 1);
  return 0;
}

}  // namespace strata::bench::train
