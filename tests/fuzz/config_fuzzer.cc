// libFuzzer harness: the configuration reader behind `strata config check`
// (parse_config_text and the schema). Any input must end in a Config or a
// ConfigError with bounded, printable problems; a valid config's effective
// document must itself be valid and give the same config.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "runtime/config/config.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const strata::Config config = strata::parse_config_text(text, "fuzz.json");
    const strata::Config again = strata::parse_config(config.effective, "effective");
    if (again.effective != config.effective)
      strata::fuzz::fail("effective config not a fixed point", text);
  } catch (const strata::ConfigError& e) {
    if (e.problems().empty() || e.problems().size() > 51)
      strata::fuzz::fail("problem count out of [1, 51]", e.message());
    for (const auto& problem : e.problems()) strata::fuzz::check_message(problem, 1024);
  }
  // Anything else (strata::Error of another kind, nlohmann exceptions) escapes
  // and libFuzzer reports it as a crash: a config can only be valid or invalid.
  return 0;
}
