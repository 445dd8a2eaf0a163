// strata-train: forward + backward tokens/s of a Llama config trained on a
// resident engine (everything on the accelerator), median of N steps per round.
// --vs-torch also times transformers' LlamaForCausalLM on the same config,
// threads and dtype, alternating round by round, and prints the ratio.
// --zero 1|2|3 trains the same model through a ZeroEngine instead
// (zero_bench.h). Formulas: bench/strata-train/PERFORMANCE.md.
#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "bench/common/json_output.h"
#include "bench/common/stats.h"
#include "bench/common/subprocess.h"
#include "bench/strata-train/pipeline_bench.h"
#include "bench/strata-train/zero_bench.h"
#include "kernels/cuda_peak.h"
#include "kernels/op_totals.h"
#include "kernels/ops.h"
#include "partition/rendezvous.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "core/stream_span.h"
#include "core/trace_recorder.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/nn/decoder_model.h"

namespace sb = strata::bench;
using strata::ErrorCategory;
using Clock = std::chrono::steady_clock;

namespace {

struct Flags {
  int64_t hidden = 256, intermediate = 0, layers = 4, heads = 8, kv_heads = 0, vocab = 8192;
  int64_t batch = 2, seq = 128;
  std::string dtype = "fp32", accelerator = "cpu", json, python;
  int threads = 0, steps = 5, warmup = 1, rounds = 3;
  bool vs_torch = false;
  bool checkpoint_activations = false, cpu_checkpointing = false;
  // A mixture of experts (a mixtral): every layer's MLP is `experts` SwiGLU
  // experts of width expert_intermediate (0: --intermediate's), top_k per token.
  int64_t experts = 0, top_k = 2, expert_intermediate = 0;
  bool all_experts = false;  // every expert's windows run every step (no routed fetch)
};

std::string find_script() {
  namespace fs = std::filesystem;
  const fs::path source = STRATA_TRAIN_SCRIPT_SOURCE;
  if (fs::exists(source)) return source.string();
  // Installed: <prefix>/bin/strata-train and <prefix>/share/strata/strata-train/.
  const fs::path exe = fs::read_symlink("/proc/self/exe");
  const fs::path installed = exe.parent_path().parent_path() / "share/strata/strata-train/torch_train.py";
  return fs::exists(installed) ? installed.string() : std::string();
}

// Model FLOPs of one forward + backward token (bench/strata-train/PERFORMANCE.md):
// 6 per weight of every matrix the token multiplies (q, k, v, o, gate, up,
// down, lm_head; not the embedding lookup) plus causal attention, 6 * seq * q_width per layer.
double flops_per_token(const strata::nn::DecoderConfig& c, int64_t seq) {
  const double q = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double kv = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double h = static_cast<double>(c.hidden_size);
  // A mixture of experts: the router and the k experts a token goes through.
  const double i = c.moe() ? static_cast<double>(c.num_experts_per_tok * c.moe_intermediate_size)
                           : static_cast<double>(c.intermediate_size);
  const double router = c.moe() ? h * static_cast<double>(c.num_experts) : 0.0;
  const double per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + router;
  const double matmul = static_cast<double>(c.num_hidden_layers) * per_layer +
                        static_cast<double>(c.vocab_size) * h;
  const double attention = static_cast<double>(c.num_hidden_layers) * 6.0 *
                           static_cast<double>(seq) * q;
  return 6.0 * matmul + attention;
}

struct StrataRun {
  std::vector<double> step_s;
  double first_loss = 0;
};

class StrataModel {
 public:
  StrataModel(const Flags& f, const strata::nn::DecoderConfig& c)
      : accelerator_(strata::make_accelerator(f.accelerator)),
        engine_(*accelerator_),
        model_(engine_, c, options(f)) {
    engine_.finalize();
    strata::nn::initialize_parameters(engine_, model_.parameters(), 0);
    std::mt19937 gen(1);
    ids_.resize(static_cast<size_t>(f.batch * f.seq));
    targets_.resize(ids_.size());
    for (auto& t : ids_) t = static_cast<int32_t>(gen() % static_cast<uint32_t>(c.vocab_size));
    for (auto& t : targets_) t = static_cast<int32_t>(gen() % static_cast<uint32_t>(c.vocab_size));
    batch_ = f.batch;
    seq_ = f.seq;
  }
  // One training step's compute: zero_grad, forward, backward, and the loss
  // read back (which waits for all of it).
  double step() {
    // --trace: the phases on the compute stream's track, enclosing their ops
    // (each op a span there too, with its FLOPs or bytes), and the step on the loop's.
    strata::trace::Span span("phase", "step");
    engine_.zero_grad();
    {
      strata::StreamSpan forward(engine_.compute_stream(), "phase", "forward");
      model_.forward(ids_, targets_, batch_, seq_);
    }
    strata::StreamSpan backward(engine_.compute_stream(), "phase", "backward");
    model_.backward();
    backward.end();
    return model_.loss();
  }
  std::string device() const { return accelerator_->name(); }
  strata::Accelerator& accelerator() const { return *accelerator_; }
  size_t param_nbytes() const { return engine_.param_nbytes(); }
  size_t arena_nbytes() const { return model_.arena_nbytes(); }
  size_t host_checkpoint_nbytes() const { return model_.host_checkpoint_nbytes(); }

 private:
  static strata::nn::DecoderModelOptions options(const Flags& f) {
    strata::nn::DecoderModelOptions o;
    o.dtype = strata::parse_dtype(f.dtype);
    o.checkpoint_activations = f.checkpoint_activations || f.cpu_checkpointing;
    o.cpu_checkpointing = f.cpu_checkpointing;
    o.skip_unrouted_experts = !f.all_experts;
    return o;
  }
  std::unique_ptr<strata::Accelerator> accelerator_;
  strata::engine::ResidentEngine engine_;
  strata::nn::DecoderModel model_;
  std::vector<int32_t> ids_, targets_;
  int64_t batch_ = 0, seq_ = 0;
};

StrataRun time_strata(StrataModel& m, int steps, int warmup) {
  StrataRun r;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = Clock::now();
    const double loss = m.step();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s == 0) r.first_loss = loss;
    if (s >= warmup) r.step_s.push_back(dt);
  }
  return r;
}

// Runs the torch anchor once; returns its JSON (ok=false with the reason when
// it could not run).
nlohmann::json time_torch(const Flags& f, const strata::nn::DecoderConfig& c, int threads,
                          const std::string& script) {
  if (script.empty()) return {{"ok", false}, {"error", "torch_train.py not found"}};
  const std::string cmd = fmt::format(
      "OMP_NUM_THREADS={} {} {} --hidden {} --intermediate {} --layers {} --heads {} "
      "--kv-heads {} --vocab {} --batch {} --seq {} --threads {} --steps {} --warmup {} "
      "--dtype {} --device {}{} 2>/dev/null",
      threads, sb::shell_quote(f.python), sb::shell_quote(script), c.hidden_size,
      c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
      c.vocab_size, f.batch, f.seq, threads, f.steps, f.warmup, f.dtype,
      f.accelerator == "cpu" ? "cpu" : "cuda",
      f.checkpoint_activations || f.cpu_checkpointing ? " --gradient-checkpointing" : "");
  const sb::CommandResult r = sb::run_capture(cmd);
  const size_t brace = r.output.rfind("\n{");
  const std::string text = brace == std::string::npos ? r.output : r.output.substr(brace + 1);
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (r.status != 0 || j.is_discarded()) {
    return {{"ok", false},
            {"error", fmt::format("{} exited with status {}: {}", f.python, r.status,
                                  r.output.substr(0, 300))}};
  }
  return j;
}

strata::nn::DecoderConfig model_config(const Flags& f) {
  strata::nn::DecoderConfig c;
  c.vocab_size = f.vocab;
  c.hidden_size = f.hidden;
  c.intermediate_size = f.intermediate > 0 ? f.intermediate : (f.hidden * 8 / 3 + 127) / 128 * 128;
  c.num_hidden_layers = f.layers;
  c.num_attention_heads = f.heads;
  c.num_key_value_heads = f.kv_heads > 0 ? f.kv_heads : f.heads;
  STRATA_CHECK(f.heads > 0 && f.hidden % f.heads == 0, kBadArgument,
               "--hidden {} must be a multiple of --heads {}", f.hidden, f.heads);
  c.head_dim = f.hidden / f.heads;
  c.max_position_embeddings = std::max<int64_t>(f.seq, 2048);
  if (f.experts > 0) {
    c.model_type = "mixtral";
    c.num_experts = f.experts;
    c.num_experts_per_tok = f.top_k;
    c.moe_intermediate_size = f.expert_intermediate > 0 ? f.expert_intermediate : c.intermediate_size;
    c.norm_topk_prob = true;
  }
  c.validate();
  return c;
}

// The ZeRO mode's share of the resident benchmark's flags.
strata::bench::train::ModelRun zero_run(const Flags& f) {
  strata::bench::train::ModelRun r;
  r.config = model_config(f);
  r.batch = f.batch;
  r.seq = f.seq;
  r.dtype = f.dtype;
  r.accelerator = f.accelerator;
  r.json = f.json;
  r.threads = f.threads > 0 ? f.threads : omp_get_max_threads();
  r.steps = f.steps;
  r.warmup = f.warmup;
  r.rounds = f.rounds;
  r.checkpoint_activations = f.checkpoint_activations;
  r.skip_unrouted_experts = !f.all_experts;
  r.cpu_checkpointing = f.cpu_checkpointing;
  return r;
}

int run(const Flags& f) {
  using strata::nn::DecoderConfig;
  const DecoderConfig c = model_config(f);
  STRATA_CHECK(f.batch > 0 && f.seq > 0 && f.steps > 0 && f.rounds > 0 && f.warmup >= 0,
               kBadArgument, "--batch, --seq, --steps and --rounds must be positive");
  const int threads = f.threads > 0 ? f.threads : omp_get_max_threads();
  const char* coretype_env = std::getenv("OPENBLAS_CORETYPE");
  const std::string coretype_given = coretype_env != nullptr ? coretype_env : "";

  StrataModel model(f, c);
  const std::string blas_core = f.accelerator == "cpu" ? strata::ops::cpu_blas_core() : "-";
  const double tokens = static_cast<double>(f.batch * f.seq);
  const double flops = flops_per_token(c, f.seq) * tokens;
  const std::string script = f.vs_torch ? find_script() : std::string();
  fmt::print("strata-train: {} | hidden {} inter {} layers {} heads {}/{} vocab {} | batch {} seq {} "
             "| {} | {} threads | OPENBLAS_CORETYPE={} | OpenBLAS core {}\n",
             model.device(), c.hidden_size, c.intermediate_size, c.num_hidden_layers,
             c.num_attention_heads, c.num_key_value_heads, c.vocab_size, f.batch, f.seq, f.dtype,
             threads, coretype_given.empty() ? "(unset)" : coretype_given, blas_core);
  // The first step lays out the activation arena, so its size can be printed;
  // it counts as one of the warmup steps (steps change no parameter).
  model.step();
  const std::string checkpointing =
      f.cpu_checkpointing ? fmt::format(" (checkpointed per layer; {:.1f} MiB of checkpoints in "
                                        "pinned host memory)",
                                        static_cast<double>(model.host_checkpoint_nbytes()) / (1 << 20))
      : f.checkpoint_activations ? std::string(" (checkpointed per layer)")
                                 : std::string();
  fmt::print("parameters {:.1f} M ({:.1f} MiB), activation arena {:.1f} MiB{}, {:.2f} GFLOP/step\n",
             static_cast<double>(c.parameter_count()) / 1e6,
             static_cast<double>(model.param_nbytes()) / (1 << 20),
             static_cast<double>(model.arena_nbytes()) / (1 << 20), checkpointing, flops / 1e9);
  fmt::print("{:>5} {:>14} {:>14} {:>10} {:>12} {:>12}\n", "round", "strata tok/s", "torch tok/s",
             "ratio", "strata loss", "torch loss");

  nlohmann::json rounds = nlohmann::json::array();
  std::vector<double> strata_round, torch_round;
  std::string torch_note;
  for (int r = 0; r < f.rounds; ++r) {
    const StrataRun s = time_strata(model, f.steps, r == 0 ? std::max(f.warmup - 1, 0) : 0);
    const double s_med = sb::median(s.step_s);
    strata_round.push_back(s_med);
    nlohmann::json row = {{"round", r}, {"strata_step_s", s.step_s},
                          {"strata_tokens_per_s", tokens / s_med}};
    std::string torch_cell = "-", ratio_cell = "-", torch_loss = "-";
    if (f.vs_torch) {
      const nlohmann::json t = time_torch(f, c, threads, script);
      if (t.value("ok", false)) {
        const double t_med = sb::median(t.at("step_s").get<std::vector<double>>());
        torch_round.push_back(t_med);
        torch_cell = fmt::format("{:.1f}", tokens / t_med);
        ratio_cell = fmt::format("{:.3f}", t_med / s_med);
        torch_loss = fmt::format("{:.4f}", t.value("loss", 0.0));
        row["torch_step_s"] = t.at("step_s");
        row["torch_tokens_per_s"] = tokens / t_med;
        row["torch"] = t.value("torch", "?");
      } else {
        torch_note = t.value("error", "unknown error");
      }
    }
    fmt::print("{:>5} {:>14.1f} {:>14} {:>10} {:>12.4f} {:>12}\n", r, tokens / s_med, torch_cell,
               ratio_cell, s.first_loss, torch_loss);
    rounds.push_back(row);
  }
  const double s_med = sb::median(strata_round);
  // On a GPU: the bf16 GEMM peak of this device, measured now (PERFORMANCE.md).
  double peak_tflops = 0;
  if (f.accelerator == "cuda") {
    peak_tflops = strata::ops::measure_bf16_gemm_tflops(model.accelerator(), 8192, 8192, 8192, 10);
  }
  nlohmann::json out = {{"config", {{"hidden", c.hidden_size}, {"intermediate", c.intermediate_size},
                                    {"layers", c.num_hidden_layers}, {"heads", c.num_attention_heads},
                                    {"kv_heads", c.num_key_value_heads}, {"vocab", c.vocab_size},
                                    {"batch", f.batch}, {"seq", f.seq}, {"dtype", f.dtype},
                                    {"checkpoint_activations", f.checkpoint_activations || f.cpu_checkpointing},
                                    {"cpu_checkpointing", f.cpu_checkpointing}}},
                        {"arena_nbytes", model.arena_nbytes()},
                        {"host_checkpoint_nbytes", model.host_checkpoint_nbytes()},
                        {"device", model.device()}, {"threads", threads},
                        {"openblas_coretype_env", coretype_given},
                        {"openblas_core", blas_core},
                        {"flops_per_step", flops}, {"rounds", rounds},
                        {"strata_tokens_per_s", tokens / s_med},
                        {"strata_model_tflops", flops / s_med / 1e12}};
  fmt::print("median: strata {:.1f} tok/s ({:.3f} s/step, {:.2f} model TFLOP/s)", tokens / s_med,
             s_med, flops / s_med / 1e12);
  if (peak_tflops > 0) {
    const double mfu = flops / s_med / 1e12 / peak_tflops;
    out["bf16_gemm_peak_tflops"] = peak_tflops;
    out["model_flop_utilisation"] = mfu;
    fmt::print(" | MFU {:.1f}% of the {:.0f} TFLOP/s bf16 GEMM peak", 100 * mfu, peak_tflops);
  }
  if (!torch_round.empty()) {
    const double t_med = sb::median(torch_round);
    out["torch_tokens_per_s"] = tokens / t_med;
    out["ratio_vs_torch"] = t_med / s_med;
    fmt::print(" | torch {:.1f} tok/s | strata/torch {:.3f}x", tokens / t_med, t_med / s_med);
  }
  fmt::print("\n");
  if (f.vs_torch && torch_round.empty()) {
    fmt::print("--vs-torch: torch not timed: {} (python: {}; set --python or STRATA_PYTHON)\n",
               torch_note, f.python);
    out["torch_error"] = torch_note;
  }
  strata::bench::write_json_output(f.json, out, 1);
  return 0;
}

}  // namespace

// --trace FILE: the run's timeline (core/trace_recorder.h), one file
// per rank under `strata run` ({rank} in FILE, else .rank<N>).
void start_trace(const std::string& path, std::optional<strata::trace::Session>& session) {
  if (path.empty()) return;
  const strata::partition::RankInfo rank = strata::partition::RankInfo::from_env();
  strata::trace::Options options;
  options.path = path;
  options.rank = rank.rank;
  options.world_size = rank.world_size;
  options.process_name = fmt::format("strata-train rank {}", options.rank);
  session.emplace(options);
  strata::trace::name_this_thread("train loop");
}

void finish_trace(std::optional<strata::trace::Session>& session) {
  if (!session) return;
  const strata::trace::Summary s = session->finish();
  fmt::print("trace: {} ({} events, {} dropped)\n", s.path, s.events, s.dropped);
  const std::string table = strata::ops::op_totals_table(strata::ops::op_totals());
  if (!table.empty()) fmt::print("time by op (this process, every traced step; cpu ops timed on their stream):\n{}", table);
}

int main(int argc, char** argv) {
  Flags f;
  const char* py = std::getenv("STRATA_PYTHON");
  f.python = py != nullptr && *py != '\0' ? py : "python3";
  CLI::App app{
      "strata-train: forward + backward tokens/s of a Llama config on a resident engine\n"
      "(median of --steps steps per round; --vs-torch alternates rounds with transformers'\n"
      "LlamaForCausalLM on the same config, threads and dtype, and prints the ratio).\n"
      "--zero 1|2|3 trains the model through a ZeroEngine (ranks: `strata run -n N -- strata-train ...`\n"
      "or --ranks N threads; --batch is then per rank) and reports the step's breakdown and its ratio\n"
      "to its bound, max(the step resident, parameter bytes read / the drive's read bandwidth).\n"
      "--cp N (with --zero) splits every sequence over cp groups of N ranks (ring attention or --cp-method\n"
      "ulysses), ZeRO over dp x cp.\n"
      "--pp N splits it into pipeline stages (`strata run -n N -- strata-train --pp N ...`) and prints each\n"
      "stage's idle share of the step against the schedule's formula."};
  app.add_option("--hidden", f.hidden, "hidden size")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--intermediate", f.intermediate, "MLP size (default: 8/3 hidden, rounded up to 128)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--layers", f.layers, "decoder layers")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--heads", f.heads, "attention heads")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", f.kv_heads, "key/value heads (default: --heads)")->check(CLI::Range(0, 1024));
  app.add_option("--vocab", f.vocab, "vocabulary size")->capture_default_str()->check(CLI::Range(2, 1 << 24));
  app.add_option("--batch", f.batch, "sequences per step")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--seq", f.seq, "tokens per sequence")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--dtype", f.dtype, "parameter storage: fp32, bf16 or fp16")->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--accelerator", f.accelerator, "cpu or cuda")->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--threads", f.threads, "CPU threads for strata and torch (default: all cores)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--steps", f.steps, "timed steps per round")->capture_default_str()->check(CLI::Range(1, 100000));
  app.add_option("--warmup", f.warmup, "untimed steps before the first round (at least one: it lays out the arena)")->capture_default_str()
      ->check(CLI::Range(0, 1000));
  app.add_option("--rounds", f.rounds, "alternating rounds (strata, then torch)")->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_flag("--checkpoint-activations", f.checkpoint_activations,
               "per-layer activation checkpointing (recompute in backward; torch too with --vs-torch)");
  app.add_flag("--cpu-checkpointing", f.cpu_checkpointing,
               "keep the checkpoints in pinned host memory (implies --checkpoint-activations)");
  app.add_flag("--vs-torch", f.vs_torch, "also time transformers' LlamaForCausalLM (needs Python torch)");
  app.add_option("--experts", f.experts, "a mixture of experts (a mixtral): experts per layer (0: a dense MLP)")
      ->capture_default_str()->check(CLI::Range(0, 4096));
  app.add_option("--top-k", f.top_k, "--experts: experts per token")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--expert-intermediate", f.expert_intermediate,
                 "--experts: each expert's MLP size (default: --intermediate's)")->check(CLI::Range(0, 1 << 20));
  app.add_flag("--all-experts", f.all_experts,
               "--experts: run every expert's windows every step, also those no rank routed a token to (so ZeRO-3 "
               "fetches every expert: what routed fetch saves)");
  app.add_option("--python", f.python, "Python interpreter for --vs-torch (env STRATA_PYTHON)")
      ->capture_default_str();
  app.add_option("--json", f.json, "write the results as JSON to this file");
  std::string trace_path;
  app.add_option("--trace", trace_path,
                 "write the run's timeline as Chrome/Perfetto trace JSON to this file ({rank} in it is replaced "
                 "by the rank; under `strata run -n N` without it, .rank<N> is added)");
  strata::bench::train::ZeroFlags zero;
  strata::bench::train::add_zero_flags(app, zero);
  strata::bench::train::PipelineFlags pipeline;
  strata::bench::train::add_pipeline_flags(app, pipeline);
  CLI11_PARSE(app, argc, argv);
  if (f.threads > 0) strata::ops::set_cpu_threads(f.threads);
  try {
    STRATA_CHECK(f.experts > 0 || (f.expert_intermediate == 0 && !f.all_experts && app.count("--top-k") == 0),
                 kBadArgument, "--top-k, --expert-intermediate and --all-experts describe experts: give --experts too");
    STRATA_CHECK(f.experts == 0 || f.top_k <= f.experts, kBadArgument, "--top-k {} is more than --experts {}",
                 f.top_k, f.experts);
    STRATA_CHECK(f.experts == 0 || !f.vs_torch, kBadArgument,
                 "--vs-torch times transformers' LlamaForCausalLM, a dense model: leave it out with --experts");
    strata::bench::check_json_path(f.json);
    std::optional<strata::trace::Session> tracing;
    start_trace(trace_path, tracing);
    int status = 0;
    STRATA_CHECK(zero.context_parallel == 1 || (zero.stage > 0 && pipeline.stages == 0), kBadArgument,
                 "--cp {} runs through a ZeroEngine: give --zero 1, 2 or 3 (and no --pp: context parallelism with "
                 "pipeline stages is not implemented yet)",
                 zero.context_parallel);
    if (pipeline.stages > 0) {
      STRATA_CHECK(!f.vs_torch, kBadArgument, "--vs-torch times the resident benchmark; leave it out with --pp");
      status = strata::bench::train::run_pipeline(zero_run(f), pipeline, zero);
    } else if (zero.stage > 0) {
      STRATA_CHECK(!f.vs_torch, kBadArgument, "--vs-torch times the resident benchmark; leave it out with --zero");
      if (pipeline.micro_batches > 0) zero.micro_batches = pipeline.micro_batches;
      status = strata::bench::train::run_zero(zero_run(f), zero);
    } else {
      status = run(f);
    }
    finish_trace(tracing);
    return status;
  } catch (const strata::Error& e) {
    std::cerr << "strata-train: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    // Not a strata::Error: still a message and an exit code, never an abort.
    std::cerr << "strata-train: " << e.what() << "\n";
    return 1;
  }
}
