// Runs a shell command and captures its standard output, for bench tools that
// time an anchor (fio, a Python reference) in a child process.
#pragma once

#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace strata::bench {

struct CommandResult {
  int status = -1;  // exit status; -1 when the command could not start or was killed
  std::string output;
};

inline CommandResult run_capture(const std::string& command) {
  CommandResult r;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return r;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) r.output.append(buffer, n);
  const int raw = ::pclose(pipe);
  r.status = raw != -1 && WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

// Single-quotes `s` for a POSIX shell.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace strata::bench
