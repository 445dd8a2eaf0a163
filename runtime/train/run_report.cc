// Progress, metrics.jsonl, the summary table and the loss curve.
#include "runtime/train/run_report.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/durable_file.h"
#include "core/error.h"

namespace strata::train {
namespace {

std::string duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s / 60) % 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

// JSON numbers must be finite: a skipped step's infinite norm becomes null.
nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); }

}  // namespace

RunReport::RunReport(std::filesystem::path dir, int64_t total_steps, std::FILE* out,
                     std::optional<int64_t> resumed_after, const RunRecord& inputs)
    : dir_(std::move(dir)), total_steps_(total_steps), out_(out) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  STRATA_CHECK(!ec, kIo, "cannot create the output directory {}: {}", dir_.string(), ec.message());
  {
    // Written whole before the metrics, so a run with metrics has its record.
    RunRecord record = this_run_record();
    record.ds_config = inputs.ds_config;
    record.model_config = inputs.model_config;
    record.zero_sizes = inputs.zero_sizes;
    write_file_durably(dir_ / "run.json", run_record_json(record));
  }
  metrics_path_ = dir_ / "metrics.jsonl";
  curve_path_ = dir_ / "loss.svg";
  std::string kept;  // the lines of steps the resumed checkpoint includes
  if (resumed_after) {
    std::ifstream in(metrics_path_);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.contains("step") || j["step"].get<int64_t>() > *resumed_after) continue;
      StepRecord r;
      r.step = j["step"].get<int64_t>();
      r.loss = j["loss"].is_number() ? j["loss"].get<double>() : NAN;
      r.applied = j.value("applied", true);
      r.tokens = j.value("tokens", int64_t{0});
      r.seconds = j.value("step_s", 0.0);
      if (j.contains("eval_loss") && j["eval_loss"].is_number()) r.eval_loss = j["eval_loss"].get<double>();
      if (j.contains("aux_loss") && j["aux_loss"].is_number()) r.aux_loss = j["aux_loss"].get<double>();
      if (j.contains("router_imbalance") && j["router_imbalance"].is_number()) {
        r.router_imbalance = j["router_imbalance"].get<double>();
      }
      steps_.push_back(r);
      elapsed_ += r.seconds;
      kept += line + "\n";
    }
  }
  // The kept lines replace the file whole (a crash now loses none of them); new steps are appended.
  write_file_durably(metrics_path_, kept);
  metrics_ = std::fopen(metrics_path_.c_str(), "a");
  if (metrics_ == nullptr) {
    raise(ErrorCategory::kIo, "cannot open {}: {} (errno {})", metrics_path_.string(), std::strerror(errno), errno);
  }
  terminal_ = out_ != nullptr && ::isatty(::fileno(out_)) == 1;
}

RunReport::~RunReport() {
  if (metrics_ != nullptr) std::fclose(metrics_);
}

namespace {
// A "Key:   N kB" line of /proc/self/status, in bytes; 0 where it cannot be read.
uint64_t status_kb_field(const char* key) {
  std::ifstream status("/proc/self/status");
  const size_t length = std::strlen(key);
  for (std::string line; std::getline(status, line);) {
    if (line.compare(0, length, key) == 0) return std::strtoull(line.c_str() + length, nullptr, 10) * 1024;
  }
  return 0;
}
}  // namespace

uint64_t peak_rss_nbytes() { return status_kb_field("VmHWM:"); }
uint64_t resident_nbytes() { return status_kb_field("VmRSS:"); }

RunRecord this_run_record() {
  RunRecord record;
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  for (std::string arg; std::getline(cmdline, arg, '\0');) record.argv.push_back(arg);
  std::error_code ec;
  record.cwd = std::filesystem::current_path(ec);
  if (const char* world = std::getenv("WORLD_SIZE")) {
    char* end = nullptr;
    const long long n = std::strtoll(world, &end, 10);
    if (end != world && *end == '\0' && n >= 1) record.world_size = n;
  }
  if (const uint64_t resident = resident_nbytes(); resident > 0) record.resident_at_start_nbytes = resident;
  return record;
}

std::string run_record_json(const RunRecord& record) {
  nlohmann::json j = {{"argv", record.argv}, {"cwd", record.cwd.string()}, {"world_size", record.world_size}};
  if (record.resident_at_start_nbytes) j["resident_bytes_at_start"] = *record.resident_at_start_nbytes;
  if (!record.ds_config.is_null()) j["ds_config"] = record.ds_config;
  if (!record.model_config.is_null()) j["model_config"] = record.model_config;
  if (!record.zero_sizes.is_null()) j["zero_sizes"] = record.zero_sizes;
  return j.dump(2) + "\n";
}

RunRecord configured_run_record(const nlohmann::json& effective, const nlohmann::json& model_config,
                                const engine::ZeroSizes& sizes) {
  RunRecord record;
  record.ds_config = effective;
  record.ds_config["zero_optimization"]["sub_group_size"] = sizes.sub_group_numel;
  record.ds_config["zero_optimization"]["reduce_bucket_size"] = sizes.reduce_bucket_numel;
  record.model_config = model_config;
  record.zero_sizes = sizes.to_json();
  return record;
}

RunRecord parse_run_record(const std::string& text, const std::string& source) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  STRATA_CHECK(!j.is_discarded() && j.is_object(), kBadArgument, "{}: not a JSON object (truncated or corrupt?)",
               source);
  const auto need = [&](const char* key, bool ok, const char* type) {
    STRATA_CHECK(j.contains(key) && ok, kBadArgument, "{}: \"{}\" is missing or not {}", source, key, type);
  };
  need("argv", j.contains("argv") && j["argv"].is_array(), "an array of strings");
  need("cwd", j.contains("cwd") && j["cwd"].is_string(), "a string");
  need("world_size", j.contains("world_size") && j["world_size"].is_number_integer() &&
                         j["world_size"].get<int64_t>() >= 1,
       "an integer >= 1");
  RunRecord record;
  for (const auto& arg : j["argv"]) {
    STRATA_CHECK(arg.is_string(), kBadArgument, "{}: \"argv\" holds {}, not a string", source, arg.dump());
    record.argv.push_back(arg.get<std::string>());
  }
  record.cwd = j["cwd"].get<std::string>();
  record.world_size = j["world_size"].get<int64_t>();
  if (j.contains("resident_bytes_at_start")) {
    STRATA_CHECK(j["resident_bytes_at_start"].is_number_unsigned(), kBadArgument,
                 "{}: \"resident_bytes_at_start\" is not a byte count", source);
    record.resident_at_start_nbytes = j["resident_bytes_at_start"].get<uint64_t>();
  }
  for (const char* key : {"ds_config", "model_config", "zero_sizes"}) {
    if (!j.contains(key)) continue;
    STRATA_CHECK(j[key].is_object(), kBadArgument, "{}: \"{}\" is not a JSON object", source, key);
  }
  if (j.contains("ds_config")) record.ds_config = j["ds_config"];
  if (j.contains("model_config")) record.model_config = j["model_config"];
  if (j.contains("zero_sizes")) record.zero_sizes = j["zero_sizes"];
  return record;
}

void RunReport::record(const StepRecord& r) {
  steps_.push_back(r);
  elapsed_ += r.seconds;
  nlohmann::json line = {{"step", r.step},
                         {"loss", finite_or_null(r.loss)},
                         {"lr", r.lr},
                         {"grad_norm", finite_or_null(r.grad_norm)},
                         {"applied", r.applied},
                         {"loss_scale", r.loss_scale},
                         {"tokens", r.tokens},
                         {"tokens_per_s", r.tokens_per_second()},
                         {"nvme_bytes", r.nvme_bytes},
                         {"step_s", r.seconds},
                         {"breakdown_s", {{"forward_backward", r.forward_backward_seconds},
                                          {"optimizer", r.optimizer_seconds},
                                          {"optimizer_hidden", r.optimizer_hidden_seconds}}},
                         {"optimizer_not_hidden_fraction", r.optimizer_not_hidden_fraction},
                         {"optimizer_overlap", r.optimizer_overlap.empty() ? nlohmann::json() : nlohmann::json(r.optimizer_overlap)},
                         {"optimizer_rolled_back", r.optimizer_rolled_back},
                         {"optimizer_overlaps_forward", r.optimizer_overlaps_forward},
                         {"memory", {{"device_peak_bytes", r.device_peak_nbytes},
                                     {"host_peak_rss_bytes", r.host_peak_rss_nbytes}}}};
  if (r.eval_loss) line["eval_loss"] = finite_or_null(*r.eval_loss);
  if (r.aux_loss) line["aux_loss"] = finite_or_null(*r.aux_loss);
  if (r.router_imbalance) line["router_imbalance"] = finite_or_null(*r.router_imbalance);
  if (r.pipeline_idle_fraction) line["pipeline_idle_fraction"] = finite_or_null(*r.pipeline_idle_fraction);
  if (r.activation_nbytes) line["memory"]["activation_bytes"] = *r.activation_nbytes;
  const std::string text = line.dump() + "\n";
  STRATA_CHECK(std::fwrite(text.data(), 1, text.size(), metrics_) == text.size() && std::fflush(metrics_) == 0, kIo,
               "cannot write {}: {}", metrics_path_.string(), std::strerror(errno));
  print_progress(r);
}

void RunReport::print_progress(const StepRecord& r) {
  if (out_ == nullptr) return;
  const double per_step = elapsed_ / static_cast<double>(steps_.size());
  const double eta = per_step * static_cast<double>(std::max<int64_t>(0, total_steps_ - r.step));
  const std::string stats =
      fmt::format("step {}/{}  loss {:.4f}{}{}{}  lr {:.2e}  |g| {:.3g}  {:.0f} tok/s  {:.2f} s/step{}  ETA {}{}", r.step,
                  total_steps_, r.loss, r.aux_loss ? fmt::format("  aux {:.4f}", *r.aux_loss) : std::string(),
                  r.router_imbalance ? fmt::format("  experts max/mean {:.2f}", *r.router_imbalance) : std::string(),
                  r.eval_loss ? fmt::format("  eval {:.4f}", *r.eval_loss) : std::string(),
                  r.lr, r.grad_norm, r.tokens_per_second(), r.seconds,
                  r.nvme_bytes > 0 && r.seconds > 0
                      ? fmt::format("  NVMe {:.2f} GB/s", static_cast<double>(r.nvme_bytes) / r.seconds / 1e9)
                      : std::string(),
                  duration(eta), r.applied ? "" : "  (skipped: gradient not finite)");
  if (terminal_) {
    constexpr int kWidth = 24;
    const int filled = total_steps_ > 0 ? static_cast<int>(kWidth * r.step / total_steps_) : kWidth;
    fmt::print(out_, "\r[{}{}] {}\x1b[K", std::string(static_cast<size_t>(filled), '#'),
               std::string(static_cast<size_t>(kWidth - filled), '.'), stats);
  } else {
    const bool due = r.step % print_every_ == 0 || r.step == total_steps_ || steps_.size() == 1 || !r.applied ||
                     r.eval_loss.has_value();
    if (!due) return;
    fmt::print(out_, "{}\n", stats);
  }
  std::fflush(out_);
}

void RunReport::finish() {
  if (terminal_ && out_ != nullptr) fmt::print(out_, "\n");
  {
    write_file_durably(curve_path_, loss_curve_svg(steps_));
  }
  if (out_ == nullptr || steps_.empty()) return;
  // Summary: first and last losses (means of up to 5 steps), throughput median.
  const size_t n = steps_.size(), k = std::min<size_t>(5, n);
  double first = 0, last = 0;
  for (size_t i = 0; i < k; ++i) first += steps_[i].loss / static_cast<double>(k);
  for (size_t i = n - k; i < n; ++i) last += steps_[i].loss / static_cast<double>(k);
  std::vector<double> rates;
  int64_t skipped = 0, tokens = 0;
  for (const auto& s : steps_) {
    rates.push_back(s.tokens_per_second());
    skipped += !s.applied;
    tokens += s.tokens;
  }
  std::nth_element(rates.begin(), rates.begin() + static_cast<std::ptrdiff_t>(n / 2), rates.end());
  fmt::print(out_,
             "\n  steps            {} ({} skipped)\n"
             "  loss             {:.4f} (mean of the first {}) -> {:.4f} (mean of the last {})\n"
             "  tokens           {}\n"
             "  throughput       {:.0f} tokens/s (median step)\n"
             "  wall time        {}\n"
             "  peak memory      {:.2f} GiB accelerator, {:.2f} GiB host resident (rank 0)\n"
             "{}"
             "  metrics          {}\n"
             "  loss curve       {}\n",
             n, skipped, first, k, last, k, tokens, rates[n / 2], duration(elapsed_),
             static_cast<double>(steps_.back().device_peak_nbytes) / (1ull << 30),
             static_cast<double>(steps_.back().host_peak_rss_nbytes) / (1ull << 30),
             [&] {
               const StepRecord* best = nullptr;
               const StepRecord* latest = nullptr;
               for (const auto& s : steps_) {
                 if (!s.eval_loss) continue;
                 latest = &s;
                 if (best == nullptr || *s.eval_loss < *best->eval_loss) best = &s;
               }
               return latest == nullptr ? std::string()
                                        : fmt::format("  eval loss        {:.4f} (step {}); lowest {:.4f} (step {})\n",
                                                      *latest->eval_loss, latest->step, *best->eval_loss, best->step);
             }(),
             metrics_path_.string(),
             curve_path_.string());
  std::fflush(out_);
}

std::string loss_curve_svg(const std::vector<StepRecord>& steps) {
  constexpr double kW = 640, kH = 360, kLeft = 60, kRight = 20, kTop = 20, kBottom = 40;
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& s : steps) {
    for (double v : {s.loss, s.eval_loss.value_or(NAN)}) {
      if (!std::isfinite(v)) continue;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (!(lo <= hi)) lo = 0, hi = 1;
  if (hi - lo < 1e-12) hi = lo + 1;
  const double max_step = steps.empty() ? 1.0 : static_cast<double>(std::max<int64_t>(1, steps.back().step));
  auto x = [&](double step) { return kLeft + (kW - kLeft - kRight) * (step / max_step); };
  auto y = [&](double loss) { return kTop + (kH - kTop - kBottom) * (1 - (loss - lo) / (hi - lo)); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<line x1=\"{2}\" y1=\"{3}\" x2=\"{2}\" y2=\"{4}\" stroke=\"black\"/>\n"
      "<line x1=\"{2}\" y1=\"{4}\" x2=\"{5}\" y2=\"{4}\" stroke=\"black\"/>\n"
      "<text x=\"{2}\" y=\"{6}\" font-family=\"sans-serif\" font-size=\"12\">step</text>\n"
      "<text x=\"4\" y=\"{7:.1f}\" font-family=\"sans-serif\" font-size=\"12\">{8:.3f}</text>\n"
      "<text x=\"4\" y=\"{9:.1f}\" font-family=\"sans-serif\" font-size=\"12\">{10:.3f}</text>\n"
      "<text x=\"{5}\" y=\"{6}\" font-family=\"sans-serif\" font-size=\"12\" text-anchor=\"end\">{11}</text>\n",
      kW, kH, kLeft, kTop, kH - kBottom, kW - kRight, kH - 12, y(hi) + 4, hi, y(lo) + 4, lo,
      static_cast<int64_t>(max_step));
  std::string points;
  for (const auto& s : steps) {
    if (!std::isfinite(s.loss)) continue;
    points += fmt::format("{:.1f},{:.1f} ", x(static_cast<double>(s.step)), y(s.loss));
  }
  svg += fmt::format("<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n", points);
  // Evaluation losses: a second line with a dot per evaluation.
  std::string eval_points, eval_dots;
  for (const auto& s : steps) {
    if (!s.eval_loss || !std::isfinite(*s.eval_loss)) continue;
    const double ex = x(static_cast<double>(s.step)), ey = y(*s.eval_loss);
    eval_points += fmt::format("{:.1f},{:.1f} ", ex, ey);
    eval_dots += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"#ff7f0e\"><title>step {} eval loss "
                             "{:.4f}</title></circle>\n",
                             ex, ey, s.step, *s.eval_loss);
  }
  if (!eval_points.empty()) {
    svg += fmt::format("<polyline class=\"eval\" fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"1.5\" "
                       "points=\"{}\"/>\n{}",
                       eval_points, eval_dots);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-family=\"sans-serif\" font-size=\"12\" text-anchor=\"end\" "
                       "fill=\"#ff7f0e\">eval loss</text>\n",
                       kW - kRight, kTop + 12);
  }
  for (const auto& s : steps) {
    if (s.applied) continue;
    svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#d62728\"><title>step {} skipped</title></circle>\n",
                       x(static_cast<double>(s.step)), std::isfinite(s.loss) ? y(s.loss) : kTop, s.step);
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace strata::train
