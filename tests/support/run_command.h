// Runs a shell command and captures its output and exit status, for tests of
// the command-line tools.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace strata::test {

struct CommandResult {
  int exit_code = -1;  // -1 when killed by a signal
  std::string output;  // stdout, plus stderr when the command redirects it
};

inline CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed: " + command);
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

inline std::string strata_binary() { return std::string(STRATA_BUILD_DIR) + "/bin/strata"; }

}  // namespace strata::test
