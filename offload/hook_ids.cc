// Names of hook phases, for logs and messages.
#include "offload/hook_ids.h"

namespace strata::offload {

std::string_view phase_name(Phase phase) {
  switch (phase) {
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kRecompute: return "recompute";
  }
  return "?";
}

}  // namespace strata::offload
