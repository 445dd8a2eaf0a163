// SwapSpace: stable per-(group, rank) directory of preallocated swap files.
#include "nvme/swap_space.h"

#include <sys/statvfs.h>

#include <cerrno>
#include <mutex>
#include <set>
#include <system_error>

#include "core/error.h"
#include "core/log.h"

namespace strata::nvme {
namespace {

void check_name(std::string_view what, const std::string& name) {
  STRATA_CHECK(!name.empty() && name != "." && name != "..", kBadArgument,
               "swap {} '{}' must be a non-empty file name", what, name);
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    STRATA_CHECK(ok, kBadArgument,
                 "swap {} '{}' may contain only letters, digits, '.', '_' and '-'", what, name);
  }
}

// The live SwapSpaces of this process, for remove_live_files_for_exit.
std::mutex& live_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::set<SwapSpace*>& live_spaces() {
  static auto* live = new std::set<SwapSpace*>();  // never destroyed: a signal may come during exit
  return *live;
}

}  // namespace

uint64_t free_space_nbytes(const std::filesystem::path& path) {
  struct statvfs st {};
  check_errno(::statvfs(path.c_str(), &st), fmt::format("statvfs {}", path.string()));
  return static_cast<uint64_t>(st.f_bavail) * static_cast<uint64_t>(st.f_frsize);
}

SwapSpace::SwapSpace(SwapSpaceOptions options) : options_(std::move(options)) {
  STRATA_CHECK(!options_.root.empty(), kBadArgument, "swap space root directory is empty");
  STRATA_CHECK(options_.rank >= 0, kBadArgument, "swap space rank {} is negative", options_.rank);
  check_name("group", options_.group);
  dir_ = options_.root / options_.group / fmt::format("rank{}", options_.rank);
  ensure_run_directory(options_.root, "nvme_path");
  lock_ = DirectoryLock::acquire(options_.root, rank_lock_file_name(options_.rank), "nvme_path");
  // Ranks share root/group and each removes it when it is left empty (remove_all), so another
  // rank's cleanup can take the group directory away between create_directories' two mkdirs.
  // Creating again is safe; a bounded number of tries keeps a real failure an error.
  std::error_code ec;
  for (int attempt = 0; attempt < 100; ++attempt) {
    ec.clear();
    std::filesystem::create_directories(dir_, ec);
    if (ec != std::errc::no_such_file_or_directory) break;
  }
  if (ec) {
    raise(ErrorCategory::kIo, "cannot create swap directory {} (rank {}): {}", dir_.string(),
          options_.rank, ec.message());
  }
  std::lock_guard<std::mutex> guard(live_mutex());
  keep_ = options_.keep_files;
  live_spaces().insert(this);
}

void SwapSpace::keep() {
  std::lock_guard<std::mutex> guard(live_mutex());
  keep_ = true;
}

uint64_t SwapSpace::remove_live_files_for_exit() {
  std::lock_guard<std::mutex> guard(live_mutex());
  uint64_t removed = 0;
  for (SwapSpace* space : live_spaces()) {
    if (space->keep_) continue;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(space->dir_, ec)) {
      std::error_code file_ec;
      if (!entry.is_regular_file(file_ec)) continue;
      const uint64_t nbytes = entry.file_size(file_ec);
      if (std::filesystem::remove(entry.path(), file_ec)) removed += file_ec ? 0 : nbytes;
    }
    std::filesystem::remove(space->dir_, ec);
    std::filesystem::remove(space->dir_.parent_path(), ec);
  }
  return removed;
}

SwapSpace::~SwapSpace() {
  {
    std::lock_guard<std::mutex> guard(live_mutex());
    live_spaces().erase(this);
  }
  if (keep_) {
    for (auto& [key, file] : files_) file.close();
    return;
  }
  try {
    remove_all();
  } catch (const std::exception& e) {
    logger().warn("could not remove swap space {}: {}", dir_.string(), e.what());
  }
}

std::filesystem::path SwapSpace::path_for(const std::string& key) const {
  check_name("key", key);
  return dir_ / (key + ".swp");
}

void SwapSpace::create(const std::vector<SwapFileSpec>& files) {
  // Room needed beyond what files already on disk hold (a resumed run reuses them).
  uint64_t needed = 0, total = 0;
  for (const auto& spec : files) {
    std::filesystem::path path = path_for(spec.key);
    std::error_code ec;
    uint64_t existing = std::filesystem::exists(path, ec) ? std::filesystem::file_size(path, ec) : 0;
    if (ec) existing = 0;
    if (spec.nbytes > existing) needed += spec.nbytes - existing;
    total += spec.nbytes;
  }
  uint64_t available = free_space_nbytes(dir_);
  if (needed > available) {
    raise(ErrorCategory::kIo,
          "swap space {} (group '{}', rank {}) needs {} more bytes for {} files ({} bytes in "
          "all) but the filesystem has only {} bytes free",
          dir_.string(), options_.group, options_.rank, needed, files.size(), total, available);
  }
  for (const auto& spec : files) create(spec);
}

File& SwapSpace::create(const SwapFileSpec& spec) {
  std::filesystem::path path = path_for(spec.key);
  auto it = files_.find(spec.key);
  if (it == files_.end()) {
    it = files_.emplace(spec.key, File::open(path.string(), OpenMode::kReadWrite, options_.direct))
             .first;
  }
  try {
    it->second.allocate(spec.nbytes);
  } catch (const Error& e) {
    raise(ErrorCategory::kIo, "swap file for key '{}' (group '{}', rank {}): {}", spec.key,
          options_.group, options_.rank, e.message());
  }
  sizes_[spec.key] = std::max(sizes_[spec.key], spec.nbytes);
  return it->second;
}

File& SwapSpace::file(const std::string& key) {
  auto it = files_.find(key);
  STRATA_CHECK(it != files_.end(), kBadArgument, "no swap file with key '{}' in {}", key,
               dir_.string());
  return it->second;
}

uint64_t SwapSpace::total_nbytes() const {
  uint64_t total = 0;
  for (const auto& [key, nbytes] : sizes_) total += nbytes;
  return total;
}

void SwapSpace::remove_all() {
  std::error_code ec;
  for (auto& [key, file] : files_) {
    file.close();
    std::filesystem::remove(path_for(key), ec);
  }
  files_.clear();
  sizes_.clear();
  // Only empty directories are removed: files not created by us stay.
  std::filesystem::remove(dir_, ec);
  std::filesystem::remove(dir_.parent_path(), ec);
}

}  // namespace strata::nvme
