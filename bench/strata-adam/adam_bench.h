// strata-adam internals: the in-memory kernel benchmark (each row beside its
// own Adam-shaped triad), the per-parameter CPU-side path beside DeepSpeed's
// way of doing it, and the NVMe-offloaded step benchmark, each returning rows
// for the table and JSON. What every number counts: PERFORMANCE.md.
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
  bool default_isa = false;  // the row asked for no ISA (isa is what default_isa() chose)
  size_t numel = 0;
  int threads = 0;
  double seconds = 0;        // median of the timed iterations
  double params_per_s = 0;   // numel / seconds
  double bytes = 0;          // bytes counted per step (see PERFORMANCE.md)
  double gb_per_s = 0;       // bytes / seconds / 1e9
  double triad_seconds = 0;  // median of the row's Adam-shaped triad passes
  double triad_gb_per_s = 0; // bytes / triad_seconds / 1e9 (same bytes as the row)
  double ratio = 0;          // median over the pairs of triad time / Adam time
  bool correct = false;      // sampled elements match the scalar reference, triad kept the state
  std::string check_detail;
};

struct TriadResult {
  size_t numel = 0;
  double seconds = 0, gb_per_s = 0;
  bool correct = false;
};

// STREAM's a[i] = b[i] + s*c[i] over three fp32 arrays of numel, OpenMP with
// `threads`; median of iters. Bytes counted: 3 * 4 * numel (STREAM's
// convention). A reference printed in the header, not the rows' anchor.
TriadResult run_stream_triad(size_t numel, int threads, int iters);

struct KernelCase {
  std::optional<kernels::CpuIsa> isa;  // nullopt: the default (calibrated) ISA
  DType grad_dtype;
  std::optional<DType> copy_dtype;
};
// Allocates the optimizer arrays once and times every case, alternating each
// Adam step with an Adam-shaped triad pass over the same arrays.
std::vector<KernelRow> run_kernel_cases(const std::vector<KernelCase>& cases, size_t numel,
                                        int threads, int iters, bool adamw);

// One way of doing the per-parameter CPU-side work of a ZeRO-3 offloaded step.
struct PathRow {
  std::string name;          // "strata", "deepspeed-way", "deepspeed"
  std::string isa;           // the Adam kernel's ISA ("" for DeepSpeed's own op)
  size_t numel = 0;
  double seconds = 0;        // median of the whole path
  double land_seconds = 0, adam_seconds = 0, copy_seconds = 0;  // medians of the parts
  double params_per_s = 0;
  double bytes = 0;          // bytes counted per pass (PERFORMANCE.md)
  // Medians over the rounds of deepspeed-way (resp. deepspeed) time / this row's time; 0 without.
  double ratio_to_deepspeed_way = 0;
  double ratio_to_deepspeed = 0;
  bool correct = false;
  std::string check_detail;
};

struct PathResult {
  std::vector<PathRow> rows;
  std::string deepspeed_versions;  // "deepspeed 0.19.8, torch ..., python" when it ran
  std::string deepspeed_skipped;   // why the real DeepSpeed row is absent ("" when present)
};

// The path with bf16 gradients and a bf16 copy, --iters passes of each way in
// alternation: strata's (land the 16-bit gradient, one fused Adam + copy),
// DeepSpeed's written by us (land into an fp32 buffer, Adam, a separate copy),
// and, when `python` is non-empty, DeepSpeed's own (its cpu_adam + torch copies
// in a coprocess, same numel and threads).
PathResult run_path(size_t numel, int threads, int iters, bool adamw, const std::string& python);

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

// The optimizer on the accelerator (offload_optimizer.device none):
// Ops::adam_step with an fp32 gradient and a bf16 copy over numel parameters
// in accelerator memory, alternated with a device-to-device copy of one fp32
// array (the anchor: 8 bytes moved per element); ratio = the median over the
// pairs of the time Adam's bytes take at the copy's bandwidth / Adam's time.
// correct: step 1 equals kernels::adam_step on the same inputs bit for bit.
struct DeviceStepResult {
  std::string accelerator;  // Accelerator::name()
  size_t numel = 0;
  double seconds = 0, params_per_s = 0, bytes = 0, gb_per_s = 0;
  double copy_seconds = 0, copy_gb_per_s = 0;
  double ratio = 0;
  bool correct = false;
  std::string check_detail;
};
// accelerator_kind: "cpu", "cuda" or "auto" (make_accelerator).
DeviceStepResult run_device_step(const std::string& accelerator_kind, size_t numel, int iters, bool adamw);

// Bytes a step moves per element: read p, m, v (12) and g; write p, m, v (12) and the copy.
double adam_bytes_per_element(DType grad_dtype, std::optional<DType> copy_dtype);

}  // namespace strata::bench
