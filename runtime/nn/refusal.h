// STRATA_REFUSE_UNLESS(cond, "format {}", args...): throws Error(kBadArgument)
// with the formatted message alone when cond is false. For refusals of user
// input (config.json, a checkpoint's tensors), whose message names the key or
// tensor, its value and what is supported: unlike STRATA_CHECK it adds no
// check expression or source location, which mean nothing to a user.
#pragma once

#include "core/error.h"

#define STRATA_REFUSE_UNLESS(cond, ...)                                    \
  do {                                                                     \
    if (!(cond)) [[unlikely]] {                                            \
      ::strata::raise(::strata::ErrorCategory::kBadArgument, __VA_ARGS__); \
    }                                                                      \
  } while (0)
