// DeepSpeedAdam: the Python coprocess behind strata-adam --vs-deepspeed
// (bench/common/python_coprocess.h: JSON lines over pipes).
#include "bench/strata-adam/deepspeed_adam.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "bench/strata-adam/deepspeed_adam_script.h"  // kDeepSpeedAdamScript (generated)
#include "core/error.h"

namespace strata::bench {

// DeepSpeed's op and torch's copies use OpenMP: give them strata's thread
// count. The first setup may compile the op (about 4 minutes on 2 busy cores).
DeepSpeedAdam::DeepSpeedAdam(std::string python, int threads)
    : threads_(threads),
      child_(PythonCoprocessOptions{std::move(python), kDeepSpeedAdamScript, "@@strata-adam@@ ",
                                    "DeepSpeed's cpu_adam", {fmt::format("OMP_NUM_THREADS={}", threads)},
                                    20 * 60 * 1000, 20 * 60 * 1000}) {}

void DeepSpeedAdam::setup(size_t numel, float lr, float weight_decay, bool adamw) {
  nlohmann::json req = {{"setup",
                         {{"numel", numel},
                          {"threads", threads_},
                          {"lr", lr},
                          {"weight_decay", weight_decay},
                          {"adamw", adamw}}}};
  nlohmann::json reply = nlohmann::json::parse(child_.request(req.dump()));
  STRATA_CHECK(!reply.contains("error"), kIo, "DeepSpeed setup of {} parameters: {}", numel,
               reply.value("error", ""));
}

DeepSpeedPass DeepSpeedAdam::pass() {
  nlohmann::json reply = nlohmann::json::parse(child_.request(R"({"pass": true})"));
  STRATA_CHECK(!reply.contains("error"), kIo, "DeepSpeed pass: {}", reply.value("error", ""));
  DeepSpeedPass r;
  r.step_seconds = reply.value("step", 0.0);
  r.copy_seconds = reply.value("copy", 0.0);
  r.correct = reply.value("check", false);
  STRATA_CHECK(r.step_seconds > 0, kIo, "DeepSpeed coprocess sent no time: {}", reply.dump());
  return r;
}

}  // namespace strata::bench
