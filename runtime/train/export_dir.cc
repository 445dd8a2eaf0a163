// ExportStaging: a staging directory swapped with the target in one rename.
#include "runtime/train/export_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "core/durable_file.h"
#include "core/error.h"
#include "core/log.h"

namespace strata::train {
namespace fs = std::filesystem;
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

[[noreturn]] void fail(int err, const std::string& what) {
  throw Error(ErrorCategory::kIo, fmt::format("{}: {} (errno {})", what, std::strerror(err), err));
}

std::string staging_prefix(const fs::path& target) { return "." + target.filename().string() + ".strata-export-"; }

// Staging directories of exports into `target` whose process is gone.
void remove_stale_staging(const fs::path& target) {
  const std::string prefix = staging_prefix(target);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(target.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    try {
      const long pid = std::stol(name.substr(prefix.size()));
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        std::error_code ignored;
        fs::remove_all(entry.path(), ignored);
      }
    } catch (const std::exception&) {
      // Not ours.
    }
  }
}

// Links (or, where a link is refused, copies) `from` into `to`, recursively.
void carry(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(from, ec);
  if (fs::is_symlink(status)) {
    fs::copy_symlink(from, to, ec);
  } else if (fs::is_directory(status)) {
    fs::create_directory(to, ec);
    if (!ec) {
      for (const auto& entry : fs::directory_iterator(from, ec)) carry(entry.path(), to / entry.path().filename());
    }
  } else if (::link(from.c_str(), to.c_str()) != 0) {
    fs::copy_file(from, to, ec);
  }
  if (ec) raise(ErrorCategory::kIo, "cannot carry {} over into the new export: {}", from.string(), ec.message());
}

}  // namespace

bool is_weight_file_name(const std::string& name) {
  if (ends_with(name, ".safetensors") || ends_with(name, ".safetensors.index.json")) return true;
  if (name.rfind("pytorch_model", 0) == 0 && (ends_with(name, ".bin") || ends_with(name, ".bin.index.json"))) {
    return true;
  }
  // Temporaries of an interrupted earlier writer.
  return name.find(".safetensors.tmp") != std::string::npos || name.find(".index.json.tmp") != std::string::npos;
}

ExportStaging::ExportStaging(fs::path target) {
  std::error_code ec;
  target_ = fs::absolute(target, ec).lexically_normal();
  if (target_.filename().empty()) target_ = target_.parent_path();  // "out/model/" names "out/model"
  const fs::file_status status = fs::status(target_, ec);
  if (fs::exists(status) && !fs::is_directory(status)) {
    raise(ErrorCategory::kBadArgument, "the export directory {} exists and is not a directory", target.string());
  }
  fs::create_directories(target_.parent_path(), ec);
  if (ec) {
    raise(ErrorCategory::kIo, "cannot create {} (for the export {}): {}", target_.parent_path().string(),
          target.string(), ec.message());
  }
  remove_stale_staging(target_);
  staging_ = target_.parent_path() / (staging_prefix(target_) + std::to_string(::getpid()));
  fs::remove_all(staging_, ec);
  if (!fs::create_directory(staging_, ec) || ec) {
    raise(ErrorCategory::kIo, "cannot create the staging directory {} for the export {}: {}", staging_.string(),
          target.string(), ec ? ec.message() : "it exists");
  }
}

ExportStaging::~ExportStaging() {
  if (committed_) return;
  std::error_code ignored;
  fs::remove_all(staging_, ignored);
}

void ExportStaging::commit() {
  STRATA_CHECK(!committed_, kInternal, "export {} committed twice", target_.string());
  std::error_code ec;
  if (!fs::exists(target_, ec)) {
    sync_directory(staging_);
    rename_durably(staging_, target_);
    committed_ = true;
    return;
  }
  std::set<std::string> written;
  for (const auto& entry : fs::directory_iterator(staging_)) written.insert(entry.path().filename().string());
  // A symbolic link to the directory stays a link, and the working directory
  // stays where the process is: those are updated in place.
  const bool exchange =
      !fs::is_symlink(fs::symlink_status(target_, ec)) && !fs::equivalent(target_, fs::current_path(), ec);
  if (exchange) {
    for (const auto& entry : fs::directory_iterator(target_)) {
      const std::string name = entry.path().filename().string();
      if (written.count(name) == 0 && !is_weight_file_name(name)) carry(entry.path(), staging_ / name);
    }
  }
  sync_directory(staging_);
  if (exchange && ::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) == 0) {
    committed_ = true;
    sync_directory(target_.parent_path());
    fs::remove_all(staging_, ec);  // the old contents now
    if (ec) logger().warn("could not remove the previous export, now at {}: {}", staging_.string(), ec.message());
    return;
  }
  const int err = exchange ? errno : EINVAL;
  if (err != EINVAL && err != ENOSYS && err != EBUSY && err != EXDEV && err != EPERM && err != ENOTSUP) {
    fail(err, fmt::format("swapping the new export {} into place as {}", staging_.string(), target_.string()));
  }
  // In place: the old weights go first, so the directory never holds two exports' weights.
  for (const auto& entry : fs::directory_iterator(target_)) {
    const std::string name = entry.path().filename().string();
    if (is_weight_file_name(name) && written.count(name) == 0) {
      fs::remove(entry.path(), ec);
      if (ec) {
        raise(ErrorCategory::kIo, "cannot remove {} of the previous export: {}", entry.path().string(), ec.message());
      }
    }
  }
  sync_directory(target_);
  for (const std::string& name : written) {
    if (::rename((staging_ / name).c_str(), (target_ / name).c_str()) != 0) {
      if (errno != EXDEV) fail(errno, fmt::format("moving {} into {}", (staging_ / name).string(), target_.string()));
      fs::copy_file(staging_ / name, target_ / name, fs::copy_options::overwrite_existing, ec);
      if (ec) raise(ErrorCategory::kIo, "cannot copy {} into {}: {}", name, target_.string(), ec.message());
    }
  }
  sync_directory(target_);
  committed_ = true;
  fs::remove_all(staging_, ec);
}

}  // namespace strata::train
