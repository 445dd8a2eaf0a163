// The process launcher behind `strata run`: fork/exec of the ranks, one poll
// loop over their output pipes and a signalfd, and the failure policy.
#include "runtime/launcher/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace strata::launcher {
namespace {
using Clock = std::chrono::steady_clock;

// How long the other ranks may take to end on their own when the first rank
// to fail failed because of a peer (at least --failure-grace).
constexpr double kPeerFailedGraceS = 10.0;

struct OutputStream {
  int fd = -1;     // read end of the child's pipe; -1 once closed
  FILE* sink = nullptr;
  std::string partial;  // bytes after the last newline
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  OutputStream out, err;
};

void write_lines(OutputStream& stream, const std::string& prefix, const char* data, size_t nbytes, bool flush_all) {
  stream.partial.append(data, nbytes);
  size_t begin = 0;
  for (;;) {
    size_t newline = stream.partial.find('\n', begin);
    if (newline == std::string::npos) break;
    std::fprintf(stream.sink, "%s%.*s\n", prefix.c_str(), static_cast<int>(newline - begin),
                 stream.partial.data() + begin);
    begin = newline + 1;
  }
  stream.partial.erase(0, begin);
  if (flush_all && !stream.partial.empty()) {
    std::fprintf(stream.sink, "%s%s\n", prefix.c_str(), stream.partial.c_str());
    stream.partial.clear();
  }
  std::fflush(stream.sink);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return fmt::format("was killed by signal {} (SIG{}: {})", sig, name ? name : "?", strsignal(sig));
  }
  return fmt::format("ended with wait status {}", status);
}

// now + seconds, saturating: a grace of 1e10 s (or infinity) is "never", not
// a double -> int64 nanosecond cast that overflows into the past.
Clock::time_point deadline_after(Clock::time_point now, double seconds) {
  const double room_s = std::chrono::duration<double>(Clock::time_point::max() - now).count();
  if (!(seconds < room_s / 2)) return Clock::time_point::max();
  return now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// OpenMP threads for each of `local_ranks` ranks on this machine's cores: a
// share, not all of them each.
int omp_threads_per_rank(int local_ranks) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(local_ranks, 1));
}

[[noreturn]] void exec_child(const LaunchOptions& options, int local_rank, int64_t world_size, int port,
                             int strata_port, int out_fd, int err_fd, const sigset_t& original_mask,
                             pid_t launcher_pid) {
  // Own process group: the launcher signals each rank's whole tree. Die with the
  // launcher so that no rank outlives it (a killed launcher, a test timeout).
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher_pid) _exit(125);
  sigprocmask(SIG_SETMASK, &original_mask, nullptr);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGPIPE, SIG_DFL);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  const int64_t rank = int64_t{options.node_rank} * options.nproc_per_node + local_rank;
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(options.node_rank).c_str(), 1);
  setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  // strata's own store, so that torch.distributed can take MASTER_PORT beside it.
  setenv("STRATA_MASTER_PORT", std::to_string(strata_port).c_str(), 1);
  // The local ranks share the cores (as torchrun sets OMP_NUM_THREADS): each
  // rank's OpenMP team of every core spun between its ops (libgomp's active
  // wait) on the cores the other ranks compute on — 1.2-1.6 s of a cp 2
  // run's first step on 2 cores, 0.1 s with a core each. A value given stays.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    setenv("OMP_NUM_THREADS", std::to_string(omp_threads_per_rank(options.nproc_per_node)).c_str(), 1);
  }
  std::vector<char*> argv;
  for (const auto& arg : options.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  std::fprintf(stderr, "strata run: cannot execute '%s': %s\n", argv[0], std::strerror(errno));
  _exit(127);
}
}  // namespace

partition::RankInfo rank_info_from_env() {
  partition::RankInfo rank = partition::RankInfo::from_env();
  if (rank.world_size == 1 && std::getenv("MASTER_PORT") == nullptr && std::getenv("STRATA_MASTER_PORT") == nullptr) {
    rank.master_port = find_free_port(rank.master_addr);
  }
  return rank;
}

int find_free_port(const std::string& host) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  check_errno(fd, "socket for a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    int err = errno;
    close(fd);
    raise_errno(err, fmt::format("finding a free TCP port on {}", host));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

namespace {
void validate(const LaunchOptions& options) {
  if (options.nproc_per_node < 1 || options.nproc_per_node > kMaxLocalRanks) {
    raise(ErrorCategory::kBadArgument, "-n (ranks on this node) must be in [1, {}], got {}",
          kMaxLocalRanks, options.nproc_per_node);
  }
  if (options.nnodes < 1)
    raise(ErrorCategory::kBadArgument, "--nnodes must be >= 1, got {}", options.nnodes);
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    raise(ErrorCategory::kBadArgument, "--node-rank {} must be in [0, {}) (--nnodes {})",
          options.node_rank, options.nnodes, options.nnodes);
  }
  const int64_t world_size = int64_t{options.nnodes} * options.nproc_per_node;
  if (world_size > INT_MAX) {
    raise(ErrorCategory::kBadArgument,
          "--nnodes {} x -n {} = {} ranks; RANK and WORLD_SIZE must fit a 32-bit int (at most {})",
          options.nnodes, options.nproc_per_node, world_size, INT_MAX);
  }
  if (options.command.empty())
    raise(ErrorCategory::kBadArgument, "no command given: strata run -n N -- PROGRAM ARGS...");
  if (options.master_port < 0 || options.master_port > 65535) {
    raise(ErrorCategory::kBadArgument, "--master-port {} is not a TCP port (0..65535)",
          options.master_port);
  }
  if (std::isnan(options.failure_grace_s) || options.failure_grace_s < 0) {
    raise(ErrorCategory::kBadArgument,
          "--failure-grace must be a number of seconds >= 0 (or inf), got {}",
          options.failure_grace_s);
  }
  if (std::isnan(options.kill_delay_s) || options.kill_delay_s < 0) {
    raise(ErrorCategory::kBadArgument,
          "--kill-delay must be a number of seconds >= 0 (or inf), got {}", options.kill_delay_s);
  }
  // Two pipes per rank stay open in the launcher, plus two more while one starts.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    const uint64_t needed = 2 * static_cast<uint64_t>(options.nproc_per_node) + 32;
    if (needed > files.rlim_cur) {
      raise(ErrorCategory::kBadArgument,
            "-n {} needs about {} open files in strata run, over the limit of {} (ulimit -n)",
            options.nproc_per_node, needed, static_cast<uint64_t>(files.rlim_cur));
    }
  }
}
}  // namespace

int launch(const LaunchOptions& options) {
  validate(options);
  const int64_t world_size = int64_t{options.nnodes} * options.nproc_per_node;
  int port = options.master_port;
  if (port == 0) port = options.nnodes == 1 ? find_free_port(options.master_addr) : 29500;
  // strata's store port (STRATA_MASTER_PORT) beside MASTER_PORT, which a
  // torch.distributed process group in the ranks may take: another free port
  // on one node, the next one across nodes (every node computes the same).
  int strata_port = port < 65535 ? port + 1 : port - 1;
  if (options.nnodes == 1 && options.master_port == 0) {
    for (int tries = 0; tries < 8 && (strata_port = find_free_port(options.master_addr)) == port; ++tries) {
    }
  }

  // Signals arrive through a signalfd, so the poll loop sees them in order with output.
  sigset_t handled, original;
  sigemptyset(&handled);
  sigaddset(&handled, SIGINT);
  sigaddset(&handled, SIGTERM);
  sigaddset(&handled, SIGCHLD);
  sigprocmask(SIG_BLOCK, &handled, &original);
  // A launcher started in the background by a non-interactive shell inherits
  // SIGINT ignored, and ignored signals never reach a signalfd: take them back.
  struct sigaction default_action {}, old_int {}, old_term {};
  default_action.sa_handler = SIG_DFL;
  sigaction(SIGINT, &default_action, &old_int);
  sigaction(SIGTERM, &default_action, &old_term);
  int signal_fd = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signal_fd < 0) {
    int err = errno;
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
    sigprocmask(SIG_SETMASK, &original, nullptr);
    raise_errno(err, "signalfd");
  }

  std::vector<Rank> ranks(static_cast<size_t>(options.nproc_per_node));
  pid_t launcher_pid = getpid();
  int local = 0;
  try {
    for (; local < options.nproc_per_node; ++local) {
      Rank& r = ranks[static_cast<size_t>(local)];
      r.rank = static_cast<int>(int64_t{options.node_rank} * options.nproc_per_node + local);  // < world_size <= INT_MAX
      int out_pipe[2], err_pipe[2];
      check_errno(pipe2(out_pipe, O_CLOEXEC), "pipe for rank output");
      if (pipe2(err_pipe, O_CLOEXEC) != 0) {
        const int err = errno;
        close(out_pipe[0]);
        close(out_pipe[1]);
        raise_errno(err, "pipe for rank output");
      }
      std::fflush(nullptr);
      pid_t pid = fork();
      if (pid < 0) {
        const int err = errno;
        for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) close(fd);
        raise_errno(err, fmt::format("fork for rank {}", r.rank));
      }
      if (pid == 0) {
        exec_child(options, local, world_size, port, strata_port, out_pipe[1], err_pipe[1], original, launcher_pid);
      }
      // Also here, not only in the child: a signal forwarded before the child ran
      // its own setpgid would otherwise miss it (EACCES after its exec is harmless).
      setpgid(pid, pid);
      close(out_pipe[1]);
      close(err_pipe[1]);
      r.pid = pid;
      r.running = true;
      r.out = {out_pipe[0], stdout, {}};
      r.err = {err_pipe[0], stderr, {}};
    }
  } catch (...) {
    // Starting rank `local` failed (out of processes or files): the ranks
    // already started must not run on without their peers.
    for (int k = 0; k < local; ++k) {
      Rank& r = ranks[static_cast<size_t>(k)];
      killpg(r.pid, SIGKILL);
      waitpid(r.pid, nullptr, 0);
      close(r.out.fd);
      close(r.err.fd);
    }
    close(signal_fd);
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
    sigprocmask(SIG_SETMASK, &original, nullptr);
    throw;
  }

  int first_failed = -1;
  // Ranks that failed on their own, before strata run stopped anyone, in the order they ended.
  std::vector<int> failures;
  int interrupts = 0, first_signal = 0;
  bool terminated = false, killed = false;
  Clock::time_point stop_at{}, kill_at{};
  // Every rank's process group, also of ranks already reaped: their children
  // (a shell's background job, a data loader) live on in the group.
  auto signal_all = [&](int sig) {
    for (auto& r : ranks) killpg(r.pid, sig);
  };
  auto prefix_of = [&](const Rank& r) {
    return options.prefix_output ? fmt::format("[rank {}] ", r.rank) : std::string();
  };

  auto pipes_open = [&] {
    for (auto& r : ranks) {
      if (r.out.fd >= 0 || r.err.fd >= 0) return true;
    }
    return false;
  };
  auto any_running = [&] {
    for (auto& r : ranks) {
      if (r.running) return true;
    }
    return false;
  };

  Clock::time_point drain_deadline{};
  while (any_running() || pipes_open()) {
    if (!any_running()) {
      // Every rank is reaped; a grandchild may still hold a pipe open. Stop after a moment.
      if (drain_deadline == Clock::time_point{}) drain_deadline = Clock::now() + std::chrono::milliseconds(500);
      if (Clock::now() > drain_deadline) break;
    }
    std::vector<pollfd> fds;
    std::vector<OutputStream*> streams;
    fds.push_back({signal_fd, POLLIN, 0});
    streams.push_back(nullptr);
    for (auto& r : ranks) {
      for (OutputStream* s : {&r.out, &r.err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
      }
    }
    int ready = poll(fds.data(), fds.size(), 50);
    if (ready < 0 && errno != EINTR) check_errno(ready, "poll in strata run");
    for (size_t i = 1; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      OutputStream* s = streams[i];
      const Rank* owner = nullptr;
      for (auto& r : ranks) {
        if (&r.out == s || &r.err == s) owner = &r;
      }
      const std::string prefix = prefix_of(*owner);
      char buffer[65536];
      ssize_t n = read(s->fd, buffer, sizeof(buffer));
      if (n > 0) {
        write_lines(*s, prefix, buffer, static_cast<size_t>(n), false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        write_lines(*s, prefix, "", 0, true);
        close(s->fd);
        s->fd = -1;
      }
    }
    signalfd_siginfo info;
    while (read(signal_fd, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
      if (info.ssi_signo == SIGINT || info.ssi_signo == SIGTERM) {
        ++interrupts;
        if (first_signal == 0) first_signal = static_cast<int>(info.ssi_signo);
        std::fprintf(stderr, "strata run: received %s, forwarding it to the ranks%s\n",
                     info.ssi_signo == SIGINT ? "SIGINT" : "SIGTERM", interrupts > 1 ? " (and killing them)" : "");
        signal_all(interrupts > 1 ? SIGKILL : static_cast<int>(info.ssi_signo));
        if (kill_at == Clock::time_point{}) kill_at = deadline_after(Clock::now(), options.kill_delay_s);
        terminated = true;
      }
    }
    // Reap every rank that ended.
    for (;;) {
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (auto& r : ranks) {
        if (r.pid != pid) continue;
        r.running = false;
        r.status = status;
        bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && interrupts == 0 && !terminated) failures.push_back(r.rank);
        if (failed && first_failed < 0 && interrupts == 0) {
          first_failed = r.rank;
          // A rank that failed because a peer did is often first: the peer that
          // failed on its own is still unwinding, and its message comes at the
          // end of that. Give it longer to say what went wrong.
          const bool peer = exit_code_of(status) == kPeerFailedExitCode;
          const double grace = peer && options.failure_grace_s > 0 ? std::max(options.failure_grace_s, kPeerFailedGraceS)
                                                                   : options.failure_grace_s;
          // What happens next, as the grace period decides it.
          const std::string next =
              std::isinf(grace) ? "the other ranks may finish on their own (--failure-grace inf)"
              : grace > 0       ? fmt::format("stopping the other ranks in {:g} s unless they end first{}", grace,
                                              peer ? " (it lost a peer: waiting for the rank that failed first)" : "")
                                : std::string("stopping the other ranks");
          std::fprintf(stderr, "strata run: rank %d (pid %d) %s; %s\n", r.rank, static_cast<int>(pid),
                       describe_status(status).c_str(), next.c_str());
          stop_at = deadline_after(Clock::now(), grace);
        } else if (failed && interrupts == 0) {
          std::fprintf(stderr, "strata run: rank %d (pid %d) %s%s\n", r.rank, static_cast<int>(pid),
                       describe_status(status).c_str(), terminated ? " (stopped by strata run)" : "");
        }
      }
    }
    auto now = Clock::now();
    if (first_failed >= 0 && !terminated && now >= stop_at && any_running()) {
      signal_all(SIGTERM);
      terminated = true;
      kill_at = deadline_after(now, options.kill_delay_s);
    }
    if (terminated && !killed && kill_at != Clock::time_point{} && now >= kill_at && any_running()) {
      signal_all(SIGKILL);
      killed = true;
    }
  }
  for (auto& r : ranks) {
    for (OutputStream* s : {&r.out, &r.err}) {
      if (s->fd < 0) continue;
      write_lines(*s, prefix_of(r), "", 0, true);  // a last line without its newline
      close(s->fd);
    }
  }
  // A failed or interrupted run leaves nothing behind: what a rank started is
  // still in its process group.
  if (interrupts > 0 || first_failed >= 0) signal_all(SIGKILL);
  close(signal_fd);
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  sigprocmask(SIG_SETMASK, &original, nullptr);

  if (interrupts > 0) return 128 + first_signal;  // 130 after Ctrl-C, 143 after SIGTERM, as a shell reports them
  if (first_failed >= 0) {
    // The cause: the first rank that failed on its own account. A rank whose
    // peer died fails too, often first (its collective breaks while the
    // failing rank is still unwinding), with kPeerFailedExitCode.
    const auto rank_of = [&](int rank) -> const Rank& {
      return ranks[static_cast<size_t>(rank - int64_t{options.node_rank} * options.nproc_per_node)];
    };
    int cause = failures.empty() ? first_failed : failures.front();
    for (int rank : failures) {
      if (exit_code_of(rank_of(rank).status) != kPeerFailedExitCode) {
        cause = rank;
        break;
      }
    }
    const Rank& failed = rank_of(cause);
    std::string others;
    for (int rank : failures) {
      if (rank != cause) others += (others.empty() ? "" : ", ") + std::to_string(rank);
    }
    std::string note;
    if (!others.empty() && cause != failures.front()) {
      note = fmt::format(" (the first to fail on its own; rank(s) {} failed because a peer did)", others);
    } else if (!others.empty()) {
      note = fmt::format(" (rank(s) {} failed too)", others);
    }
    std::fprintf(stderr, "strata run: failed: rank %d %s%s\n", failed.rank, describe_status(failed.status).c_str(),
                 note.c_str());
    int code = exit_code_of(failed.status);
    return code == 0 ? 1 : code;
  }
  return 0;
}

}  // namespace strata::launcher
