// DirectoryLock: flock on a lock file naming its holder; one lock per file per process.
#include "core/directory_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace strata {
namespace fs = std::filesystem;
namespace {

// The locks this process holds: one open file (and flock) per lock file,
// shared by every DirectoryLock handle of it.
struct Held {
  int fd = -1;
  int handles = 0;
};
std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::string, Held>& registry() {
  static auto* held = new std::map<std::string, Held>();  // never destroyed: handles may outlive statics
  return *held;
}

std::string this_command() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!raw.empty() && raw.back() == '\0') raw.pop_back();
  for (char& c : raw) {
    if (c == '\0') c = ' ';
  }
  if (raw.size() > 400) raw = raw.substr(0, 400) + "...";
  return raw;
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return "?";
  return host;
}

std::string now_text() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  ::localtime_r(&now, &local);
  char text[64];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

std::string read_all(int fd) {
  std::string text;
  char buffer[4096];
  off_t offset = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buffer, sizeof(buffer), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
    offset += n;
    if (text.size() > 65536) break;
  }
  return text;
}

// "pid 123 on host h since T (command)", from a lock file's contents.
std::string describe_holder(const std::string& text) {
  const nlohmann::json holder = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!holder.is_object()) return "a process that has not written its name into it yet";
  const auto field = [&](const char* key) {
    const auto it = holder.find(key);
    if (it == holder.end()) return std::string("?");
    return it->is_string() ? it->get<std::string>() : it->dump();
  };
  return fmt::format("pid {} on host {} since {} ({})", field("pid"), field("host"), field("started"),
                     field("command"));
}

}  // namespace

std::string rank_lock_file_name(int rank) { return fmt::format("strata-rank{}.lock", rank); }

std::shared_ptr<DirectoryLock> DirectoryLock::acquire(const fs::path& dir, const std::string& file_name,
                                                      const std::string& what) {
  std::error_code ec;
  fs::path path = fs::weakly_canonical(dir / file_name, ec);
  if (ec) path = fs::absolute(dir / file_name);
  std::lock_guard<std::mutex> guard(registry_mutex());
  auto it = registry().find(path.string());
  if (it != registry().end()) {
    ++it->second.handles;
    return std::shared_ptr<DirectoryLock>(new DirectoryLock(path, it->second.fd));
  }
  // Another process may remove the file between our open and our flock (its
  // clean release): then we hold a lock on a name that no longer exists, so
  // check that the locked file is still the one at the path, else start over.
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      const int err = errno;
      raise(ErrorCategory::kIo, "{} {}: cannot create the lock file {}: {}", what, dir.string(), path.string(),
            std::strerror(err));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err != EWOULDBLOCK) {
        ::close(fd);
        raise(ErrorCategory::kIo, "{} {}: cannot lock {}: {}", what, dir.string(), path.string(), std::strerror(err));
      }
      // The holder writes its name right after taking the lock: give it a moment.
      std::string holder = read_all(fd);
      for (int wait = 0; wait < 20 && holder.empty(); ++wait) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        holder = read_all(fd);
      }
      ::close(fd);
      raise(ErrorCategory::kBadArgument,
            "{} {} is in use by another run: its lock {} is held by {}. Two runs sharing it would overwrite each "
            "other's files; wait for that run to end, or give this run another {}",
            what, dir.string(), path.string(), describe_holder(holder), what);
    }
    struct stat locked {}, named {};
    if (::fstat(fd, &locked) != 0 || ::stat(path.c_str(), &named) != 0 || locked.st_ino != named.st_ino ||
        locked.st_dev != named.st_dev) {
      ::close(fd);
      if (attempt < 100) continue;
      raise(ErrorCategory::kIo, "{} {}: the lock file {} keeps being replaced", what, dir.string(), path.string());
    }
    const std::string previous = read_all(fd);
    if (!previous.empty()) {
      logger().warn("{} {}: taking over the lock {} left by {}, which no longer runs (it ended without releasing it)",
                    what, dir.string(), path.string(), describe_holder(previous));
    }
    const std::string me = nlohmann::json{{"pid", static_cast<int64_t>(::getpid())},
                                          {"host", host_name()},
                                          {"started", now_text()},
                                          {"command", this_command()}}
                               .dump() +
                           "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
      const int err = errno;
      ::unlink(path.c_str());
      ::close(fd);
      raise(ErrorCategory::kIo, "{} {}: cannot write the lock file {}: {}", what, dir.string(), path.string(),
            std::strerror(err));
    }
    registry().emplace(path.string(), Held{fd, 1});
    return std::shared_ptr<DirectoryLock>(new DirectoryLock(path, fd));
  }
}

DirectoryLock::~DirectoryLock() {
  std::lock_guard<std::mutex> guard(registry_mutex());
  auto it = registry().find(path_.string());
  if (it == registry().end() || --it->second.handles > 0) return;
  // Removed while still locked, so no other run can lock the old file after we let go.
  ::unlink(path_.c_str());
  ::close(it->second.fd);
  registry().erase(it);
}

void remove_lock_files_for_exit() {
  std::lock_guard<std::mutex> guard(registry_mutex());
  for (const auto& [path, held] : registry()) ::unlink(path.c_str());
}

void ensure_run_directory(const fs::path& dir, const std::string& what) {
  if (dir.empty()) raise(ErrorCategory::kBadArgument, "{} is empty", what);
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  if (fs::is_directory(status)) return;
  if (fs::exists(status)) raise(ErrorCategory::kBadArgument, "{} {} is not a directory", what, dir.string());
  fs::path normal = fs::absolute(dir, ec).lexically_normal();
  if (normal.filename().empty()) normal = normal.parent_path();  // "swap/" names "swap"
  const fs::path parent = normal.parent_path();
  if (!fs::is_directory(parent, ec)) {
    raise(ErrorCategory::kBadArgument,
          "{} {} does not exist, and neither does its parent {}: create it first (strata creates only the last "
          "directory of the path, so that a mistyped path cannot fill another disk)",
          what, dir.string(), parent.string());
  }
  const bool created = fs::create_directory(normal, ec);
  if (ec) raise(ErrorCategory::kIo, "cannot create {} {}: {}", what, dir.string(), ec.message());
  if (created) logger().info("created {} {} (it did not exist)", what, dir.string());  // else another rank did
}

}  // namespace strata
