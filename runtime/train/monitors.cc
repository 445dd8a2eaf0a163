// CsvMonitor: one CSV file per value, flushed each line.
#include "runtime/train/monitors.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include <unistd.h>

#include <array>
#include <chrono>

#include "core/error.h"
#ifdef STRATA_HAVE_PROTOBUF
#include "event.pb.h"
#endif

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
    // Appended to, as DeepSpeed's csvMonitor does (a resumed run continues the file).
    std::error_code ec;
    const bool fresh = !std::filesystem::exists(path, ec) || std::filesystem::file_size(path, ec) == 0;
    std::FILE* f = std::fopen(path.c_str(), "a");
    if (f == nullptr) raise_errno(errno, "csv_monitor: open " + path.string());
    if (fresh) fmt::print(f, "step,{}\n", name);
    it = files_.emplace(name, f).first;
  }
  fmt::print(it->second, "{},{}\n", step, value);
  STRATA_CHECK(std::fflush(it->second) == 0, kIo, "csv_monitor: cannot write {}/{}: {}", dir_.string(), name,
               std::strerror(errno));
}

namespace {

// CRC-32C (Castagnoli, reflected 0x82F63B78) and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

bool tensorboard_available() {
#ifdef STRATA_HAVE_PROTOBUF
  return true;
#else
  return false;
#endif
}

TensorBoardMonitor::TensorBoardMonitor(std::filesystem::path dir) {
  STRATA_CHECK(tensorboard_available(), kBadArgument,
               "tensorboard.enabled: this strata was built without protobuf (Debian: libprotobuf-dev "
               "protobuf-compiler, then rebuild); use csv_monitor");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) raise(ErrorCategory::kIo, "tensorboard: cannot create {}: {}", dir.string(), ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  path_ = dir / fmt::format("events.out.tfevents.{}.{}", static_cast<int64_t>(wall_time()), host);
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) raise_errno(errno, "tensorboard: create " + path_.string());
#ifdef STRATA_HAVE_PROTOBUF
  tensorboard::Event event;
  event.set_wall_time(wall_time());
  event.set_file_version("brain.Event:2");
  append(event.SerializeAsString());
#endif
}

TensorBoardMonitor::~TensorBoardMonitor() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardMonitor::write(const std::string& name, int64_t step, double value) {
#ifdef STRATA_HAVE_PROTOBUF
  tensorboard::Event event;
  event.set_wall_time(wall_time());
  event.set_step(step);
  tensorboard::SummaryValue* v = event.mutable_summary()->add_value();
  v->set_tag(name);
  v->set_simple_value(static_cast<float>(value));
  append(event.SerializeAsString());
#else
  (void)name, (void)step, (void)value;
#endif
}

void TensorBoardMonitor::append(const std::string& event) {
  // TFRecord: u64 length, u32 masked CRC of the length, the bytes, u32 masked CRC of the bytes (little-endian).
  const uint64_t length = event.size();
  unsigned char header[12];
  for (int i = 0; i < 8; ++i) header[i] = static_cast<unsigned char>(length >> (8 * i));
  const uint32_t length_crc = masked_crc(header, 8), data_crc = masked_crc(event.data(), event.size());
  for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<unsigned char>(length_crc >> (8 * i));
  unsigned char footer[4];
  for (int i = 0; i < 4; ++i) footer[i] = static_cast<unsigned char>(data_crc >> (8 * i));
  const bool ok = std::fwrite(header, 1, 12, file_) == 12 &&
                  std::fwrite(event.data(), 1, event.size(), file_) == event.size() &&
                  std::fwrite(footer, 1, 4, file_) == 4 && std::fflush(file_) == 0;
  STRATA_CHECK(ok, kIo, "tensorboard: cannot write {}: {}", path_.string(), std::strerror(errno));
}

}  // namespace strata::train
