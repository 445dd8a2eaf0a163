// strata-io --vs-deepspeed: DeepSpeed's aio_handle (DeepNVMe) timed on the same
// file through a Python coprocess running deepspeed_aio.py (embedded at build
// time), so strata and DeepSpeed passes alternate. strata never needs Python to
// build or run; without an importable deepspeed the anchor says why and is skipped.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "bench/common/python_coprocess.h"
#include "bench/strata-io/io_bench.h"

namespace strata::bench {

// Not thread-safe; owns the child process (ended in the destructor).
class DeepSpeedAio {
 public:
  // Starts `python` (a name looked up in PATH, or a path) with the embedded
  // script and waits for it to import torch and deepspeed and load the aio op
  // (a first load may compile it: minutes). Never throws: available() is
  // false and why() says what failed (interpreter missing, import error with
  // the interpreter's own path, op not buildable).
  explicit DeepSpeedAio(std::string python);

  bool available() const { return child_.available(); }
  const std::string& why() const { return child_.why(); }
  // "deepspeed 0.19.8, torch 2.x, /path/to/python" once available.
  const std::string& versions() const { return child_.versions(); }

  // One timed sequential pass over [0, size) of `path` with an aio_handle of
  // the case's block size, queue depth and thread count (intra_op_parallelism),
  // reading into / writing from one DeepSpeed-locked buffer of buffer_nbytes;
  // `warmup` untimed passes first. Returns GB/s. Throws Error(kIo) with
  // DeepSpeed's message when the pass fails or the child dies.
  double pass(const IoCase& c, const std::string& path, uint64_t size, bool overlap_events,
              uint64_t buffer_nbytes, int warmup);

 private:
  PythonCoprocess child_;
};

}  // namespace strata::bench
