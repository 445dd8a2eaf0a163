// Machine probes for `strata plan`: CUDA devices, /proc/meminfo, statvfs.
#include "runtime/plan/machine_probe.h"

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>

#include "core/accelerator.h"
#include "core/error.h"

namespace strata::plan {
namespace {

// One "Key:   value kB" line of /proc/meminfo, in bytes.
std::optional<uint64_t> meminfo_nbytes(const std::string& wanted) {
  std::ifstream file("/proc/meminfo");
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream fields(line);
    std::string key, unit;
    uint64_t value = 0;
    if (!(fields >> key >> value) || key != wanted + ":") continue;
    fields >> unit;
    return unit == "kB" ? value * 1024 : value;
  }
  return std::nullopt;
}

}  // namespace

DetectedMachine detect_machine() {
  DetectedMachine out;
  const CudaInfo cuda = cuda_info();
  out.gpu_count = static_cast<int64_t>(cuda.devices.size());
  for (const CudaDeviceInfo& device : cuda.devices) {
    const uint64_t nbytes = device.total_nbytes;
    out.gpu_nbytes = out.gpu_nbytes ? std::min(*out.gpu_nbytes, nbytes) : nbytes;
  }
  if (!cuda.devices.empty()) {
    out.gpu_name = cuda.devices.front().name;
  } else {
    out.gpu_detail = !cuda.built           ? "CUDA backend not built"
                     : !cuda.error.empty() ? cuda.error
                                           : "no CUDA device";
  }
  out.host_total_nbytes = meminfo_nbytes("MemTotal");
  out.host_available_nbytes = meminfo_nbytes("MemAvailable");
  return out;
}

uint64_t free_space_nbytes(const std::string& dir) {
  struct stat info {};
  if (stat(dir.c_str(), &info) != 0) raise_errno(errno, "NVMe path " + dir);
  STRATA_CHECK(S_ISDIR(info.st_mode), kIo, "NVMe path {}: not a directory", dir);
  struct statvfs fs {};
  if (statvfs(dir.c_str(), &fs) != 0) raise_errno(errno, "statvfs " + dir);
  return static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
}

}  // namespace strata::plan
