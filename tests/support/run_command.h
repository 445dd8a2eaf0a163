// Runs a shell command and captures its output and exit status, for tests of
// the command-line tools.
#pragma once

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include "tests/support/test_paths.h"

namespace strata::test {

struct CommandResult {
  int exit_code = -1;  // -1 when killed by a signal
  std::string output;  // stdout, plus stderr when the command redirects it
  double seconds = 0;  // wall time until it ended
};

inline CommandResult run_command(const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed: " + command);
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// Runs a shell command, stdout and stderr captured, under coreutils `timeout`
// (TERM at limit_s, KILL 5 s later, to the whole process group; `strata run`'s
// ranks die with it through PR_SET_PDEATHSIG), so a hang fails the test
// instead of blocking CI.
inline CommandResult run_with_limit(const std::string& command, int limit_s) {
  return run_command("timeout -k 5 " + std::to_string(limit_s) + " " + command + " 2>&1");
}

inline std::string strata_binary() { return strata::test::build_dir() + "/bin/strata"; }

}  // namespace strata::test
