// Shared by the multi-process pipeline tests (pipeline_multiprocess_test.cc)
// and their rank program (pipeline_rank.cc): what one case runs, as flags,
// the model and batches both sides build from it, and the rank program's
// output file.
//
// Output file (text; floats as hexfloat, so they round-trip bit for bit):
//   rank R STAGE DP TP              this job rank, its pp stage, dp rank, tp rank
//   step S LOSS NORM                per step: the global mean loss, the gradient norm (0 resident)
//   stats S BUSY STEP SLOTS BYTES IN COPIED G
//                                   per step: busy and step seconds, slots made, activation bytes,
//                                   zb-h1's W inputs read in place and copied, ZeRO-3's
//                                   parameter allgathers in the step (0 otherwise)
//   held N                          parameters this rank's engine holds
//   tensor NAME NUMEL               every tensor this rank holds (whole, by Hugging Face name)
//   values NAME FIRST N V...        a run of its values: resident, the step's gradient;
//                                   ZeRO, the final parameters this rank owns
//   end                             (a file without it was cut short)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/pipeline/schedule.h"
#include "tests/nn/test_models.h"

namespace strata::test::pp {

inline constexpr int64_t kSeq = 12;

struct Case {
  int pp = 2, tp = 1, ep = 1;
  std::string schedule = "1f1b";
  int micro_batches = 4, virtual_stages = 1;
  bool tied = false;
  int layers = 4;
  int sequences = 8;      // the global batch of each step
  int steps = 1;
  std::string engine = "resident";  // or "zero"
  int zero_stage = 3;
  std::string params = "device", optimizer = "cpu";  // ZeRO tiers: device, cpu, nvme
  bool checkpoint = false;
  std::string family = "llama";
  int64_t reuse_distance = -1;  // ZeRO-3's stage3_max_reuse_distance (-1: the default)

  std::string flags() const {
    return fmt::format(
        " --pp {} --tp {} --ep {} --schedule {} --micro-batches {} --virtual-stages {} --tied {} --layers {} --sequences {} "
        "--steps {} --engine {} --zero-stage {} --params {} --optimizer {} --checkpoint {} --family {} "
        "--reuse-distance {}",
        pp, tp, ep, schedule, micro_batches, virtual_stages, tied ? 1 : 0, layers, sequences, steps, engine, zero_stage,
        params, optimizer, checkpoint ? 1 : 0, family, reuse_distance);
  }
  // Parses flag `name` with `value`; false when the flag is not a case's.
  bool parse(const std::string& name, const std::string& value) {
    if (name == "--pp") pp = std::stoi(value);
    else if (name == "--tp") tp = std::stoi(value);
    else if (name == "--ep") ep = std::stoi(value);
    else if (name == "--schedule") schedule = value;
    else if (name == "--micro-batches") micro_batches = std::stoi(value);
    else if (name == "--virtual-stages") virtual_stages = std::stoi(value);
    else if (name == "--tied") tied = value == "1";
    else if (name == "--layers") layers = std::stoi(value);
    else if (name == "--sequences") sequences = std::stoi(value);
    else if (name == "--steps") steps = std::stoi(value);
    else if (name == "--engine") engine = value;
    else if (name == "--zero-stage") zero_stage = std::stoi(value);
    else if (name == "--params") params = value;
    else if (name == "--optimizer") optimizer = value;
    else if (name == "--checkpoint") checkpoint = value == "1";
    else if (name == "--family") family = value;
    else if (name == "--reuse-distance") reuse_distance = std::stoll(value);
    else return false;
    return true;
  }
  pipeline::ScheduleSpec spec() const {
    const auto kind = pipeline::parse_schedule(schedule);
    STRATA_CHECK(kind.has_value(), kBadArgument, "unknown schedule {}", schedule);
    return {*kind, pp, micro_batches, virtual_stages};
  }
  std::string describe() const {
    return fmt::format("pp {}{}{} {} m {}{}{}, {} engine{}{}", pp, tp > 1 ? fmt::format(" x tp {}", tp) : "",
                       ep > 1 ? fmt::format(" ep {}", ep) : "", schedule,
                       micro_batches, virtual_stages > 1 ? fmt::format(" v {}", virtual_stages) : "",
                       tied ? ", tied" : "", engine,
                       engine == "zero" ? fmt::format(" stage {} params {} optimizer {}", zero_stage, params, optimizer)
                                        : "",
                       checkpoint ? ", checkpointed" : "");
  }
};

// A tiny decoder with std 0.2 weights (a missing piece of math moves the loss
// visibly): hidden 32, 4 heads over 2 kv heads, `layers` layers.
inline nn::DecoderConfig model_config(const Case& c) {
  nn::DecoderConfig config = nn::tiny_llama(48, 32, 64, c.layers, 4, 2);
  config.max_position_embeddings = 32;
  config.rms_norm_eps = 1e-5;
  config.tie_word_embeddings = c.tied;
  config.model_type = c.family;
  if (c.family == "llama") config.attention_qkv_bias = config.attention_o_bias = config.mlp_bias = true;
  if (c.family == "qwen3") config.qk_norm = true;
  if (c.family == "mixtral") {  // 16 experts of width 16, top 2, renormalised; no load-balancing loss
    // (a micro-batch of one sequence routes its 24 choices to some of them:
    // each micro-batch skips other experts)
    config.num_experts = 16;
    config.num_experts_per_tok = 2;
    config.moe_intermediate_size = 16;
    config.norm_topk_prob = true;
  }
  return config;
}
inline constexpr double kInitStd = 0.2;
inline constexpr uint64_t kInitSeed = 7;

struct Batch {
  std::vector<int32_t> ids, targets;
};

// Step `step`'s global batch: random tokens, the next one as target, about one
// target in four ignored (so micro-batches' counts differ).
inline Batch corpus(int step, int sequences, int64_t vocab) {
  std::mt19937 gen(static_cast<uint32_t>(500 + step));
  Batch b;
  for (int s = 0; s < sequences; ++s) {
    std::vector<int32_t> tokens(kSeq + 1);
    for (auto& t : tokens) t = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
    for (int64_t i = 0; i < kSeq; ++i) {
      b.ids.push_back(tokens[static_cast<size_t>(i)]);
      b.targets.push_back(gen() % 4 == 0 ? ops::kIgnoreIndex : tokens[static_cast<size_t>(i) + 1]);
    }
  }
  return b;
}

inline double counted(const int32_t* targets, size_t n) {
  double c = 0;
  for (size_t i = 0; i < n; ++i) c += targets[i] != ops::kIgnoreIndex;
  return c;
}

// ---- the output file -------------------------------------------------------------------

struct StepRecord {
  double loss = 0, norm = 0;
};
struct Output {
  int rank = -1, stage = -1, dp = -1, tp = -1;
  std::vector<StepRecord> steps;
  std::vector<std::string> stats;
  int64_t held = 0;
  std::map<std::string, int64_t> tensors;  // name -> numel
  struct Run {
    std::string name;
    int64_t first = 0;
    std::vector<float> values;
  };
  std::vector<Run> runs;
};

inline std::string hex(double v) {
  char text[64];
  std::snprintf(text, sizeof(text), "%a", v);
  return text;
}

inline void write_output(const std::filesystem::path& path, const Output& out) {
  std::ofstream f(path);
  f << "rank " << out.rank << " " << out.stage << " " << out.dp << " " << out.tp << "\n";
  for (size_t s = 0; s < out.steps.size(); ++s) {
    f << "step " << s << " " << hex(out.steps[s].loss) << " " << hex(out.steps[s].norm) << "\n";
  }
  for (const std::string& line : out.stats) f << "stats " << line << "\n";
  f << "held " << out.held << "\n";
  for (const auto& [name, numel] : out.tensors) f << "tensor " << name << " " << numel << "\n";
  for (const auto& run : out.runs) {
    f << "values " << run.name << " " << run.first << " " << run.values.size();
    for (float v : run.values) f << " " << hex(v);
    f << "\n";
  }
  f << "end\n";
}

inline Output read_output(const std::filesystem::path& path) {
  std::ifstream f(path);
  STRATA_CHECK(f.good(), kIo, "no output file {}", path.string());
  Output out;
  bool ended = false;
  for (std::string line; std::getline(f, line);) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "rank") {
      in >> out.rank >> out.stage >> out.dp >> out.tp;
    } else if (kind == "step") {
      int s = 0;
      std::string loss, norm;
      in >> s >> loss >> norm;
      out.steps.push_back({std::strtod(loss.c_str(), nullptr), std::strtod(norm.c_str(), nullptr)});
    } else if (kind == "stats") {
      out.stats.push_back(line.substr(6));
    } else if (kind == "held") {
      in >> out.held;
    } else if (kind == "tensor") {
      std::string name;
      int64_t numel = 0;
      in >> name >> numel;
      out.tensors[name] = numel;
    } else if (kind == "values") {
      Output::Run run;
      size_t n = 0;
      in >> run.name >> run.first >> n;
      for (size_t i = 0; i < n; ++i) {
        std::string v;
        in >> v;
        run.values.push_back(std::strtof(v.c_str(), nullptr));
      }
      out.runs.push_back(std::move(run));
    } else if (kind == "end") {
      ended = true;
    }
  }
  STRATA_CHECK(ended, kIo, "output file {} was cut short", path.string());
  return out;
}

}  // namespace strata::test::pp
