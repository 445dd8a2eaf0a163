// A temporary directory removed with its contents when the object dies.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace strata::test {

class TempDir {
 public:
  // Created under $STRATA_TEST_DIR if set (e.g. an NVMe mount), else the system temp dir.
  explicit TempDir(const std::string& prefix = "strata-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline TempDir::TempDir(const std::string& prefix) {
  const char* base = std::getenv("STRATA_TEST_DIR");
  std::filesystem::path root = base ? base : std::filesystem::temp_directory_path();
  std::string pattern = (root / (prefix + "-XXXXXX")).string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed: " + pattern);
  path_ = pattern;
}

inline TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace strata::test
