// BlockDevice: sysfs counters and queue limits of the device holding a file.
#include "nvme/block_stats.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace strata::nvme {
namespace {

constexpr uint64_t kSectorNbytes = 512;

std::optional<uint64_t> read_number(const std::filesystem::path& path) {
  std::ifstream in(path);
  uint64_t value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

}  // namespace

BlockCounters BlockCounters::operator-(const BlockCounters& earlier) const {
  return {reads - earlier.reads, read_sectors - earlier.read_sectors, writes - earlier.writes,
          write_sectors - earlier.write_sectors};
}

double BlockCounters::read_request_nbytes() const {
  return reads == 0
             ? 0.0
             : static_cast<double>(read_sectors * kSectorNbytes) / static_cast<double>(reads);
}

double BlockCounters::write_request_nbytes() const {
  return writes == 0
             ? 0.0
             : static_cast<double>(write_sectors * kSectorNbytes) / static_cast<double>(writes);
}

std::optional<BlockDevice> BlockDevice::of(const std::string& path, std::string* why) {
  auto fail = [&](std::string reason) -> std::optional<BlockDevice> {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return fail(fmt::format("stat {}: {}", path, std::strerror(errno)));
  const unsigned major_id = major(st.st_dev), minor_id = minor(st.st_dev);
  const std::string id = fmt::format("{}:{}", major_id, minor_id);
  if (major_id == 0) {
    return fail(fmt::format("{} is on a file system without a block device (device {})", path, id));
  }
  std::error_code ec;
  const std::filesystem::path link = "/sys/dev/block/" + id;
  const std::filesystem::path dir = std::filesystem::canonical(link, ec);
  if (ec) return fail(fmt::format("{} (the device of {}): {}", link.string(), path, ec.message()));
  BlockDevice device;
  device.name_ = dir.filename().string();
  device.stat_path_ = (dir / "stat").string();
  if (!std::ifstream(device.stat_path_)) {
    return fail(fmt::format("{} is not readable", device.stat_path_));
  }
  // A partition has no queue/ of its own: its disk's limits apply.
  std::filesystem::path queue = dir / "queue";
  if (!std::filesystem::exists(queue, ec)) queue = dir.parent_path() / "queue";
  device.max_request_nbytes_ = read_number(queue / "max_sectors_kb").value_or(0) * 1024;
  device.max_segments_ = read_number(queue / "max_segments").value_or(0);
  try {
    device.counters();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return device;
}

BlockCounters BlockDevice::counters() const {
  std::ifstream in(stat_path_);
  std::string line;
  STRATA_CHECK(in && std::getline(in, line), kIo, "cannot read {}", stat_path_);
  // Fields: reads, reads merged, sectors read, ms reading, writes, writes
  // merged, sectors written, ... (Documentation/block/stat.rst).
  std::istringstream fields(line);
  uint64_t v[7] = {};
  for (uint64_t& x : v) {
    STRATA_CHECK(static_cast<bool>(fields >> x), kIo, "unexpected contents of {}: '{}'", stat_path_,
                 line);
  }
  return {v[0], v[2], v[4], v[6]};
}

}  // namespace strata::nvme
