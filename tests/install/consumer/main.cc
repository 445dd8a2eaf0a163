// Uses installed strata headers and libraries: an accelerator, a stream, a copy.
#include <cstdio>
#include <vector>

#include "runtime/config/config.h"
#include "core/accelerator.h"
#include "core/dtype.h"

int main() {
  auto acc = strata::make_cpu_accelerator();
  auto stream = acc->create_stream();
  std::vector<float> src(1024, 1.5f), dst(1024, 0.0f);
  void* device = acc->allocate(src.size() * sizeof(float));
  acc->copy_async(device, src.data(), src.size() * 4, strata::CopyKind::kHostToDevice, *stream);
  acc->copy_async(dst.data(), device, src.size() * 4, strata::CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  acc->deallocate(device);
  const strata::Config config = strata::default_config();
  const bool ok = dst == src && strata::bf16_to_float(strata::float_to_bf16(1.5f)) == 1.5f &&
                  config.aio.block_size == 1048576;
  std::printf("consumer: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
