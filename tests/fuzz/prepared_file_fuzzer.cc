// libFuzzer harness: strata's prepared-data reader and the document batches
// (runtime/data/prepared_file.h, batches.h). Any file must open or fail with
// strata::Error(kBadArgument) and a bounded message; an opened file must give
// batches whose packed positions restart at 0 within each row, whose ids lie
// in the file and whose targets are ignored or the next token of the row.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/error.h"
#include "kernels/ops.h"
#include "runtime/data/batches.h"
#include "runtime/data/prepared_file.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  if (size < 1) return 0;
  // The first byte picks the window length and packing; the rest is the file.
  const int64_t seq = 1 + data[0] % 32;
  const bool packing = data[0] & 0x80;
  const fuzz::MemoryFile file(data + 1, size - 1);
  try {
    const data::PreparedFile f = data::PreparedFile::open(file.path());
    if (f.tokens() <= 0 || f.documents() <= 0) fuzz::fail("an opened file without tokens", f.path());
    std::unique_ptr<data::Batches> batches =
        data::open_batches(file.path(), "prepared", {.seq = seq, .micro_batch = 2, .rank = 1, .world = 2,
                                                     .seed = data[0], .packing = packing});
    data::Batch b;
    for (int step = 0; step < 3; ++step) {
      batches->next(b);
      for (size_t i = 0; i < b.ids.size(); ++i) {
        const bool row_start = i % static_cast<size_t>(seq) == 0;
        if (b.positions[i] != 0 && (row_start || b.positions[i] != b.positions[i - 1] + 1))
          fuzz::fail("a position neither starts a document nor follows the one before", "");
        const bool last = (i + 1) % static_cast<size_t>(seq) == 0;
        if (b.targets[i] != ops::kIgnoreIndex && (last || b.positions[i + 1] == 0 || b.targets[i] != b.ids[i + 1]))
          fuzz::fail("a target that is not the next token of its document", "");
      }
    }
    batches->eval_batch(batches->eval_batches(), b);  // past the end: empty rows
    batches->check_ids(40000);
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::kBadArgument) fuzz::fail("not a kBadArgument error", e.what());
    fuzz::check_message(e.what());
  }
  return 0;
}
