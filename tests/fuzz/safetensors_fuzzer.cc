// libFuzzer harness: the safetensors reader. Any file must open or fail with
// strata::Error(kBadArgument) and a bounded message; an opened file's every
// tensor must be readable within the mapping (converted to fp32, so each
// element is touched) with consistent shapes and offsets.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "runtime/nn/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const fuzz::MemoryFile file(data, size);
  try {
    const nn::SafetensorsFile st = nn::SafetensorsFile::open(file.path());
    for (const std::string& name : st.names()) {
      const nn::SafetensorsEntry& e = st.entry(name);
      const int64_t numel = shape_numel(e.shape);
      if (numel < 0 || e.end - e.begin != static_cast<size_t>(numel) * dtype_nbytes(e.dtype) ||
          e.end > size) {
        fuzz::fail("entry inconsistent with its shape or the file", name);
      }
      Tensor out = Tensor::host(DType::kF32, e.shape);
      st.read(name, out.view(), /*allow_convert=*/true);
    }
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::kBadArgument)
      fuzz::fail("not a kBadArgument error", e.what());
    fuzz::check_message(e.what());
  }
  return 0;
}
