// Internal: constructors of the concrete backends (used by make_backend).
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "nvme/io_backend.h"

namespace strata::nvme {

std::unique_ptr<IoBackend> make_uring_backend();
std::unique_ptr<IoBackend> make_aio_backend();
std::unique_ptr<IoBackend> make_psync_backend();

// Completions a queue made up itself (a piece refused at submission, an
// injected fault) go out first in wait(): moves them all to `out`, returns how many.
inline size_t take_synthetic(std::deque<IoCompletion>& synthetic, std::vector<IoCompletion>& out) {
  const size_t n = synthetic.size();
  out.insert(out.end(), synthetic.begin(), synthetic.end());
  synthetic.clear();
  return n;
}

}  // namespace strata::nvme
