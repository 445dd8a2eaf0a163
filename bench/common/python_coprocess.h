// PythonCoprocess: a Python child that answers JSON lines, for bench tools
// that time a Python anchor (DeepSpeed's aio, DeepSpeed's cpu_adam) in
// alternation with strata. Spawned without a shell (posix_spawnp), requests on
// its stdin, replies on its stdout as lines carrying `marker` (anything else
// the child prints is skipped), stderr to a temp file whose tail goes into
// error messages. The script's first reply is a hello: {"deepspeed", "torch",
// "python"} or {"error"}.
//
// Not thread-safe; owns the child process (ended in the destructor: EOF on its
// stdin, then SIGKILL after 5 s).
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"

extern char** environ;

namespace strata::bench {

struct PythonCoprocessOptions {
  std::string python;              // a name looked up in PATH, or a path
  std::string script;              // run with `python -u -c script`
  std::string marker;              // e.g. "@@strata-io@@ "
  std::string purpose;             // for messages: "DeepSpeed's aio"
  std::vector<std::string> env;    // "NAME=value" set in the child's environment (replacing NAME)
  int start_timeout_ms = 15 * 60 * 1000;  // the hello (may import and build an op)
  int reply_timeout_ms = 15 * 60 * 1000;  // every later reply
};

class PythonCoprocess {
 public:
  // Starts the child and waits for its hello. Never throws: available() is
  // false and why() says what failed.
  explicit PythonCoprocess(PythonCoprocessOptions options) : o_(std::move(options)) {
    int in_pipe[2], out_pipe[2];
    if (::pipe2(in_pipe, O_CLOEXEC) != 0) {
      why_ = fmt::format("pipe: {}", std::strerror(errno));
      return;
    }
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
      why_ = fmt::format("pipe: {}", std::strerror(errno));
      ::close(in_pipe[0]);
      ::close(in_pipe[1]);
      return;
    }
    char tmpl[] = "/tmp/strata-bench-python.XXXXXX";
    const int err_fd = ::mkstemp(tmpl);
    if (err_fd >= 0) stderr_path_ = tmpl;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in_pipe[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
    if (err_fd >= 0) {
      posix_spawn_file_actions_adddup2(&actions, err_fd, 2);
    } else {
      posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    }
    std::vector<std::string> env_text;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      bool replaced = false;
      for (const auto& over : o_.env) replaced = replaced || entry.rfind(over.substr(0, over.find('=') + 1), 0) == 0;
      if (!replaced) env_text.push_back(entry);
    }
    env_text.insert(env_text.end(), o_.env.begin(), o_.env.end());
    std::vector<char*> envp;
    for (auto& e : env_text) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv = {o_.python.data(), const_cast<char*>("-u"), const_cast<char*>("-c"), o_.script.data(),
                               nullptr};
    const int rc = posix_spawnp(&pid_, o_.python.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    if (err_fd >= 0) ::close(err_fd);
    to_child_ = in_pipe[1];
    from_child_ = out_pipe[0];
    if (rc != 0) {
      pid_ = -1;
      why_ = fmt::format("cannot run Python interpreter '{}': {}", o_.python, std::strerror(rc));
      stop();
      return;
    }
    try {
      const nlohmann::json hello = nlohmann::json::parse(read_reply(o_.start_timeout_ms));
      if (hello.contains("error")) {
        why_ = fmt::format("Python '{}'{} cannot use {}: {}", o_.python,
                           hello.contains("python") ? fmt::format(" ({})", hello["python"].get<std::string>())
                                                    : std::string(),
                           o_.purpose, hello["error"].get<std::string>());
        stop();
        return;
      }
      versions_ = fmt::format("deepspeed {}, torch {}, {}", hello.value("deepspeed", "?"), hello.value("torch", "?"),
                              hello.value("python", o_.python));
      available_ = true;
    } catch (const std::exception& e) {
      why_ = fmt::format("Python '{}' did not start {}: {}", o_.python, o_.purpose, e.what());
      stop();
    }
  }
  ~PythonCoprocess() {
    stop();
    if (!stderr_path_.empty()) ::unlink(stderr_path_.c_str());
  }
  PythonCoprocess(const PythonCoprocess&) = delete;
  PythonCoprocess& operator=(const PythonCoprocess&) = delete;

  bool available() const { return available_; }
  const std::string& why() const { return why_; }
  // "deepspeed 0.19.8, torch 2.x, /path/to/python" once available.
  const std::string& versions() const { return versions_; }

  // One request line, one reply (JSON text). Throws Error(kIo) when the child
  // is gone, dies, or does not answer within reply_timeout_ms.
  std::string request(const std::string& line) {
    STRATA_CHECK(to_child_ >= 0, kIo, "the {} coprocess is not running ({})", o_.purpose, why_);
    const std::string text = line + "\n";
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(to_child_, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) raise_errno(errno, "write to the Python coprocess");
      done += static_cast<size_t>(n);
    }
    return read_reply(o_.reply_timeout_ms);
  }

 private:
  std::string read_reply(int timeout_ms) {
    int waited_ms = 0;
    while (true) {
      size_t newline;
      while ((newline = pending_.find('\n')) != std::string::npos) {
        const std::string line = pending_.substr(0, newline);
        pending_.erase(0, newline + 1);
        const size_t at = line.find(o_.marker);
        if (at != std::string::npos) return line.substr(at + o_.marker.size());
      }
      pollfd p{from_child_, POLLIN, 0};
      const int rc = ::poll(&p, 1, 1000);
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) {
        waited_ms += 1000;
        STRATA_CHECK(waited_ms < timeout_ms, kIo, "no answer from the {} coprocess in {} s", o_.purpose,
                     timeout_ms / 1000);
        continue;
      }
      char buf[4096];
      const ssize_t n = ::read(from_child_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        int status = 0;
        std::string how = "closed its output";
        if (pid_ > 0 && ::waitpid(pid_, &status, 0) == pid_) {
          pid_ = -1;
          how = WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                  : fmt::format("was killed by signal {}", WTERMSIG(status));
        }
        raise(ErrorCategory::kIo, "the {} coprocess ({}) {}; its stderr: {}", o_.purpose, o_.python, how,
              stderr_tail());
      }
      pending_.append(buf, static_cast<size_t>(n));
    }
  }
  std::string stderr_tail() const {
    if (stderr_path_.empty()) return "";
    std::ifstream in(stderr_path_);
    std::stringstream all;
    all << in.rdbuf();
    std::string text = all.str();
    if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
    return text;
  }
  void stop() {
    if (to_child_ >= 0) ::close(to_child_);  // EOF on stdin ends the script's loop
    to_child_ = -1;
    if (pid_ > 0) {
      int status = 0;
      for (int i = 0; i < 50; ++i) {  // a moment to exit on its own, then make sure
        if (::waitpid(pid_, &status, WNOHANG) == pid_) {
          pid_ = -1;
          break;
        }
        ::usleep(100 * 1000);
      }
      if (pid_ > 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
      }
    }
    if (from_child_ >= 0) ::close(from_child_);
    from_child_ = -1;
    available_ = false;
  }

  PythonCoprocessOptions o_;
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string stderr_path_;
  std::string pending_;  // bytes read from the child past the last reply line
  bool available_ = false;
  std::string why_;
  std::string versions_;
};

}  // namespace strata::bench
