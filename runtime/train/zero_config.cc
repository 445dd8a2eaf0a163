// The ZeroEngine's communicators (see zero_config.h).
#include "runtime/train/zero_config.h"

#include "core/error.h"

namespace strata::train {

ZeroCommunicators make_zero_communicators(Accelerator& accelerator, partition::StoreClient& store, int rank,
                                          int world_size, std::chrono::milliseconds timeout, const std::string& prefix) {
  auto make = [&](const char* traffic) {
    partition::CommunicatorOptions o;
    o.rank = rank;
    o.world_size = world_size;
    o.timeout = timeout;
    o.prefix = prefix + "/" + traffic;
    return partition::make_communicator(accelerator, store, o);
  };
  ZeroCommunicators c;
  c.gather = make("gather");
  c.reduce = make("reduce");
  c.control = make("control");
  return c;
}

}  // namespace strata::train
