// libFuzzer harness: Hugging Face config.json (load_decoder_config). Any file
// must load or fail with strata::Error(kBadArgument) and a bounded message; a
// loaded config must count its parameters without overflow (UBSan watches)
// and survive its own to_json().
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "runtime/nn/decoder_config.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const fuzz::MemoryFile file(data, size);
  try {
    const nn::DecoderConfig config = nn::load_decoder_config(file.path());
    if (config.parameter_count() <= 0) fuzz::fail("non-positive parameter count", "");
    if (config.checkpoint_parameter_count() < config.parameter_count())
      fuzz::fail("the checkpoint counts fewer parameters than its model", "");
    const nn::DecoderConfig again = nn::parse_decoder_config(config.to_json(), "to_json");
    if (again.to_json() != config.to_json())
      fuzz::fail("to_json does not round-trip", config.to_json().dump());
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::kBadArgument)
      fuzz::fail("not a kBadArgument error", e.what());
    fuzz::check_message(e.what());
  }
  return 0;
}
