// strata-adam: CPU optimizer throughput (parameters/s, GB/s) for each
// instruction set and dtype mix, each row beside an Adam-shaped triad timed in
// alternation with it; the per-parameter CPU-side path of a ZeRO-3 step beside
// the same path done DeepSpeed's way (and DeepSpeed itself with --vs-deepspeed);
// with --nvme DIR, a full NVMe-offloaded optimizer step beside its lower bound.
// Every row carries a correctness check.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/common/json_output.h"
#include "bench/strata-adam/adam_bench.h"
#include "kernels/optimizer.h"
#include "core/cpu_features.h"
#include "core/error.h"

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

std::string default_python() {
  const char* env = std::getenv("STRATA_PYTHON");
  return env != nullptr && *env != '\0' ? env : "python3";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "strata-adam: CPU Adam/AdamW throughput per instruction set and dtype mix, each row beside an\n"
      "Adam-shaped triad (the same reads and writes with no arithmetic) timed in alternation with it\n"
      "(ratio = triad time / Adam time). Bytes counted per parameter: read p, m, v (fp32) and g; write\n"
      "p, m, v and the 16-bit copy. Then the CPU-side path of a ZeRO-3 step (land the bf16 gradient,\n"
      "Adam, bf16 copy) strata's way beside DeepSpeed's way (fp32 gradient buffer, Adam, separate\n"
      "copy), and DeepSpeed itself with --vs-deepspeed. With --nvme DIR it also times a full\n"
      "NVMe-offloaded step (read k+1 | update k | write k-1) beside max(read alone, write alone,\n"
      "update alone). See bench/strata-adam/PERFORMANCE.md."};
  std::string numel_text = "64M", isa_text = "all", grad_text = "all", copy_text = "bf16,fp16,none";
  std::string nvme_dir, nvme_numel_text = "", sub_group_text = "64M", json_path, engine = "uring";
  std::string nvme_grad = "bf16", nvme_copy = "bf16";
  int iters = 5, threads = 0, buffers = 3, nvme_steps = 3, queue_depth = 32, io_threads = 1;
  size_t block_size = size_t{1} << 20;
  bool adam_l2 = false, skip_kernels = false, skip_path = false, vs_deepspeed = false;
  std::string python = default_python();
  std::string device;
  app.add_option("--numel", numel_text, "Parameters per kernel run (e.g. 256M; acceptance uses >= 256M)")->capture_default_str();
  app.add_option("--isa", isa_text,
                 "scalar,avx2,avx512,default or all (those this CPU supports; default: what adam_step "
                 "picks when asked for none)")->capture_default_str();
  app.add_option("--grad-dtype", grad_text, "fp32,bf16,fp16 or all")->capture_default_str();
  app.add_option("--copy", copy_text, "16-bit copy written in the same pass: bf16,fp16,none or all")->capture_default_str();
  app.add_option("--iters", iters, "Timed steps per row (median is reported)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Optimizer threads (0: OpenMP default)")->capture_default_str();
  app.add_flag("--adam", adam_l2, "Adam with L2 decay instead of AdamW");
  app.add_flag("--no-kernels", skip_kernels, "Skip the in-memory kernel rows");
  app.add_flag("--no-path", skip_path, "Skip the CPU-side path rows (strata vs DeepSpeed's way)");
  app.add_flag("--vs-deepspeed", vs_deepspeed,
               "Also time DeepSpeed's own cpu_adam + torch copies on the path, in alternation; needs a "
               "Python that imports torch and deepspeed (a first run builds the op: minutes), else "
               "says so and runs the rest");
  app.add_option("--python", python, "Python interpreter for --vs-deepspeed (default: $STRATA_PYTHON or python3)")
      ->capture_default_str();
  app.add_option("--nvme", nvme_dir, "Directory on the drive: time a full offloaded step there");
  app.add_option("--nvme-numel", nvme_numel_text, "Parameters of the offloaded step (default: --numel; acceptance uses 1B)");
  app.add_option("--sub-group", sub_group_text, "sub_group_size in parameters")->capture_default_str();
  app.add_option("--buffers", buffers, "Pinned pool buffers (each holds one sub-group: 12 B/param)")->capture_default_str();
  app.add_option("--steps", nvme_steps, "Offloaded steps (median is reported)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--nvme-grad-dtype", nvme_grad, "Gradient dtype of the offloaded step")->capture_default_str();
  app.add_option("--nvme-copy", nvme_copy, "16-bit copy dtype of the offloaded step")->capture_default_str();
  app.add_option("--engine", engine, "uring | aio | psync")->capture_default_str();
  app.add_option("--queue-depth", queue_depth, "Pieces in flight per I/O worker")->capture_default_str();
  app.add_option("--device", device,
                 "Also time the optimizer on the accelerator (offload_optimizer none): Ops::adam_step over --numel "
                 "on cpu, cuda or auto, beside a device copy (the anchor), checked against the CPU kernel")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--io-threads", io_threads, "I/O worker threads")->capture_default_str();
  app.add_option("--block-size", block_size, "Bytes per I/O piece")->capture_default_str();
  app.add_option("--json", json_path, "Write results as JSON to this path ('-' = stdout)");
  CLI11_PARSE(app, argc, argv);

  try {
    strata::bench::check_json_path(json_path);
    const size_t numel = parse_count(numel_text, "--numel");
    const int nthreads = threads > 0 ? threads : omp_get_max_threads();
    const auto& cpu = strata::cpu_features();
    nlohmann::json doc = {{"tool", "strata-adam"}, {"version", 2}, {"cpu", cpu.model},
                          {"threads", nthreads}, {"optimizer", adam_l2 ? "adam" : "adamw"}};
    std::vector<std::string> not_run;
    bool all_rows_correct = true;

    std::printf("# strata-adam  cpu: %s  threads: %d  numel: %zu  %s\n", cpu.model.c_str(), nthreads,
                numel, adam_l2 ? "Adam (L2)" : "AdamW");
    if (!skip_kernels) {
      std::vector<sb::KernelCase> cases;
      for (const auto& isa_name : expand(isa_text, {"scalar", "avx2", "avx512", "default"})) {
        std::optional<kernels::CpuIsa> isa;
        if (isa_name != "default") {
          isa = kernels::parse_isa(isa_name);
          if (!kernels::isa_supported(*isa)) {
            not_run.push_back(isa_name);
            continue;
          }
        }
        for (const auto& g : expand(grad_text, {"fp32", "bf16", "fp16"})) {
          for (const auto& c : expand(copy_text, {"bf16", "fp16", "none"})) {
            std::optional<DType> copy;
            if (c != "none") copy = strata::parse_dtype(c);
            cases.push_back({isa, strata::parse_dtype(g), copy});
          }
        }
      }
      // STREAM's triad, for reference only: it writes a line it never read, so
      // its uncounted read-for-ownership makes it a low bar (PERFORMANCE.md).
      const auto stream = sb::run_stream_triad(numel, nthreads, iters);
      std::printf("# STREAM triad (reference, not the anchor): %.2f GB/s counted (12 B/element)\n",
                  stream.gb_per_s);
      for (const auto& isa : not_run) {
        std::printf("# %s: not supported by this CPU, not measured\n", isa.c_str());
      }
      std::printf("# triad: the row's own reads and writes with no arithmetic, timed alternately with it; "
                  "ratio: median of the pairs' triad time / Adam time\n");
      std::printf("%-14s %-5s %-5s %12s %10s %10s %9s %9s %7s  %s\n", "isa", "grad", "copy", "numel",
                  "time_ms", "Mparam/s", "GB/s", "triad", "ratio", "correct");
      auto rows = sb::run_kernel_cases(cases, numel, nthreads, iters, !adam_l2);
      nlohmann::json jrows = nlohmann::json::array();
      for (const auto& r : rows) {
        const std::string label = r.default_isa ? "default=" + r.isa : r.isa;
        std::printf("%-14s %-5s %-5s %12zu %10.2f %10.1f %9.2f %9.2f %7.3f  %s\n", label.c_str(),
                    r.grad_dtype.c_str(), r.copy_dtype.c_str(), r.numel, r.seconds * 1e3,
                    r.params_per_s / 1e6, r.gb_per_s, r.triad_gb_per_s, r.ratio,
                    r.correct ? "ok" : "WRONG");
        if (!r.correct) std::printf("        check: %s\n", r.check_detail.c_str());
        all_rows_correct &= r.correct;
        jrows.push_back({{"isa", r.isa}, {"default_isa", r.default_isa},
                         {"grad_dtype", r.grad_dtype}, {"copy_dtype", r.copy_dtype},
                         {"numel", r.numel}, {"threads", r.threads}, {"seconds", r.seconds},
                         {"params_per_s", r.params_per_s}, {"bytes", r.bytes},
                         {"gb_per_s", r.gb_per_s}, {"triad_seconds", r.triad_seconds},
                         {"triad_gb_per_s", r.triad_gb_per_s}, {"ratio_to_triad", r.ratio},
                         {"correct", r.correct}, {"check", r.check_detail}});
      }
      doc["stream_triad"] = {{"numel", stream.numel}, {"seconds", stream.seconds},
                             {"gb_per_s", stream.gb_per_s}, {"correct", stream.correct}};
      all_rows_correct &= stream.correct;
      doc["kernels"] = jrows;
      doc["isa_not_supported"] = not_run;
    }

    if (!skip_path) {
      if (vs_deepspeed) {
        std::printf("\n# --vs-deepspeed: starting DeepSpeed's cpu_adam with Python '%s' (a first run "
                    "builds the op: minutes)\n", python.c_str());
        std::fflush(stdout);
      }
      const auto path = sb::run_path(numel, nthreads, iters, !adam_l2, vs_deepspeed ? python : "");
      std::printf("\n# CPU-side path per parameter, bf16 gradient and bf16 copy, %d alternating rounds "
                  "(time and parts: medians; vs_way, vs_ds: medians of the rounds' ratios)\n", iters);
      if (!path.deepspeed_versions.empty()) {
        std::printf("# deepspeed: %s; DeepSpeedCPUAdam.step() + torch copy_ (OMP_NUM_THREADS=%d)\n",
                    path.deepspeed_versions.c_str(), nthreads);
      } else {
        std::printf("# deepspeed row: not run: %s\n", path.deepspeed_skipped.c_str());
      }
      const bool with_ds = !path.deepspeed_versions.empty();
      std::printf("%-14s %-7s %10s %9s %9s %9s %10s %9s %9s%s  %s\n", "path", "isa", "time_ms",
                  "land_ms", "adam_ms", "copy_ms", "Mparam/s", "GB/s", "vs_way", with_ds ? "     vs_ds" : "",
                  "correct");
      nlohmann::json jpath = nlohmann::json::array();
      for (const auto& r : path.rows) {
        std::printf("%-14s %-7s %10.2f %9.2f %9.2f %9.2f %10.1f %9.2f %9.3f", r.name.c_str(),
                    r.isa.empty() ? "-" : r.isa.c_str(), r.seconds * 1e3, r.land_seconds * 1e3,
                    r.adam_seconds * 1e3, r.copy_seconds * 1e3, r.params_per_s / 1e6,
                    r.bytes / r.seconds / 1e9, r.ratio_to_deepspeed_way);
        if (with_ds) std::printf(" %9.3f", r.ratio_to_deepspeed);
        std::printf("  %s\n", r.correct ? "ok" : "WRONG");
        if (!r.correct) std::printf("        check: %s\n", r.check_detail.c_str());
        all_rows_correct &= r.correct;
        jpath.push_back({{"path", r.name}, {"isa", r.isa}, {"numel", r.numel}, {"seconds", r.seconds},
                         {"land_seconds", r.land_seconds}, {"adam_seconds", r.adam_seconds},
                         {"copy_seconds", r.copy_seconds}, {"params_per_s", r.params_per_s},
                         {"bytes", r.bytes}, {"ratio_to_deepspeed_way", r.ratio_to_deepspeed_way},
                         {"ratio_to_deepspeed", with_ds ? nlohmann::json(r.ratio_to_deepspeed)
                                                        : nlohmann::json(nullptr)},
                         {"correct", r.correct}, {"check", r.check_detail}});
      }
      if (with_ds && path.rows.size() == 3) {
        // The parts side by side: Adam alone (fp32 gradient, no copy) is our
        // kernel inside deepspeed-way against DeepSpeed's step.
        const auto& way = path.rows[1];
        const auto& ds = path.rows[2];
        std::printf("# medians of the parts: Adam alone (fp32 gradient, no copy): strata %.2f ms, DeepSpeed "
                    "%.2f ms: %.3fx; Adam + bf16 copy: strata's fused pass (bf16 gradient) %.2f ms, "
                    "DeepSpeed's step + copy %.2f ms: %.3fx\n",
                    way.adam_seconds * 1e3, ds.adam_seconds * 1e3, ds.adam_seconds / way.adam_seconds,
                    path.rows[0].adam_seconds * 1e3, (ds.adam_seconds + ds.copy_seconds) * 1e3,
                    (ds.adam_seconds + ds.copy_seconds) / path.rows[0].adam_seconds);
      }
      doc["path"] = jpath;
      doc["deepspeed"] = with_ds ? nlohmann::json(path.deepspeed_versions) : nlohmann::json(nullptr);
      if (!with_ds) doc["deepspeed_skipped"] = path.deepspeed_skipped;
    }

    const auto chosen = kernels::default_isa_info();
    std::printf("\n# default ISA: %s (%s", std::string(kernels::isa_name(chosen.isa)).c_str(),
                std::string(chosen.basis).c_str());
    if (chosen.basis == "calibrated") {
      std::printf(" on %d updates: avx512 %.3f ns/param, avx2 %.3f ns/param", chosen.trials,
                  chosen.avx512_ns_per_param, chosen.avx2_ns_per_param);
    }
    std::printf(")\n");
    doc["default_isa"] = {{"isa", kernels::isa_name(chosen.isa)}, {"basis", chosen.basis},
                          {"trials", chosen.trials},
                          {"avx512_ns_per_param", chosen.avx512_ns_per_param},
                          {"avx2_ns_per_param", chosen.avx2_ns_per_param}};

    if (!device.empty()) {
      const auto d = sb::run_device_step(device, numel, iters, !adam_l2);
      std::printf("\n# optimizer on the accelerator (%s): Ops::adam_step, fp32 gradient, bf16 copy, %d pairs "
                  "alternating with a device copy of one fp32 array (anchor, 8 B/element)\n",
                  d.accelerator.c_str(), iters);
      std::printf("%-14s %12s %10s %10s %9s %9s %7s  %s\n", "device", "numel", "time_ms", "Mparam/s", "GB/s",
                  "copy GB/s", "ratio", "correct");
      std::printf("%-14s %12zu %10.2f %10.1f %9.2f %9.2f %7.3f  %s\n", d.accelerator.c_str(), d.numel,
                  d.seconds * 1e3, d.params_per_s / 1e6, d.gb_per_s, d.copy_gb_per_s, d.ratio,
                  d.correct ? "ok" : "WRONG");
      std::printf("        check: %s\n", d.check_detail.c_str());
      all_rows_correct &= d.correct;
      doc["device_step"] = {{"accelerator", d.accelerator}, {"numel", d.numel}, {"seconds", d.seconds},
                            {"params_per_s", d.params_per_s}, {"bytes", d.bytes}, {"gb_per_s", d.gb_per_s},
                            {"copy_seconds", d.copy_seconds}, {"copy_gb_per_s", d.copy_gb_per_s},
                            {"ratio_to_copy", d.ratio}, {"correct", d.correct}, {"check", d.check_detail}};
    }

    bool all_ok = all_rows_correct;
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
    strata::bench::write_json_output(json_path, doc);
    return all_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-adam: %s\n", e.what());
    return 2;
  }
}
