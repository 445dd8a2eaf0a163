// strata-quant: how fast gpt-oss's MXFP4 experts are read from a checkpoint,
// on a synthetic stacked tensor of a published shape -- by default one
// gpt-oss-120b layer's gate_up_proj [128, 2880, 5760] (blocks [128, 5760,
// 90, 16], scales [128, 5760, 90]; --experts fewer to bound memory). One
// thread, as each rank's loader runs. Paths (--paths):
//   elementwise: what the loader did before the row path -- every expert
//                weight (gate and up, gate_up's even and odd columns) through
//                nn::for_each_tensor_run's one-element runs of its strided
//                view into nn::dequantize_mxfp4;
//   loader:      what load_hf_weights does now -- each weight row by row
//                (kernels::dequantize_mxfp4_columns: a row is one block
//                column, its codes in order);
//   stacked:     nn::dequantize_mxfp4 of the whole stacked tensor in one call
//                (band-by-band tiles).
// MB/s of values written (the output dtype) and of checkpoint bytes read, the
// median of --repeats timed runs after one untimed. Anchor: memcpy of the
// output's bytes, alternating with each path in the same run. Correctness:
// sampled elements of every path equal convert_moe_packed_tensors' formula
// computed here term by term, and the loader and elementwise paths give the
// same bytes.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <vector>

#include "bench/common/json_output.h"
#include "bench/common/stats.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/mxfp4_blocks.h"
#include "runtime/engine/engine.h"
#include "runtime/nn/checkpoint_quant.h"
#include "runtime/nn/param_files.h"

namespace {
using namespace strata;
using Clock = std::chrono::steady_clock;

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int run(int argc, char** argv) {
  CLI::App app{"strata-quant: gpt-oss MXFP4 expert loading speed (the loader's paths), against memcpy"};
  int64_t experts = 128, in = 2880, width = 5760;
  int repeats = 3;
  std::string dtype_text = "bf16", paths_text = "elementwise,loader,stacked", json_path;
  app.add_option("--experts", experts, "experts E of the stacked tensor [E, in, width] (128: gpt-oss-120b)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--in", in, "in (the blocked dim, a multiple of 32; 2880: gpt-oss's hidden size)")
      ->check(CLI::Range(int64_t{32}, int64_t{1} << 20));
  app.add_option("--width", width, "width (even; 5760: gate_up's 2 x intermediate)")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--dtype", dtype_text, "output dtype: bf16, fp16, fp32");
  app.add_option("--paths", paths_text, "comma-separated: elementwise, loader, stacked");
  app.add_option("--repeats", repeats, "timed runs (the median is reported)")->check(CLI::Range(1, 1000));
  app.add_option("--json", json_path, "also write the results as JSON (- for stdout)");
  CLI11_PARSE(app, argc, argv);
  bench::check_json_path(json_path);
  STRATA_CHECK(in % 32 == 0, kBadArgument, "--in {}: MXFP4 blocks hold 32 values; give a multiple of 32", in);
  STRATA_CHECK(width % 2 == 0, kBadArgument, "--width {}: gate and up interleave; give an even width", width);
  const DType dtype = parse_dtype(dtype_text);
  const size_t esize = dtype_nbytes(dtype);
  const int64_t groups = in / 32, numel = experts * in * width, half = width / 2;

  // Random codes; scales around 2^0 as trained weights have (the extremes included).
  std::vector<uint8_t> blocks(static_cast<size_t>(numel / 2)), scales(static_cast<size_t>(numel / 32));
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < blocks.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(blocks.data() + i, &r, std::min<size_t>(8, blocks.size() - i));
  }
  for (uint8_t& s : scales) s = static_cast<uint8_t>(117 + rng() % 16);
  scales[0] = 0;
  scales[scales.size() - 1] = 255;
  const TensorView bview{TensorDesc{DType::kU8, {experts, width, groups, 16}, Tier::kCpu}, blocks.data()};
  const TensorView sview{TensorDesc{DType::kU8, {experts, width, groups}, Tier::kCpu}, scales.data()};
  const kernels::Mxfp4Stacked stacked{experts, in, width};
  const size_t out_nbytes = static_cast<size_t>(numel) * esize;
  std::vector<char> out(out_nbytes), copy(out_nbytes), reference;

  // The expert weights as the model declares them: gate (even columns) and
  // up (odd), each [width / 2, in], a strided view of the stacked tensor.
  const auto weight = [&](int64_t e, int64_t first) {
    engine::ParamInfo p;
    p.name = "w";
    p.dtype = dtype;
    p.shape = {half, in};
    p.slice = engine::ParameterSlice{"gate_up_proj", {experts, in, width}, {}, {2, width}, e * in * width + first};
    return p;
  };
  const std::map<std::string, std::function<void()>> paths = {
      {"elementwise",
       [&] {
         for (int64_t e = 0; e < experts; ++e) {
           for (int64_t first : {0, 1}) {
             const engine::ParamInfo p = weight(e, first);
             char* dst = out.data() + static_cast<size_t>((e * 2 + first) * half * in) * esize;
             nn::for_each_tensor_run(p, 0, half * in, [&](int64_t at, int64_t into, int64_t n) {
               nn::dequantize_mxfp4(bview, sview, at, n, dst + static_cast<size_t>(into) * esize, dtype);
             });
           }
         }
       }},
      {"loader",
       [&] {
         for (int64_t e = 0; e < experts; ++e) {
           for (int64_t first : {0, 1}) {
             char* dst = out.data() + static_cast<size_t>((e * 2 + first) * half * in) * esize;
             kernels::dequantize_mxfp4_columns(blocks.data(), scales.data(), stacked, e * width + first, 2, 0,
                                               half * in, dst, dtype);
           }
         }
       }},
      {"stacked", [&] { nn::dequantize_mxfp4(bview, sview, 0, numel, out.data(), dtype); }},
  };
  std::vector<std::string> chosen;
  {
    std::stringstream ss(paths_text);
    for (std::string p; std::getline(ss, p, ',');) {
      STRATA_CHECK(paths.contains(p), kBadArgument, "--paths: '{}' is not elementwise, loader or stacked", p);
      chosen.push_back(p);
    }
  }

  static constexpr float kFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  const double in_nbytes = static_cast<double>(blocks.size() + scales.size());
  std::printf("%-12s %-22s %-6s %10s %12s %12s %12s %8s %8s\n", "path", "tensor", "dtype", "median s", "out MB/s",
              "ckpt MB/s", "memcpy MB/s", "x memcpy", "correct");
  nlohmann::json rows = nlohmann::json::array();
  bool all_correct = true;
  for (const std::string& name : chosen) {
    const std::function<void()>& fn = paths.at(name);
    fn();  // untimed: page faults of the output
    std::memcpy(copy.data(), out.data(), out_nbytes);
    std::vector<double> path_s, copy_s;
    for (int i = 0; i < repeats; ++i) {
      path_s.push_back(seconds_of(fn));
      copy_s.push_back(seconds_of([&] { std::memcpy(copy.data(), out.data(), out_nbytes); }));
    }
    bool correct = true;
    for (int k = 0; k < 100000 && correct; ++k) {
      const auto i = static_cast<int64_t>(rng() % static_cast<uint64_t>(numel));
      int64_t e = i / (in * width), r = (i / width) % in, c = i % width;
      if (name != "stacked") {
        // Expert e's gate (even columns) then up (odd), each [width / 2, in].
        const int64_t w = (i / (half * in)) % 2, o = (i / in) % half;
        r = i % in;
        c = 2 * o + w;
      }
      const int64_t group = (e * width + c) * groups + r / 32;
      const uint8_t byte = blocks[static_cast<size_t>(group * 16 + (r % 32) / 2)];
      const float want =
          kFp4[r % 2 == 0 ? byte & 0x0f : byte >> 4] * std::ldexp(1.0f, scales[static_cast<size_t>(group)] - 127);
      char one[8];
      store_from_float(one, dtype, 0, want);
      correct = std::memcmp(one, out.data() + static_cast<size_t>(i) * esize, esize) == 0;
    }
    if (name != "stacked") {
      // The first of elementwise / loader is the reference the other must equal.
      if (reference.empty()) {
        reference = out;
      } else {
        correct = correct && out == reference;
      }
    }
    all_correct = all_correct && correct;
    const double t = bench::median(path_s), tc = bench::median(copy_s);
    const double out_mbs = static_cast<double>(out_nbytes) / t / 1e6, in_mbs = in_nbytes / t / 1e6;
    const double copy_mbs = static_cast<double>(out_nbytes) / tc / 1e6;
    const std::string shape = fmt::format("[{}, {}, {}]", experts, in, width);
    std::printf("%-12s %-22s %-6s %10.3f %12.0f %12.0f %12.0f %8.3f %8s\n", name.c_str(), shape.c_str(),
                dtype_text.c_str(), t, out_mbs, in_mbs, copy_mbs, out_mbs / copy_mbs, correct ? "yes" : "NO");
    rows.push_back({{"path", name}, {"seconds", path_s}, {"memcpy_s", copy_s}, {"median_s", t},
                    {"out_mb_per_s", out_mbs}, {"checkpoint_mb_per_s", in_mbs}, {"memcpy_mb_per_s", copy_mbs},
                    {"ratio_to_memcpy", out_mbs / copy_mbs}, {"correct", correct}});
  }
  std::printf("OPENBLAS_CORETYPE %s\n", coretype ? coretype : "unset");
  bench::write_json_output(json_path, {{"tensor", {experts, in, width}},
                                       {"dtype", dtype_text},
                                       {"openblas_coretype", coretype ? coretype : "unset"},
                                       {"paths", rows}});
  return all_correct ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata-quant: %s\n", e.what());
    return 2;
  }
}
