// What `strata plan` can learn about this machine without measuring it: the
// GPUs the CUDA backend sees (the probe `strata doctor` uses), host memory from
// /proc/meminfo, and the free space of a directory meant for swap files.
// Bandwidths are not probed: they come from the bench tools (strata-bw,
// strata-io, strata-adam) through flags, or the plan's stated defaults.
// Thread-safety: free functions, no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace strata::plan {

struct DetectedMachine {
  int64_t gpu_count = 0;
  std::optional<uint64_t> gpu_nbytes;             // the smallest device's total memory
  std::string gpu_name;                           // device 0's
  std::string gpu_detail;                         // why no GPU was found, when none was
  std::optional<uint64_t> host_total_nbytes;      // MemTotal
  std::optional<uint64_t> host_available_nbytes;  // MemAvailable
};

// Never throws for a missing probe: an absent field means "not found".
DetectedMachine detect_machine();

// Bytes an unprivileged process may still write under `dir`.
// Throws Error(kIo) naming `dir` when it cannot be examined (missing, not a directory).
uint64_t free_space_nbytes(const std::string& dir);

}  // namespace strata::plan
