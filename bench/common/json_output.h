// The --json file of a bench tool. Checked when the flags are read (its
// directory exists and is writable), so a run of minutes does not end with
// nothing written; written durably at the end (core/durable_file.h), every
// failure an Error naming the file and the errno, so a tool never exits 0
// having written nothing. "-" is stdout.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/durable_file.h"
#include "core/error.h"

namespace strata::bench {

// Error(kBadArgument) naming `flag` when `path` cannot be written.
inline void check_json_path(const std::string& path, const char* flag = "--json") {
  if (path.empty() || path == "-") return;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    raise(ErrorCategory::kBadArgument, "{} {}: is a directory; give a file name", flag, path);
  }
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  if (!std::filesystem::is_directory(dir, ec)) {
    raise(ErrorCategory::kBadArgument, "{} {}: the directory {} does not exist", flag, path, dir.string());
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    raise(ErrorCategory::kBadArgument, "{} {}: cannot write into {}: {}", flag, path, dir.string(),
          std::strerror(errno));
  }
}

// Writes `doc` to `path` ("-": stdout), or throws Error naming the file.
inline void write_json_output(const std::string& path, const nlohmann::json& doc, int indent = 2) {
  if (path.empty()) return;
  if (path == "-") {
    std::cout << doc.dump(indent) << "\n" << std::flush;
    if (!std::cout) raise(ErrorCategory::kIo, "writing the JSON results to stdout failed");
    return;
  }
  write_file_durably(path, doc.dump(indent) + "\n");
}

}  // namespace strata::bench
