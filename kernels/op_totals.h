// Per-op totals of a traced run: the table a person would otherwise build from
// the trace by hand (time per op kind, its share, its arithmetic rate or
// bandwidth). Backends that time their ops while a trace is recorded (the cpu
// backend: each op's task on its stream thread) add each op here; the cuda
// backend does not time ops yet, so a cuda run's table is empty.
//
// Thread-safety: every function may be called from any thread (one mutex;
// add_op_total runs only while recording).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::ops {

struct OpTotal {
  std::string name;    // the op ("linear_backward")
  int64_t calls = 0;
  double seconds = 0;  // summed run time of its calls
  double flops = 0;    // summed arithmetic (0 for ops measured in bytes)
  double bytes = 0;    // summed bytes of ops without arithmetic
};

// Adds one op's run of `ns` nanoseconds. `bytes` ~0: not given.
void add_op_total(const char* name, int64_t ns, int64_t flops, uint64_t bytes);
// The totals since the last reset, the longest first.
std::vector<OpTotal> op_totals();
void reset_op_totals();
// One line per op kind: calls, seconds, share of all op time, GFLOP/s (or
// GB/s for ops without arithmetic); "" when there are none. `indent` starts
// each line.
std::string op_totals_table(const std::vector<OpTotal>& totals, const std::string& indent = "  ");

}  // namespace strata::ops
