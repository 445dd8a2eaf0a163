// What a training run shows and leaves behind (issue 13 §3): a progress line
// per step (a bar redrawn in place on a terminal, one plain line per step
// otherwise), metrics.jsonl (one JSON object per step, flushed as written so a
// crash keeps every finished step), and at the end a summary table and a
// loss-curve picture (SVG) beside the metrics.
//
// It also writes run.json beside the metrics: how the run was started (the
// command line, the working directory, the world size from the launcher's
// environment), so `strata plan --check DIR` can rebuild the configuration
// the run measured.
//
// Ownership: owns the metrics file. Thread-safety: one thread (rank 0's
// training thread). Errors: Error(kIo) naming the file when it cannot be
// created or written.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/engine/zero_sizes.h"

namespace strata::train {

// One optimizer step as reported.
struct StepRecord {
  int64_t step = 0;            // 1-based
  double loss = 0;             // mean loss over the global batch
  double lr = 0;
  double grad_norm = 0;        // global, before clipping
  bool applied = true;         // false: skipped (a gradient was not finite)
  double loss_scale = 1;       // fp16 loss scale the step's gradients carried
  uint64_t nvme_bytes = 0;     // bytes rank 0 moved to and from NVMe during the step
  int64_t tokens = 0;          // predicted tokens in the global batch
  double seconds = 0;          // wall time of the step
  double forward_backward_seconds = 0;  // this rank's forward + backward, less what they waited for the optimizer
  // step() (reduction tail, norm, update, gather), plus what forward and
  // backward waited for the last step's update overlapping this forward
  // (StepResult::previous_update_wait_seconds).
  double optimizer_seconds = 0;
  // The optimizer overlapping backward (ZeroEngine::prepare_step) and the
  // next forward: its thread's time there whose work the step kept, less
  // what was waited for, and of the optimizer's own time the share the step
  // waited for (1: none hidden).
  double optimizer_hidden_seconds = 0;
  double optimizer_not_hidden_fraction = 1;
  // What the optimizer thread did during the last backward: "speculate" or
  // "read-ahead" (offload::OverlapMode), empty when nothing overlapped (no
  // thread: stage 1, optimizer on the device, overlap off); and whether the
  // speculated updates were rolled back (clipping fired, an overflow).
  std::string optimizer_overlap;
  bool optimizer_rolled_back = false;
  // This step's update runs on after step(), overlapping the next step's
  // forward (ZeRO-3 with the optimizer on cpu or nvme; StepResult::update_overlaps_forward).
  bool optimizer_overlaps_forward = false;
  uint64_t device_peak_nbytes = 0;       // this rank's accelerator memory, highest in use so far
  uint64_t host_peak_rss_nbytes = 0;     // this rank's process, highest resident set so far (VmHWM)
  std::optional<double> eval_loss;       // the evaluation after this step, when one ran
  // Mixture of experts with output_router_logits: the load-balancing loss, the
  // mean over the step's micro-batches and ranks (`loss` is the language-model
  // part; the gradients include router_aux_loss_coef times this).
  std::optional<double> aux_loss;
  // Mixture of experts: the routers' load imbalance over the step's
  // micro-batches and ranks (DecoderModel::router_load_imbalance: the busiest
  // expert's tokens over the mean, the worst layer's; 1 is balanced).
  std::optional<double> router_imbalance;
  // Pipeline parallelism: the share of the step rank 0's stage computed
  // nothing (pipeline::StepStats::idle_fraction: the bubble, and waits for
  // transfers), and its activation memory (every micro-batch slot).
  std::optional<double> pipeline_idle_fraction;
  std::optional<uint64_t> activation_nbytes;
  double tokens_per_second() const { return seconds > 0 ? static_cast<double>(tokens) / seconds : 0; }
};

// The highest resident set size of this process so far (VmHWM of
// /proc/self/status), 0 where it cannot be read.
uint64_t peak_rss_nbytes();

// What run.json records (written by RunReport's constructor).
struct RunRecord {
  std::vector<std::string> argv;  // this process's command line (/proc/self/cmdline)
  std::filesystem::path cwd;      // its working directory (relative paths in argv)
  int64_t world_size = 1;         // WORLD_SIZE from the launcher's environment, else 1
  // This process's resident set (VmRSS) when the report opened: after setup
  // (accelerator, communicators, engine buffers, weights), before the first
  // step. The process's own baseline for `strata plan --check`. Absent in
  // records of older runs.
  std::optional<uint64_t> resident_at_start_nbytes;
  // What the run was configured with, as it read it (so `strata plan
  // --check` needs neither file to be unchanged, nor to exist): the ds_config
  // with every default filled in (Config::effective; finetune's built-in
  // defaults when it had no --config) and the model's config
  // (DecoderConfig::to_json). Null in records of older runs.
  nlohmann::json ds_config;
  nlohmann::json model_config;
  // sub_group_size and reduce_bucket_size as the engine used them, whether
  // each was chosen from the model, and why (engine::ZeroSizes::to_json);
  // ds_config holds the same two numbers. Null in records of older runs.
  nlohmann::json zero_sizes;
};
// The record of a run's configuration: `effective` (Config::effective) with
// the sizes the engine used written in, so that `strata plan --check` reads
// back what ran (a size left out is chosen from the model at finalize), and
// the choice itself.
RunRecord configured_run_record(const nlohmann::json& effective, const nlohmann::json& model_config,
                                const engine::ZeroSizes& sizes);
// This process's resident set now (VmRSS), 0 where it cannot be read.
uint64_t resident_nbytes();
// The record of this process, now.
RunRecord this_run_record();
// run.json's text for `record`; and its parse, throwing Error(kBadArgument)
// naming `source` and the key when a key is missing or of the wrong type.
std::string run_record_json(const RunRecord& record);
RunRecord parse_run_record(const std::string& text, const std::string& source);

class RunReport {
 public:
  // Creates `dir`, dir/run.json (this_run_record() with `inputs`' ds_config
  // and model_config) and dir/metrics.jsonl (truncated). `total_steps` sizes the
  // bar and the ETA; `out` is where progress goes (stderr in the tool).
  // `resumed_after`: the run continues from that step (a checkpoint):
  // metrics.jsonl keeps its lines up to it (later ones were lost with the
  // run that wrote them) and appends; the summary and curve cover them.
  RunReport(std::filesystem::path dir, int64_t total_steps, std::FILE* out,
            std::optional<int64_t> resumed_after = std::nullopt, const RunRecord& inputs = {});
  ~RunReport();
  RunReport(const RunReport&) = delete;
  RunReport& operator=(const RunReport&) = delete;

  // A progress line every `every` steps (ds_config steps_per_print; also the
  // first step of the run, the last, and every skipped step). 1: each step.
  // A terminal's progress bar, redrawn in place, follows every step.
  void set_print_every(int64_t every) { print_every_ = every < 1 ? 1 : every; }
  void record(const StepRecord& r);
  // Ends the progress line, writes loss.svg and prints the summary table.
  void finish();

  const std::filesystem::path& metrics_path() const { return metrics_path_; }
  const std::filesystem::path& curve_path() const { return curve_path_; }
  const std::vector<StepRecord>& steps() const { return steps_; }

 private:
  void print_progress(const StepRecord& r);

  std::filesystem::path dir_, metrics_path_, curve_path_;
  int64_t total_steps_;
  std::FILE* out_;
  std::FILE* metrics_ = nullptr;
  bool terminal_ = false;
  int64_t print_every_ = 1;
  double elapsed_ = 0;
  std::vector<StepRecord> steps_;
};

// The SVG of a loss curve (step on x, loss on y, skipped steps marked, the
// evaluation losses as a second line with dots); pure,
// for tests. Empty input gives a valid, empty plot.
std::string loss_curve_svg(const std::vector<StepRecord>& steps);

}  // namespace strata::train
