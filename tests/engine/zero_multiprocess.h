// Shared by the multi-process ZeRO-3 tests (zero_multiprocess_test.cc) and
// their rank program (zero_multiprocess_rank.cc): the engine and model
// options both sides must agree on, and the rank program's output file.
//
// The model, corpus, per-rank batch split and global-token normalisation are
// those of the thread tests (zero_training.h), so the combined batch of N
// ranks is the one-rank batch.
//
// Output file (text; floats as hexfloat, so they round-trip bit for bit):
//   rank R W                          this rank and the world size
//   step S LOSS PREFETCHED FETCHES F  per step: the global loss, the coordinator's
//                                     prefetched and total fetches, F: trace followed
//   nvme_read BYTES                   NVMe bytes this rank's engine read
//   param ID NUMEL NAME               every parameter, in id order
//   range ID FIRST N V...             this rank's owned ranges of the final parameters
//   end                               (a file without it was cut short)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "tests/engine/zero_training.h"

namespace strata::test::zero_mp {

inline constexpr int kSteps = 4;
inline constexpr uint64_t kInitSeed = 7;
// Tied: the embedding is gathered at the start of forward and again for the
// lm_head at its end, and its gradient is complete only at its second use.
inline constexpr bool kTied = true;

// Every MLP projection 2 x 2 tiles (TiledLinear): each tile its own operator,
// gathered and prefetched on its own.
inline nn::DecoderModelOptions model_options() {
  nn::DecoderModelOptions o = nn::model_options(DType::kF32, 16);
  o.mlp_tiling = {2, 2};
  return o;
}

// Adam as in the thread tests' N-ranks-equal-one-rank case: with eps = 1 a
// weight moves by about lr x its gradient, so the rounding difference of
// summing N partial gradients stays rounding-sized in the weights (with a
// small eps Adam turns a gradient of ~0 into a step of +-lr, and its sign
// would depend on the summation order).
inline kernels::AdamConfig adam() {
  kernels::AdamConfig a = zero::options_for(3).adam;
  a.eps = 1.0f;
  return a;
}

// ZeRO-3, parameters on NVMe, prefetch on with a bucket of a few parameters,
// nothing kept gathered for a later use, so every operator's parameters are
// gathered (and read from NVMe) at every use. Every parameter here is smaller
// than 4 x 1024 elements, and the layout rounds each rank's slice up to 4096
// bytes (1024 fp32), so on 4 ranks each gather is 4096 elements: the bucket
// holds 4 gathers ahead, of about 38 parameters per pass.
inline engine::ZeroEngineOptions engine_options(const std::filesystem::path& nvme_path) {
  engine::ZeroEngineOptions o = zero::options_for(3);
  o.adam = adam();
  o.param_tier = Tier::kNvme;
  o.nvme_path = nvme_path;
  o.prefetch_bucket_numel = 4 * 4096;
  o.max_reuse_distance_numel = 0;
  return o;
}

// ---- the output file -----------------------------------------------------------------------

struct StepRecord {
  double loss = 0;
  int64_t prefetched = 0, fetches = 0;
  bool trace_followed = false;
};

struct Range {
  int32_t param = 0;
  int64_t first = 0;
  std::vector<float> values;
};

struct RankOutput {
  int rank = -1, world = 0;
  std::vector<StepRecord> steps;
  uint64_t nvme_read = 0;
  std::vector<std::pair<std::string, int64_t>> params;  // name, numel
  std::vector<Range> ranges;
};

// Writes `out` to `path` through a temporary file renamed at the end, so a
// reader never sees half a file.
inline void write_output(const std::filesystem::path& path, const RankOutput& out) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << std::hexfloat;
    f << "rank " << out.rank << ' ' << out.world << '\n';
    for (size_t s = 0; s < out.steps.size(); ++s) {
      const StepRecord& r = out.steps[s];
      f << "step " << s << ' ' << r.loss << ' ' << r.prefetched << ' ' << r.fetches << ' ' << r.trace_followed
        << '\n';
    }
    f << "nvme_read " << out.nvme_read << '\n';
    for (size_t p = 0; p < out.params.size(); ++p) {
      f << "param " << p << ' ' << out.params[p].second << ' ' << out.params[p].first << '\n';
    }
    for (const Range& r : out.ranges) {
      f << "range " << r.param << ' ' << r.first << ' ' << r.values.size();
      for (float v : r.values) f << ' ' << v;
      f << '\n';
    }
    f << "end\n";
    STRATA_CHECK(f.good(), kIo, "writing {}", tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

// Hexfloat text to a number: strtod/strtof read it exactly (operator>> does not
// parse hexfloat before C++23's library fixes).
inline double parse_double(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  STRATA_CHECK(end != text.c_str() && *end == '\0', kBadArgument, "not a number: '{}'", text);
  return v;
}

inline RankOutput read_output(const std::filesystem::path& path) {
  std::ifstream f(path);
  STRATA_CHECK(f.good(), kIo, "cannot open {}", path.string());
  RankOutput out;
  bool ended = false;
  for (std::string line; std::getline(f, line);) {
    std::istringstream in(line);
    std::string kind, word;
    in >> kind;
    if (kind == "rank") {
      in >> out.rank >> out.world;
    } else if (kind == "step") {
      StepRecord r;
      size_t s = 0;
      in >> s >> word >> r.prefetched >> r.fetches >> r.trace_followed;
      r.loss = parse_double(word);
      STRATA_CHECK(s == out.steps.size(), kBadArgument, "{}: step {} out of order", path.string(), s);
      out.steps.push_back(r);
    } else if (kind == "nvme_read") {
      in >> out.nvme_read;
    } else if (kind == "param") {
      size_t id = 0;
      int64_t numel = 0;
      std::string name;
      in >> id >> numel >> name;
      STRATA_CHECK(id == out.params.size(), kBadArgument, "{}: param {} out of order", path.string(), id);
      out.params.emplace_back(name, numel);
    } else if (kind == "range") {
      Range r;
      size_t n = 0;
      in >> r.param >> r.first >> n;
      STRATA_CHECK(!in.fail(), kBadArgument, "{}: bad line '{}'", path.string(), line.substr(0, 80));
      r.values.reserve(n);
      while (in >> word) r.values.push_back(static_cast<float>(parse_double(word)));
      STRATA_CHECK(r.values.size() == n, kBadArgument, "{}: range of {} values holds {}", path.string(), n,
                   r.values.size());
      out.ranges.push_back(std::move(r));
    } else if (kind == "end") {
      ended = true;
    }
    STRATA_CHECK(!in.fail() || kind == "range", kBadArgument, "{}: bad line '{}'", path.string(),
                 line.substr(0, 80));
  }
  STRATA_CHECK(ended, kBadArgument, "{} is cut short (no end line)", path.string());
  return out;
}

}  // namespace strata::test::zero_mp
