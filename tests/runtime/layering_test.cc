// The floors (docs/DESIGN.md §2): every #include of a strata header in the
// library folders points at the same floor or one below — core at the
// bottom; kernels, nvme and partition on it, not knowing each other; offload
// above them; runtime on top. Reads the source tree as committed.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>
#include "tests/support/test_paths.h"

namespace fs = std::filesystem;

namespace {

// A folder's floor; folders on one floor may include each other only when
// they are the same folder.
const std::map<std::string, int> kFloor = {
    {"core", 0}, {"kernels", 1}, {"nvme", 1}, {"partition", 1}, {"offload", 2}, {"runtime", 3},
};

std::string top_folder(const std::string& path) { return path.substr(0, path.find('/')); }

}  // namespace

TEST_CASE("no library folder includes a header from a floor above it, or from a sibling on its floor") {
  const fs::path root = strata::test::source_dir();
  const std::regex include(R"(^\s*#\s*include\s+"([a-z_]+/[^"]+)\")");
  std::vector<std::string> violations;
  size_t files = 0, includes = 0;
  for (const auto& [folder, floor] : kFloor) {
    for (const auto& entry : fs::recursive_directory_iterator(root / folder)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() || (ext != ".h" && ext != ".cc" && ext != ".cu" && ext != ".cuh")) continue;
      ++files;
      std::ifstream in(entry.path());
      int line_number = 0;
      for (std::string line; std::getline(in, line);) {
        ++line_number;
        std::smatch m;
        if (!std::regex_search(line, m, include)) continue;
        const std::string target = top_folder(m[1].str());
        const auto it = kFloor.find(target);
        if (it == kFloor.end()) continue;  // a third-party header
        ++includes;
        const bool up = it->second > floor;
        const bool sideways = it->second == floor && target != folder;
        if (up || sideways) {
          violations.push_back(fs::relative(entry.path(), root).string() + ":" + std::to_string(line_number) +
                               " includes " + m[1].str() + (up ? " (a floor above)" : " (a sibling floor)"));
        }
      }
    }
  }
  INFO(files << " files, " << includes << " strata includes");
  for (const auto& v : violations) UNSCOPED_INFO(v);
  CHECK(files > 100);
  CHECK(includes > 300);
  CHECK(violations.empty());
}
