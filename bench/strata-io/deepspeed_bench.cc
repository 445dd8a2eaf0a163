// DeepSpeedAio: the Python coprocess behind strata-io --vs-deepspeed
// (bench/common/python_coprocess.h: JSON lines over pipes).
#include "bench/strata-io/deepspeed_bench.h"

#include <nlohmann/json.hpp>

#include "bench/strata-io/deepspeed_aio_script.h"  // kDeepSpeedAioScript (generated)
#include "core/error.h"

namespace strata::bench {

// The first start may compile DeepSpeed's op; a pass of a few GiB takes seconds.
DeepSpeedAio::DeepSpeedAio(std::string python)
    : child_(PythonCoprocessOptions{std::move(python), kDeepSpeedAioScript, "@@strata-io@@ ", "DeepSpeed's aio", {},
                                    15 * 60 * 1000, 15 * 60 * 1000}) {}

double DeepSpeedAio::pass(const IoCase& c, const std::string& path, uint64_t size,
                          bool overlap_events, uint64_t buffer_nbytes, int warmup) {
  nlohmann::json req = {{"path", path},
                        {"rw", c.rw == nvme::IoOp::kRead ? "read" : "write"},
                        {"size", size},
                        {"bs", c.bs},
                        {"qd", c.qd},
                        {"threads", c.threads},
                        {"overlap_events", overlap_events},
                        {"buffer_nbytes", buffer_nbytes},
                        {"warmup", warmup}};
  nlohmann::json reply = nlohmann::json::parse(child_.request(req.dump()));
  STRATA_CHECK(!reply.contains("error"), kIo, "DeepSpeed aio_handle {} of {}: {}",
               req["rw"].get<std::string>(), path, reply.value("error", ""));
  const double gbps = reply.value("gbps", 0.0);
  STRATA_CHECK(gbps > 0, kIo, "DeepSpeed coprocess sent no bandwidth: {}", reply.dump());
  return gbps;
}

}  // namespace strata::bench
