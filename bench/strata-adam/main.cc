// strata-adam: CPU optimizer throughput (parameters/s, GB/s) for each
// instruction set and dtype mix beside a memory-bandwidth triad of the same
// run; with --nvme DIR, a full NVMe-offloaded optimizer step beside its lower
// bound. Every row carries a correctness check against the scalar reference.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/strata-adam/adam_bench.h"
#include "kernels/optimizer.h"
#include "runtime/core/cpu_features.h"
#include "runtime/core/error.h"

namespace sb = strata::bench;
namespace kernels = strata::kernels;
using strata::DType;

namespace {

// "268435456", "256M" (binary), "1e9", "1G" (binary), "1B" (10^9 parameters).
size_t parse_count(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    double value = std::stod(text, &used);
    const std::string unit = text.substr(used);
    if (unit == "K") value *= 1024.0;
    else if (unit == "M") value *= 1048576.0;
    else if (unit == "G") value *= 1073741824.0;
    else if (unit == "B") value *= 1e9;
    else if (!unit.empty()) throw std::invalid_argument(unit);
    if (value < 1 || value > 1e13) throw std::out_of_range(text);
    return static_cast<size_t>(std::llround(value));
  } catch (const std::exception&) {
    strata::raise(strata::ErrorCategory::kBadArgument,
                  "{} '{}' is not a count (examples: 268435456, 256M, 1e9, 1B)", what, text);
  }
}

std::vector<std::string> expand(const std::string& arg, const std::vector<std::string>& all) {
  if (arg == "all") return all;
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= arg.size()) {
    const size_t comma = arg.find(',', start);
    out.push_back(arg.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "strata-adam: CPU Adam/AdamW throughput per instruction set and dtype mix, beside a memory\n"
      "triad measured in the same run (ratio = Adam GB/s / triad GB/s). Bytes counted per parameter:\n"
      "read p, m, v (fp32) and g; write p, m, v and the 16-bit copy. With --nvme DIR it also times a\n"
      "full NVMe-offloaded step (read k+1 | update k | write k-1) beside max(read alone, write alone,\n"
      "update alone). See bench/PERFORMANCE.md."};
  std::string numel_text = "64M", isa_text = "all", grad_text = "all", copy_text = "bf16,fp16,none";
  std::string nvme_dir, nvme_numel_text = "", sub_group_text = "64M", json_path, engine = "uring";
  std::string nvme_grad = "bf16", nvme_copy = "bf16";
  int iters = 5, threads = 0, buffers = 3, nvme_steps = 3, queue_depth = 32, io_threads = 1;
  size_t block_size = size_t{1} << 20;
  bool adam_l2 = false, skip_kernels = false;
  app.add_option("--numel", numel_text, "Parameters per kernel run (e.g. 256M; acceptance uses >= 256M)")->capture_default_str();
  app.add_option("--isa", isa_text, "scalar,avx2,avx512 or all (those this CPU supports)")->capture_default_str();
  app.add_option("--grad-dtype", grad_text, "fp32,bf16,fp16 or all")->capture_default_str();
  app.add_option("--copy", copy_text, "16-bit copy written in the same pass: bf16,fp16,none or all")->capture_default_str();
  app.add_option("--iters", iters, "Timed steps per row (median is reported)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Optimizer threads (0: OpenMP default)")->capture_default_str();
  app.add_flag("--adam", adam_l2, "Adam with L2 decay instead of AdamW");
  app.add_flag("--no-kernels", skip_kernels, "Skip the in-memory rows (only --nvme)");
  app.add_option("--nvme", nvme_dir, "Directory on the drive: time a full offloaded step there");
  app.add_option("--nvme-numel", nvme_numel_text, "Parameters of the offloaded step (default: --numel; acceptance uses 1B)");
  app.add_option("--sub-group", sub_group_text, "sub_group_size in parameters")->capture_default_str();
  app.add_option("--buffers", buffers, "Pinned pool buffers (each holds one sub-group: 12 B/param)")->capture_default_str();
  app.add_option("--steps", nvme_steps, "Offloaded steps (median is reported)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--nvme-grad-dtype", nvme_grad, "Gradient dtype of the offloaded step")->capture_default_str();
  app.add_option("--nvme-copy", nvme_copy, "16-bit copy dtype of the offloaded step")->capture_default_str();
  app.add_option("--engine", engine, "uring | aio | psync")->capture_default_str();
  app.add_option("--queue-depth", queue_depth, "Pieces in flight per I/O worker")->capture_default_str();
  app.add_option("--io-threads", io_threads, "I/O worker threads")->capture_default_str();
  app.add_option("--block-size", block_size, "Bytes per I/O piece")->capture_default_str();
  app.add_option("--json", json_path, "Write results as JSON to this path ('-' = stdout)");
  CLI11_PARSE(app, argc, argv);

  try {
    const size_t numel = parse_count(numel_text, "--numel");
    const int nthreads = threads > 0 ? threads : omp_get_max_threads();
    const auto& cpu = strata::cpu_features();
    nlohmann::json doc = {{"tool", "strata-adam"}, {"version", 1}, {"cpu", cpu.model},
                          {"threads", nthreads}, {"optimizer", adam_l2 ? "adam" : "adamw"}};
    std::vector<std::string> not_run;
    bool all_rows_correct = true;

    if (!skip_kernels) {
      std::vector<sb::KernelCase> cases;
      for (const auto& isa_name : expand(isa_text, {"scalar", "avx2", "avx512"})) {
        const auto isa = kernels::parse_isa(isa_name);
        if (!kernels::isa_supported(isa)) {
          not_run.push_back(isa_name);
          continue;
        }
        for (const auto& g : expand(grad_text, {"fp32", "bf16", "fp16"})) {
          for (const auto& c : expand(copy_text, {"bf16", "fp16", "none"})) {
            std::optional<DType> copy;
            if (c != "none") copy = strata::parse_dtype(c);
            cases.push_back({isa, strata::parse_dtype(g), copy});
          }
        }
      }
      // The triad runs before and after the kernel rows and the better one is
      // the anchor: neighbours on a shared machine only ever lower it.
      auto triad = sb::run_triad(numel, nthreads, iters);
      std::printf("# strata-adam  cpu: %s  threads: %d  numel: %zu  %s\n", cpu.model.c_str(), nthreads,
                  numel, adam_l2 ? "Adam (L2)" : "AdamW");
      for (const auto& isa : not_run) {
        std::printf("# %s: not supported by this CPU, not measured\n", isa.c_str());
      }
      std::printf("%-7s %-5s %-5s %12s %10s %12s %9s %9s %7s  %s\n", "isa", "grad", "copy", "numel",
                  "time_ms", "Mparam/s", "GB/s", "triad", "ratio", "correct");
      // Sort cases by grad dtype only to reuse the converted gradient buffer.
      auto rows = sb::run_kernel_cases(cases, numel, nthreads, iters, !adam_l2, triad.gb_per_s);
      const auto triad_after = sb::run_triad(numel, nthreads, iters);
      const double triad_before = triad.gb_per_s;
      if (triad_after.gb_per_s > triad.gb_per_s) triad = triad_after;
      triad.correct = triad.correct && triad_after.correct;
      for (auto& r : rows) {
        r.triad_gb_per_s = triad.gb_per_s;
        r.ratio = r.gb_per_s / triad.gb_per_s;
      }
      std::printf("# triad before %.2f GB/s, after %.2f GB/s: anchor %.2f GB/s\n", triad_before,
                  triad_after.gb_per_s, triad.gb_per_s);
      nlohmann::json jrows = nlohmann::json::array();
      for (const auto& r : rows) {
        std::printf("%-7s %-5s %-5s %12zu %10.2f %12.1f %9.2f %9.2f %7.3f  %s\n", r.isa.c_str(),
                    r.grad_dtype.c_str(), r.copy_dtype.c_str(), r.numel, r.seconds * 1e3,
                    r.params_per_s / 1e6, r.gb_per_s, r.triad_gb_per_s, r.ratio,
                    r.correct ? "ok" : "WRONG");
        if (!r.correct) std::printf("        check: %s\n", r.check_detail.c_str());
        jrows.push_back({{"isa", r.isa}, {"grad_dtype", r.grad_dtype}, {"copy_dtype", r.copy_dtype},
                         {"numel", r.numel}, {"threads", r.threads}, {"seconds", r.seconds},
                         {"params_per_s", r.params_per_s}, {"bytes", r.bytes},
                         {"gb_per_s", r.gb_per_s}, {"triad_gb_per_s", r.triad_gb_per_s},
                         {"ratio_to_triad", r.ratio}, {"correct", r.correct},
                         {"check", r.check_detail}});
      }
      doc["triad"] = {{"numel", triad.numel}, {"seconds", triad.seconds},
                      {"gb_per_s", triad.gb_per_s}, {"before_gb_per_s", triad_before},
                      {"after_gb_per_s", triad_after.gb_per_s}, {"correct", triad.correct}};
      all_rows_correct = triad.correct;
      doc["kernels"] = jrows;
      doc["isa_not_supported"] = not_run;
    }

    bool all_ok = all_rows_correct;
    if (doc.contains("kernels")) {
      for (const auto& r : doc["kernels"]) all_ok &= r["correct"].get<bool>();
    }
    if (!nvme_dir.empty()) {
      sb::NvmeStepOptions o;
      o.dir = nvme_dir;
      o.numel = nvme_numel_text.empty() ? numel : parse_count(nvme_numel_text, "--nvme-numel");
      o.sub_group_numel = parse_count(sub_group_text, "--sub-group");
      o.buffer_count = static_cast<size_t>(buffers);
      o.grad_dtype = strata::parse_dtype(nvme_grad);
      o.copy_dtype = strata::parse_dtype(nvme_copy);
      o.steps = nvme_steps;
      o.threads = nthreads;
      o.aio.engine = strata::nvme::parse_engine_kind(engine);
      o.aio.queue_depth = queue_depth;
      o.aio.thread_count = io_threads;
      o.aio.block_size = block_size;
      o.aio.validate();
      const auto r = sb::run_nvme_step(o);
      std::printf("\n# NVMe-offloaded step: %zu params, %zu sub-groups of %zu, %zu buffers, dir %s\n",
                  r.numel, r.sub_groups, r.sub_group_numel, r.buffer_count, nvme_dir.c_str());
      std::printf("%-14s %10s %10s %10s %10s %12s %7s  %s\n", "numel", "step_s", "read_s", "write_s",
                  "update_s", "lower_bound", "ratio", "correct");
      std::printf("%-14zu %10.2f %10.2f %10.2f %10.2f %12.2f %7.3f  %s\n", r.numel, r.step_seconds,
                  r.read_alone_seconds, r.write_alone_seconds, r.update_alone_seconds,
                  r.lower_bound_seconds, r.ratio, r.correct ? "ok" : "WRONG");
      std::printf("# read alone %.2f GB/s, write alone %.2f GB/s; inside the step: update %.2f s, "
                  "read wait %.2f s, write wait %.2f s, commit %.2f s; initialize %.2f s\n",
                  r.read_gb_per_s, r.write_gb_per_s, r.step_update_seconds, r.step_read_wait_seconds,
                  r.step_write_wait_seconds, r.step_commit_seconds, r.init_seconds);
      std::printf("# reads+writes together, no update: %.2f s; step / max(that, update alone) = %.3f\n",
                  r.read_write_alone_seconds, r.duplex_ratio);
      if (!r.correct) std::printf("# check: %s\n", r.check_detail.c_str());
      all_ok &= r.correct;
      doc["nvme_step"] = {{"numel", r.numel}, {"sub_group_numel", r.sub_group_numel},
                          {"sub_groups", r.sub_groups}, {"buffer_count", r.buffer_count},
                          {"step_seconds", r.step_seconds},
                          {"read_alone_seconds", r.read_alone_seconds},
                          {"write_alone_seconds", r.write_alone_seconds},
                          {"update_alone_seconds", r.update_alone_seconds},
                          {"lower_bound_seconds", r.lower_bound_seconds},
                          {"ratio_to_lower_bound", r.ratio},
                          {"read_write_alone_seconds", r.read_write_alone_seconds},
                          {"duplex_bound_seconds", r.duplex_bound_seconds},
                          {"ratio_to_duplex_bound", r.duplex_ratio},
                          {"bytes_read", r.bytes_read}, {"bytes_written", r.bytes_written},
                          {"read_gb_per_s", r.read_gb_per_s}, {"write_gb_per_s", r.write_gb_per_s},
                          {"step_update_seconds", r.step_update_seconds},
                          {"step_read_wait_seconds", r.step_read_wait_seconds},
                          {"step_write_wait_seconds", r.step_write_wait_seconds},
                          {"step_commit_seconds", r.step_commit_seconds},
                          {"init_seconds", r.init_seconds}, {"engine", engine},
                          {"correct", r.correct}, {"check", r.check_detail}};
    }
    doc["all_correct"] = all_ok;
    if (!json_path.empty()) {
      if (json_path == "-") {
        std::cout << doc.dump(2) << "\n";
      } else {
        std::ofstream(json_path) << doc.dump(2) << "\n";
      }
    }
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-adam: %s\n", e.what());
    return 2;
  }
}
