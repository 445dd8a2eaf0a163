// libFuzzer harness: the token-file reader and loader (runtime/data). Any file,
// read as each format, must open or fail with strata::Error(kBadArgument) and
// a bounded message; an opened file must yield micro-batches whose tokens lie
// in the file and whose targets are the next tokens, or a kBadArgument for a
// token outside the vocabulary.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "runtime/data/token_file.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  if (size < 1) return 0;
  // The first byte picks the format and the sequence length; the rest is the file.
  const auto format = static_cast<data::TokenFormat>(data[0] % 5);
  const int64_t seq = 1 + data[0] / 5 % 16;
  const fuzz::MemoryFile file(data + 1, size - 1);
  try {
    const data::TokenFile f = data::TokenFile::open(file.path(), format);
    if (f.size() < 0) fuzz::fail("negative token count", f.path());
    data::TokenLoader loader(f, {.seq = seq, .micro_batch = 2, .rank = 1, .world = 2,
                                 .seed = data[0], .vocab = 40000});
    std::vector<int32_t> ids, targets;
    for (int step = 0; step < 3; ++step) {
      loader.next(ids, targets);
      for (size_t i = 0; i + 1 < ids.size(); ++i) {
        if (i % static_cast<size_t>(seq) != static_cast<size_t>(seq) - 1 && targets[i] != ids[i + 1])
          fuzz::fail("a target is not the next token", "");
      }
    }
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::kBadArgument)
      fuzz::fail("not a kBadArgument error", e.what());
    fuzz::check_message(e.what());
  }
  return 0;
}
