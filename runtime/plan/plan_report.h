// A Plan (plan.h) as `strata plan` prints it: JSON for machines (sizes in
// bytes, bandwidths in bytes/s, efficiencies as fractions) and a table for
// people (GB = 1e9 bytes, as the ZeRO papers write them; --units GiB for 2^30).
// Thread-safety: pure functions. Errors: none beyond std::bad_alloc.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "runtime/plan/plan.h"

namespace strata::plan {

enum class Units { kGB, kGiB };

nlohmann::json to_json(const Plan& plan);
// The sections after the model and machine header (which the command prints,
// since it knows where each value came from).
std::string to_text(const Plan& plan, Units units = Units::kGB);

}  // namespace strata::plan
