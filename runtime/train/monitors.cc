// CsvMonitor: one CSV file per value, flushed each line.
#include "runtime/train/monitors.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace strata::train {

std::filesystem::path monitor_dir(const MonitorConfig& monitor, const std::filesystem::path& fallback) {
  const std::filesystem::path root = monitor.output_path.empty() ? fallback : std::filesystem::path(monitor.output_path);
  return root / monitor.job_name;
}

CsvMonitor::CsvMonitor(std::filesystem::path dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) raise(ErrorCategory::kIo, "csv_monitor: cannot create {}: {}", dir_.string(), ec.message());
}

CsvMonitor::~CsvMonitor() {
  for (auto& [name, file] : files_) std::fclose(file);
}

void CsvMonitor::write(const std::string& name, int64_t step, double value) {
  auto it = files_.find(name);
  if (it == files_.end()) {
    std::string file_name = name;
    for (char& c : file_name) c = c == '/' ? '_' : c;
    const std::filesystem::path path = dir_ / (file_name + ".csv");
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) raise_errno(errno, "csv_monitor: create " + path.string());
    fmt::print(f, "step,{}\n", name);
    it = files_.emplace(name, f).first;
  }
  fmt::print(it->second, "{},{}\n", step, value);
  STRATA_CHECK(std::fflush(it->second) == 0, kIo, "csv_monitor: cannot write {}/{}: {}", dir_.string(), name,
               std::strerror(errno));
}

}  // namespace strata::train
