// strata-adam internals: the in-memory kernel benchmark (with the triad anchor)
// and the NVMe-offloaded step benchmark, each returning rows for the table and JSON.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "kernels/optimizer.h"
#include "nvme/io_options.h"

namespace strata::bench {

struct KernelRow {
  std::string isa, grad_dtype, copy_dtype;  // copy "none" when no 16-bit copy
  size_t numel = 0;
  int threads = 0;
  double seconds = 0;        // median of the timed iterations
  double params_per_s = 0;   // numel / seconds
  double bytes = 0;          // bytes counted per step (see PERFORMANCE.md)
  double gb_per_s = 0;       // bytes / seconds / 1e9
  double triad_gb_per_s = 0; // same run's triad
  double ratio = 0;          // gb_per_s / triad_gb_per_s
  bool correct = false;      // sampled elements match the scalar reference
  std::string check_detail;
};

struct TriadResult {
  size_t numel = 0;
  double seconds = 0, gb_per_s = 0;
  bool correct = false;
};

// a[i] = b[i] + s*c[i] over three fp32 arrays of numel, OpenMP with `threads`;
// median of iters. Bytes counted: 3 * 4 * numel (STREAM's convention).
TriadResult run_triad(size_t numel, int threads, int iters);

struct KernelCase {
  kernels::CpuIsa isa;
  DType grad_dtype;
  std::optional<DType> copy_dtype;
};
// Allocates the optimizer arrays once per grad dtype and times every case.
std::vector<KernelRow> run_kernel_cases(const std::vector<KernelCase>& cases, size_t numel,
                                        int threads, int iters, bool adamw, double triad_gb_per_s);

struct NvmeStepOptions {
  std::string dir;
  size_t numel = 0;
  size_t sub_group_numel = 0;
  size_t buffer_count = 3;
  DType grad_dtype = DType::kBF16;
  DType copy_dtype = DType::kBF16;
  int steps = 1;
  int threads = 0;
  nvme::AioOptions aio;
};

struct NvmeStepResult {
  size_t numel = 0, sub_group_numel = 0, sub_groups = 0, buffer_count = 0;
  double init_seconds = 0;
  double step_seconds = 0;         // median full step (read ‖ update ‖ write + commit)
  double read_alone_seconds = 0;   // every record read, nothing else running
  double write_alone_seconds = 0;  // every record written, nothing else running
  double update_alone_seconds = 0; // every sub-group updated in memory, no I/O
  double lower_bound_seconds = 0;  // max of the three
  double ratio = 0;                // step / lower bound
  double read_write_alone_seconds = 0;  // reads and writes issued together, no update
  double duplex_bound_seconds = 0;      // max(read_write_alone, update_alone)
  double duplex_ratio = 0;              // step / duplex bound
  double read_gb_per_s = 0, write_gb_per_s = 0;
  double bytes_read = 0, bytes_written = 0;
  double step_update_seconds = 0, step_read_wait_seconds = 0, step_write_wait_seconds = 0,
         step_commit_seconds = 0;
  bool correct = false;
  std::string check_detail;
};
NvmeStepResult run_nvme_step(const NvmeStepOptions& options);

// Bytes a step moves per element: read p, m, v (12) and g; write p, m, v (12) and the copy.
double adam_bytes_per_element(DType grad_dtype, std::optional<DType> copy_dtype);

}  // namespace strata::bench
