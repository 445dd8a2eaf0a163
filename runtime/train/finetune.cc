// The finetune job, top to bottom: configuration → ranks and communicators →
// engine and model → weights → data → steps → report.
#include "runtime/train/finetune.h"

#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "partition/communicator.h"
#include "partition/rendezvous.h"
#include "runtime/launcher/launcher.h"
#include "runtime/config/config.h"
#include "kernels/op_totals.h"
#include "core/accelerator.h"
#include "core/directory_lock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/stream_span.h"
#include "core/trace_recorder.h"
#include "runtime/data/token_file.h"
#include "runtime/engine/lr_schedule.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/llama_model.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/freeze.h"
#include "runtime/train/hf_export.h"
#include "runtime/train/hf_model.h"
#include "runtime/train/run_report.h"
#include "runtime/train/zero_config.h"

namespace strata::train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Without --config: ZeRO stage 3, everything in memory, AdamW at 1e-4.
constexpr const char* kBuiltinConfig = R"({
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
  "zero_optimization": {"stage": 3}
})";

// Each rank's lock on the swap directory (when a tier is on NVMe) and on the
// checkpoint directory; the engine's swap spaces and the checkpoints share them.
std::vector<std::shared_ptr<DirectoryLock>> own_run_directories(const engine::ZeroEngineOptions& zero,
                                                                const FinetuneOptions& options, int rank) {
  std::vector<std::shared_ptr<DirectoryLock>> owned;
  const bool nvme = zero.param_tier == Tier::kNvme || zero.optimizer_tier == Tier::kNvme ||
                    zero.grad_tier == Tier::kNvme;
  if (nvme) {
    ensure_run_directory(zero.nvme_path, "nvme_path");
    owned.push_back(DirectoryLock::acquire(zero.nvme_path, rank_lock_file_name(rank), "nvme_path"));
  }
  if (!options.save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.save_dir, ec);
    if (ec) {
      raise(ErrorCategory::kIo, "--save {}: cannot create the checkpoint directory: {}", options.save_dir.string(),
            ec.message());
    }
    owned.push_back(DirectoryLock::acquire(options.save_dir, rank_lock_file_name(rank), "--save"));
  }
  return owned;
}

// Every token id of this rank's part of the file below the model's vocabulary,
// checked before step 1 (a bad id found at step 20 would waste the run, and the
// rank that reads it is named as the one that failed). Each rank checks 1/world
// of the file; a file whose format cannot hold an id >= vocab is not read.
void check_token_ids(const data::TokenFile& data, int64_t vocab, int rank, int world) {
  const int64_t largest = data.format() == data::TokenFormat::kText ? 255
                          : data.format() == data::TokenFormat::kU32 ? int64_t{0xffffffff}
                                                                      : int64_t{0xffff};
  if (largest < vocab) return;
  const int64_t n = data.size(), begin = n * rank / world, end = n * (rank + 1) / world;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t token = data.token(i);
    if (token >= vocab) {
      raise(ErrorCategory::kBadArgument,
            "--data {}: token {} at position {} is outside the model's vocabulary [0, {}) (vocab_size of the model "
            "config); checked before step 1",
            data.path(), token, i, vocab);
    }
  }
}

// strata.pinned_pool_size: an upper bound of the page-locked host memory a
// rank holds, checked before any is allocated against what this runtime pins
// for this model and ds_config (runtime/plan/runtime_memory.h, item by item).
void check_pinned_budget(const Config& config, const std::string& source, const plan::RuntimeInputs& inputs) {
  const uint64_t budget = config.strata.pinned_pool_nbytes;
  if (budget == 0) return;  // sized from the buffer counts
  const plan::RuntimeMemory memory = plan::runtime_memory(inputs);
  if (memory.pinned_nbytes <= static_cast<double>(budget)) return;
  std::string items;
  for (const plan::MemoryItem& item : memory.items) {
    if (item.where != plan::Where::kPinned || item.nbytes <= 0) continue;
    items += fmt::format("{}{} {:.0f} bytes{}", items.empty() ? "" : ", ", item.name, item.nbytes,
                         item.upper_bound ? " at most" : "");
  }
  raise(ErrorCategory::kBadArgument,
        "{}: strata.pinned_pool_size is {} bytes, but this run pins {:.0f} bytes per rank ({}). Raise "
        "strata.pinned_pool_size, or lower what sizes those buffers (offload_optimizer.buffer_count, "
        "offload_param.buffer_count and buffer_size, sub_group_size, train_micro_batch_size_per_gpu x --seq)",
        source, budget, memory.pinned_nbytes, items);
}

double count_targets(const std::vector<int32_t>& targets) {
  double n = 0;
  for (int32_t t : targets) n += t != ops::kIgnoreIndex;
  return n;
}

}  // namespace

FinetuneResult run_finetune(const FinetuneOptions& options) {
  // ---- inputs, all checked before any rank connects or allocates -------------------
  const std::string source = options.config.empty() ? "built-in defaults" : options.config.string();
  const Config config = options.config.empty() ? parse_config_text(kBuiltinConfig, source)
                                               : load_config_file(options.config.string());
  const engine::ZeroEngineOptions zero = zero_engine_options(config, source);
  const engine::LrSchedule schedule = engine::LrSchedule::from_json(config.scheduler, config.optimizer.lr);
  STRATA_CHECK(options.model.empty() != options.init.empty(), kBadArgument,
               "give exactly one of --model DIR (Hugging Face weights) and --init CONFIG.json (random weights)");
  const nn::LlamaConfig model_config =
      options.model.empty() ? nn::load_llama_config(options.init.string()) : load_hf_config(options.model);
  STRATA_CHECK(options.steps >= 1, kBadArgument, "--steps must be >= 1, got {}", options.steps);
  STRATA_CHECK(!options.resume || !options.save_dir.empty(), kBadArgument,
               "--resume needs --save DIR (the directory the checkpoints are in)");
  STRATA_CHECK(options.save_every >= 1, kBadArgument, "--save-every must be >= 1, got {}", options.save_every);
  STRATA_CHECK(options.seq >= 1 && options.seq <= model_config.max_position_embeddings, kBadArgument,
               "--seq {} must be in [1, {}] (the model's max_position_embeddings)", options.seq,
               model_config.max_position_embeddings);
  const data::TokenFile data = data::TokenFile::open(options.data.string(),
                                                     data::parse_token_format(options.data_format));
  const uint64_t seed = options.seed.value_or(config.strata.seed);
  const DType train_dtype = config.bf16 ? DType::kBF16 : config.fp16.enabled ? DType::kF16 : DType::kF32;
  ExportOptions export_options;
  export_options.dtype = options.export_dtype.empty() ? train_dtype : parse_dtype(options.export_dtype);
  export_options.max_shard_nbytes = options.export_shard_nbytes;
  STRATA_CHECK(is_float_storage(export_options.dtype), kBadArgument, "--export-dtype must be fp32, fp16 or bf16");

  // ---- ranks, accelerator, communicators ------------------------------------------------
  const partition::RankInfo rank = launcher::rank_info_from_env();
  set_log_rank(rank.rank, rank.world_size);
  set_log_level(config.strata.log_level);
  // The directories this run writes are its own from now on: another run
  // holding them is refused before anything is touched (core/directory_lock.h).
  const std::vector<std::shared_ptr<DirectoryLock>> owned = own_run_directories(zero, options, rank.rank);
  // The timeline: recording from here on; each rank's file is created now.
  std::optional<trace::Session> tracing;
  // --trace, else the ds_config's strata.trace_path.
  const std::filesystem::path trace_path =
      !options.trace.empty() ? options.trace : std::filesystem::path(config.strata.trace_path);
  if (!trace_path.empty()) {
    trace::Options trace_options;
    trace_options.path = trace_path.string();
    trace_options.rank = rank.rank;
    trace_options.world_size = rank.world_size;
    trace_options.process_name = fmt::format("strata finetune rank {}", rank.rank);
    tracing.emplace(trace_options);
    trace::name_this_thread("train loop");
  }
  std::optional<trace::Span> setup_span(std::in_place, "phase", "connect");
  const int64_t micro_batch = config.micro_batch_size, accumulation = config.gradient_accumulation_steps;
  STRATA_CHECK(config.train_batch_size == 0 || config.train_batch_size == micro_batch * accumulation * rank.world_size,
               kBadArgument,
               "{}: train_batch_size {} != train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x "
               "world size {}",
               source, config.train_batch_size, micro_batch, accumulation, rank.world_size);
  std::unique_ptr<Accelerator> accelerator = make_accelerator(config.strata.accelerator);
  {
    plan::RuntimeInputs pinned;
    pinned.model = model_config;
    pinned.param_dtype = train_dtype;
    pinned.device_is_host = accelerator->host_addressable();
    pinned.activation_dtype = pinned.device_is_host ? DType::kF32 : train_dtype;
    pinned.micro_batch = micro_batch;
    pinned.seq = options.seq;
    pinned.checkpoint_activations = options.checkpoint_activations || config.cpu_checkpointing;
    pinned.cpu_checkpointing = config.cpu_checkpointing;
    pinned.world_size = rank.world_size;
    pinned.zero = zero;
    check_pinned_budget(config, source, pinned);
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.strata.collective_timeout_s * 1000));
  partition::Rendezvous rendezvous(rank, timeout);
  const ZeroCommunicators comms =
      make_zero_communicators(*accelerator, rendezvous.store(), rank.rank, rank.world_size, timeout, "strata/finetune");

  // ---- engine, model, weights ---------------------------------------------------------
  setup_span.emplace("phase", options.model.empty() ? "init weights" : "load weights");
  engine::ZeroEngine engine(*accelerator, comms.comms(), zero);
  nn::LlamaModelOptions model_options;
  model_options.dtype = train_dtype;
  model_options.checkpoint_activations = options.checkpoint_activations || config.cpu_checkpointing;
  model_options.cpu_checkpointing = config.cpu_checkpointing;
  std::optional<nn::LlamaModel> built;
  try {
    built.emplace(engine, model_config, model_options);
    const Frozen frozen = freeze_parameters(engine, options.freeze);
    if (frozen.tensors > 0 && rank.rank == 0) {
      logger().info("--freeze: {} of {} parameter tensors ({} elements) are not trained", frozen.tensors,
                    frozen.total_tensors, frozen.elements);
    }
    engine.finalize();
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::kOutOfMemory) throw;
    // Say which inputs size the allocation that failed, in the user's terms.
    raise(ErrorCategory::kOutOfMemory,
          "{}. What is allocated here is sized by the model ({} parameters; the embedding alone is vocab_size {} x "
          "hidden_size {}) and by the ds_config's buffers (offload_optimizer.buffer_count {}, offload_param."
          "buffer_count {} x buffer_size {}, sub_group_size {}, reduce_bucket_size {}): check those values",
          e.message(), model_config.parameter_count(), model_config.vocab_size, model_config.hidden_size,
          config.zero.offload_optimizer.buffer_count, config.zero.offload_param.buffer_count,
          config.zero.offload_param.buffer_numel, config.zero.sub_group_numel, config.zero.reduce_bucket_numel);
  }
  nn::LlamaModel& model = *built;
  if (options.model.empty()) {
    nn::initialize_parameters(engine, model.parameters(), seed);
  } else {
    load_hf_weights(engine, model.parameters(), options.model);
  }
  setup_span.reset();
  check_token_ids(data, model_config.vocab_size, rank.rank, rank.world_size);
  data::TokenLoader loader(data, {options.seq, micro_batch, rank.rank, rank.world_size, seed,
                                  model_config.vocab_size});
  logger().info("finetune: {} parameters ({}), ZeRO stage {}, params on {}, optimizer state on {}, {} rank(s) x "
                "{} x {} sequences of {} tokens per step, {}, activation checkpoints {}; data {} ({} tokens, {} "
                "samples per epoch)",
                [&] {
                  int64_t n = 0;
                  for (engine::ParamId id = 0; id < engine.parameter_count(); ++id) n += engine.param_info(id).numel();
                  return n;
                }(),
                dtype_name(model_options.dtype), zero.stage, tier_name(zero.param_tier), tier_name(zero.optimizer_tier),
                rank.world_size, accumulation, micro_batch, options.seq, schedule.describe(),
                !model_options.checkpoint_activations ? "off"
                : model_options.cpu_checkpointing     ? "in pinned CPU memory"
                                                      : "on the device",
                data.path(), data.size(), loader.windows());

  // ---- the steps ------------------------------------------------------------------------
  // ---- resume -----------------------------------------------------------------------------
  // What the checkpoints are of, so `strata export` can rebuild the model from one.
  const nlohmann::json checkpoint_model = {{"config", model_config.to_json()}, {"dtype", dtype_name(train_dtype)}};
  std::optional<Checkpoints> checkpoints;
  if (!options.save_dir.empty()) {
    checkpoints.emplace(options.save_dir, options.keep_checkpoints);
    checkpoints->expect_model(checkpoint_model);
  }
  int64_t done = 0;  // steps already taken (by the run a checkpoint came from)
  if (options.resume) {
    trace::Span span("phase", "resume");
    const std::optional<TrainerState> resumed = checkpoints->find_and_load(engine);
    if (!resumed) {
      raise(ErrorCategory::kBadArgument, "--resume: no complete checkpoint in {} (nothing to resume)",
            options.save_dir.string());
    }
    done = resumed->step;
    if (options.steps < done) {
      raise(ErrorCategory::kBadArgument,
            "--steps {}: the checkpoint in {} is at step {} already, past the last step asked for; give --steps "
            "{} or more to continue (or `strata export {}` to export it)",
            options.steps, options.save_dir.string(), done, done, options.save_dir.string());
    }
    // A run killed after its last checkpoint (during the export, say) is
    // finished by the same command: restart-until-it-succeeds must end.
    if (options.steps == done && rank.rank == 0) {
      logger().info("--resume: the checkpoint is at step {} = --steps, so training is complete; {}", done,
                    options.export_dir.empty() ? "nothing is left to do" : "exporting it");
    }
    loader.set_cursor(resumed->data_cursor);
  }

  // ---- the steps ------------------------------------------------------------------------
  std::unique_ptr<RunReport> report;
  if (rank.rank == 0) {
    RunRecord inputs;
    inputs.ds_config = config.effective;
    inputs.model_config = model_config.to_json();
    report = std::make_unique<RunReport>(options.out, options.steps, options.progress,
                                         options.resume ? std::optional<int64_t>(done) : std::nullopt, inputs);
    report->set_print_every(config.steps_per_print);
  }
  FinetuneResult result;
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(accumulation)), targets(ids.size());
  for (int64_t step = done + 1; step <= options.steps; ++step) {
    trace::Span step_span("phase", "step");
    step_span.value("step", step);
    const auto start = Clock::now();
    const uint64_t nvme_before = engine.nvme_bytes_read() + engine.nvme_bytes_written();
    double local_count = 0;
    for (size_t m = 0; m < ids.size(); ++m) {
      loader.next(ids[m], targets[m]);
      local_count += count_targets(targets[m]);
    }
    // Normalise by every rank's predicted tokens of this step, so N ranks equal one rank on the combined batch.
    const double global_count = engine.global_sum(local_count);
    STRATA_CHECK(global_count > 0, kBadArgument, "step {}: every target of the global batch is ignored", step);
    const double lr = schedule.lr(engine.step_count());
    double loss_sum = 0;
    for (size_t m = 0; m < ids.size(); ++m) {
      // The optimizer may update each sub-group during the last backward, as soon as its gradient is final.
      if (m + 1 == ids.size()) engine.prepare_step(static_cast<float>(lr));
      nn::ForwardOptions forward;
      forward.normalizer = global_count;
      forward.grad_scale = engine.loss_scale();  // fp16: step() divides it out
      // Each phase twice on the timeline: on the loop's track, the host's view
      // (issuing ops, waiting for parameters); on the compute stream's, the
      // ops' (from the first to the last of them having run).
      {
        trace::Span span("phase", "forward");
        span.value("micro_batch", static_cast<int64_t>(m));
        StreamSpan ops(engine.compute_stream(), "compute", "forward");
        model.forward(ids[m], targets[m], micro_batch, options.seq, forward);
      }
      {
        trace::Span span("phase", "backward");
        span.value("micro_batch", static_cast<int64_t>(m));
        StreamSpan ops(engine.compute_stream(), "compute", "backward");
        model.backward();
        ops.end();
        loss_sum += model.loss_stats().sum;  // waits for the backward's loss
      }
    }
    const double forward_backward = seconds_since(start);
    const double loss = engine.global_sum(loss_sum) / global_count;
    trace::Span optimizer_span("phase", "optimizer step");
    const engine::StepResult stepped = engine.step(static_cast<float>(lr));
    optimizer_span.end();
    StepRecord r;
    r.step = step;
    r.loss = loss;
    r.lr = lr;
    r.grad_norm = stepped.grad_norm;
    r.loss_scale = stepped.loss_scale;
    r.applied = stepped.applied;
    r.tokens = static_cast<int64_t>(global_count);
    r.seconds = seconds_since(start);
    r.nvme_bytes = engine.nvme_bytes_read() + engine.nvme_bytes_written() - nvme_before;
    r.forward_backward_seconds = forward_backward;
    r.optimizer_seconds = r.seconds - forward_backward;
    r.optimizer_hidden_seconds = stepped.optimizer_overlapped_seconds;
    r.optimizer_not_hidden_fraction = stepped.optimizer_not_hidden_fraction();
    r.device_peak_nbytes = accelerator->memory_stats().peak_nbytes;
    r.host_peak_rss_nbytes = peak_rss_nbytes();
    if (report) report->record(r);
    if (checkpoints && (step % options.save_every == 0 || step == options.steps)) {
      trace::Span span("phase", "checkpoint");
      checkpoints->save(engine, {step, loader.cursor(), checkpoint_model});
    }
    if (step == done + 1) result.first_loss = loss;
    result.last_loss = loss;
    result.skipped += !stepped.applied;
    result.steps = step;
  }
  if (report) {
    report->finish();
    result.metrics = report->metrics_path();
    result.curve = report->curve_path();
  }
  if (!options.export_dir.empty()) {
    trace::Span span("phase", "export");
    const auto start = Clock::now();
    const ExportResult exported = export_hf_model(engine, *comms.control, model_config, model.parameters(),
                                                  options.export_dir, export_options);
    result.exported = exported.files;
    if (rank.rank == 0 && options.progress != nullptr) {
      fmt::print(options.progress, "  exported         {} ({} in {}, {:.1f} MB) in {:.1f} s\n",
                 options.export_dir.string(), exported.files.size() == 1 ? "one file" : "sharded",
                 dtype_name(export_options.dtype), static_cast<double>(exported.tensor_nbytes) / 1e6,
                 seconds_since(start));
    }
  }
  if (tracing) {
    const trace::Summary traced = tracing->finish();
    if (rank.rank == 0 && options.progress != nullptr) {
      fmt::print(options.progress, "  trace            {}{} ({} events{}; open in ui.perfetto.dev)\n", traced.path,
                 rank.world_size > 1 ? " and the other ranks' files beside it" : "", traced.events,
                 traced.dropped > 0 ? fmt::format(", {} dropped", traced.dropped) : "");
      const std::string table = ops::op_totals_table(ops::op_totals(), "    ");
      if (!table.empty()) fmt::print(options.progress, "  time by op (rank 0, every step; timed on the compute stream)\n{}", table);
    }
  }
  return result;
}

}  // namespace strata::train
