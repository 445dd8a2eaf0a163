// A data file mapped read-only, shared by the token and prepared-data readers.
#pragma once

#include <cstddef>
#include <string>

namespace strata::data {

struct Mapping {
  void* data = nullptr;  // nullptr for an empty file
  size_t nbytes = 0;
};

// Maps `path` read-only (MAP_PRIVATE); the caller munmaps it. `what` names
// the file in messages ("token file"). Error(kIo) with the errno text when it
// cannot be opened, stat'ed or mapped; Error(kBadArgument) when it is not a
// regular file.
Mapping map_read_only(const std::string& path, const char* what);

}  // namespace strata::data
