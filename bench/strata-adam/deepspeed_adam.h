// strata-adam --vs-deepspeed: DeepSpeed's own CPU-side optimizer work
// (DeepSpeedCPUAdam.step() over its fp32 gradient buffer, then the separate
// bf16 copy) timed through a Python coprocess running deepspeed_adam.py
// (embedded at build time), so strata and DeepSpeed passes alternate. strata
// never needs Python to build or run; without an importable deepspeed the row
// says why and is skipped.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "bench/common/python_coprocess.h"

namespace strata::bench {

struct DeepSpeedPass {
  double step_seconds = 0, copy_seconds = 0;
  bool correct = false;  // its copy is the bf16 rounding of its master (sampled)
};

// Not thread-safe; owns the child process (ended in the destructor).
class DeepSpeedAdam {
 public:
  // Starts `python` (a name looked up in PATH, or a path) with the embedded
  // script, OMP_NUM_THREADS=threads, and waits for it to import torch and
  // deepspeed. Never throws: available() is false and why() says what failed.
  DeepSpeedAdam(std::string python, int threads);

  bool available() const { return child_.available(); }
  const std::string& why() const { return child_.why(); }
  // "deepspeed 0.19.8, torch 2.x, /path/to/python" once available.
  const std::string& versions() const { return child_.versions(); }

  // Allocates numel parameters, fp32 moments and gradient buffer and a bf16
  // copy, builds (first time: minutes) and loads the op, and runs one untimed
  // step and copy. Throws Error(kIo) with DeepSpeed's message.
  void setup(size_t numel, float lr, float weight_decay, bool adamw);
  // One timed pass. Throws Error(kIo) when it fails or the child dies.
  DeepSpeedPass pass();

 private:
  int threads_ = 0;
  PythonCoprocess child_;
};

}  // namespace strata::bench
