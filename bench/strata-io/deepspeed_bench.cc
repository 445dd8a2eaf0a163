// DeepSpeedAio: the Python coprocess behind strata-io --vs-deepspeed. Spawned
// without a shell (posix_spawnp), JSON lines over pipes, stderr to a temp file
// whose tail goes into error messages.
#include "bench/strata-io/deepspeed_bench.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/strata-io/deepspeed_aio_script.h"  // kDeepSpeedAioScript (generated)
#include "runtime/core/error.h"

extern char** environ;

namespace strata::bench {
namespace {

constexpr const char* kMark = "@@strata-io@@ ";
// The first start may compile DeepSpeed's op; a pass of a few GiB takes seconds.
constexpr int kStartTimeoutMs = 15 * 60 * 1000;
constexpr int kPassTimeoutMs = 15 * 60 * 1000;

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) raise_errno(errno, "write to the DeepSpeed coprocess");
    done += static_cast<size_t>(n);
  }
}

}  // namespace

DeepSpeedAio::DeepSpeedAio(std::string python) : python_(std::move(python)) {
  int in_pipe[2], out_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0) {
    why_ = fmt::format("pipe: {}", std::strerror(errno));
    return;
  }
  char tmpl[] = "/tmp/strata-io-deepspeed.XXXXXX";
  int err_fd = ::mkstemp(tmpl);
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
  std::string script = kDeepSpeedAioScript;
  std::vector<char*> argv = {python_.data(), const_cast<char*>("-u"), const_cast<char*>("-c"),
                             script.data(), nullptr};
  int rc = posix_spawnp(&pid_, python_.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  if (err_fd >= 0) ::close(err_fd);
  to_child_ = in_pipe[1];
  from_child_ = out_pipe[0];
  if (rc != 0) {
    pid_ = -1;
    why_ = fmt::format("cannot run Python interpreter '{}': {}", python_, std::strerror(rc));
    stop();
    return;
  }
  try {
    nlohmann::json hello = nlohmann::json::parse(read_reply());
    if (hello.contains("error")) {
      why_ = fmt::format("Python '{}'{} cannot use DeepSpeed's aio: {}", python_,
                         hello.contains("python")
                             ? fmt::format(" ({})", hello["python"].get<std::string>())
                             : std::string(),
                         hello["error"].get<std::string>());
      stop();
      return;
    }
    versions_ = fmt::format("deepspeed {}, torch {}, {}", hello.value("deepspeed", "?"),
                            hello.value("torch", "?"), hello.value("python", python_));
    available_ = true;
  } catch (const std::exception& e) {
    why_ = fmt::format("Python '{}' did not start DeepSpeed's aio: {}", python_, e.what());
    stop();
  }
}

DeepSpeedAio::~DeepSpeedAio() {
  stop();
  if (!stderr_path_.empty()) ::unlink(stderr_path_.c_str());
}

void DeepSpeedAio::stop() {
  if (to_child_ >= 0) ::close(to_child_);  // EOF on stdin ends the script's loop
  to_child_ = -1;
  if (pid_ > 0) {
    int status = 0;
    // Give it a moment to exit on its own, then make sure.
    for (int i = 0; i < 50; ++i) {
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

std::string DeepSpeedAio::stderr_tail() const {
  if (stderr_path_.empty()) return "";
  std::ifstream in(stderr_path_);
  std::stringstream all;
  all << in.rdbuf();
  std::string text = all.str();
  if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
  return text;
}

std::string DeepSpeedAio::read_reply() {
  const auto deadline_ms = pid_ > 0 && versions_.empty() ? kStartTimeoutMs : kPassTimeoutMs;
  int waited_ms = 0;
  while (true) {
    // A complete line that carries the marker is a reply; anything else
    // (DeepSpeed's own prints) is skipped.
    size_t newline;
    while ((newline = pending_.find('\n')) != std::string::npos) {
      std::string line = pending_.substr(0, newline);
      pending_.erase(0, newline + 1);
      const size_t at = line.find(kMark);
      if (at != std::string::npos) return line.substr(at + std::strlen(kMark));
    }
    pollfd p{from_child_, POLLIN, 0};
    int rc = ::poll(&p, 1, 1000);
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) {
      waited_ms += 1000;
      STRATA_CHECK(waited_ms < deadline_ms, kIo, "no answer from the DeepSpeed coprocess in {} s",
                   deadline_ms / 1000);
      continue;
    }
    char buf[4096];
    ssize_t n = ::read(from_child_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int status = 0;
      std::string how = "closed its output";
      if (pid_ > 0 && ::waitpid(pid_, &status, 0) == pid_) {
        pid_ = -1;
        how = WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                : fmt::format("was killed by signal {}", WTERMSIG(status));
      }
      raise(ErrorCategory::kIo, "the DeepSpeed coprocess ({}) {}; its stderr: {}", python_, how,
            stderr_tail());
    }
    pending_.append(buf, static_cast<size_t>(n));
  }
}

std::string DeepSpeedAio::request(const std::string& line) {
  STRATA_CHECK(to_child_ >= 0, kIo, "the DeepSpeed coprocess is not running ({})", why_);
  write_all(to_child_, line + "\n");
  return read_reply();
}

double DeepSpeedAio::pass(const IoCase& c, const std::string& path, uint64_t size,
                          bool overlap_events, uint64_t buffer_nbytes, int warmup) {
  nlohmann::json req = {{"path", path},
                        {"rw", c.rw == nvme::IoOp::kRead ? "read" : "write"},
                        {"size", size},
                        {"bs", c.bs},
                        {"qd", c.qd},
                        {"threads", c.threads},
                        {"overlap_events", overlap_events},
                        {"buffer_nbytes", buffer_nbytes},
                        {"warmup", warmup}};
  nlohmann::json reply = nlohmann::json::parse(request(req.dump()));
  STRATA_CHECK(!reply.contains("error"), kIo, "DeepSpeed aio_handle {} of {}: {}",
               req["rw"].get<std::string>(), path, reply.value("error", ""));
  const double gbps = reply.value("gbps", 0.0);
  STRATA_CHECK(gbps > 0, kIo, "DeepSpeed coprocess sent no bandwidth: {}", reply.dump());
  return gbps;
}

}  // namespace strata::bench
