// strata-train's pipeline mode (--pp N): the benchmark's model split into N
// stages (runtime/pipeline), one rank per process under `strata run -n N x dp`,
// trained through the PipelineExecutor on a resident engine (ZeRO off; dp 1)
// or, with --zero, a ZeroEngine over each stage's dp ranks. Per stage it
// prints the share of the step the stage computed nothing (idle: the bubble
// and the waits for transfers) against the schedule's formula and against
// the simulation of the schedule with the F, B and W times measured, the
// micro-batches in flight and their activation memory; per round tokens/s.
// Definitions: bench/strata-train/PERFORMANCE.md "Pipeline parallelism".
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "bench/strata-train/zero_bench.h"

namespace strata::bench::train {

struct PipelineFlags {
  int stages = 0;  // --pp: 0 is not the pipeline mode
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  int micro_batches = 0;  // per step; 0: 2 x --pp
};

// Adds --pp, --pp-schedule, --virtual-stages and --micro-batches to `app`.
void add_pipeline_flags(CLI::App& app, PipelineFlags& flags);

// Runs the pipeline benchmark on this rank (started by `strata run`); rank 0
// prints and writes --json. `zero`: its stage 0 for the resident engine.
// Returns the exit status; throws strata::Error for bad flags or a failed run.
int run_pipeline(const ModelRun& run, const PipelineFlags& flags, const ZeroFlags& zero);

}  // namespace strata::bench::train
