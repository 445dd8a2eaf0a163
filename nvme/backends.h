// Internal: constructors of the concrete backends (used by make_backend).
#pragma once

#include <memory>

#include "nvme/io_backend.h"

namespace strata::nvme {

std::unique_ptr<IoBackend> make_uring_backend();
std::unique_ptr<IoBackend> make_aio_backend();
std::unique_ptr<IoBackend> make_psync_backend();

}  // namespace strata::nvme
