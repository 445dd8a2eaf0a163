// strata's prepared-data format (runtime/data/prepared_file.h) written by the
// tests, independently of the Python writer: documents of ids with their
// loss-mask bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace strata::test {

struct Doc {
  std::vector<uint32_t> ids;
  std::vector<bool> trained;
};

// The layout as docs/DESIGN.md describes it, written independently of the Python writer.
inline std::string prepared_bytes(const std::vector<Doc>& docs, uint64_t vocab) {
  std::vector<uint32_t> tokens;
  std::vector<bool> bits;
  std::vector<uint64_t> offsets{0};
  for (const Doc& d : docs) {
    tokens.insert(tokens.end(), d.ids.begin(), d.ids.end());
    bits.insert(bits.end(), d.trained.begin(), d.trained.end());
    offsets.push_back(tokens.size());
  }
  const uint64_t n = tokens.size(), count = docs.size();
  std::string out(64, '\0');
  std::memcpy(out.data(), "STRATAPD", 8);
  const uint32_t version = 1, header = 64;
  std::memcpy(out.data() + 8, &version, 4);
  std::memcpy(out.data() + 12, &header, 4);
  std::memcpy(out.data() + 16, &n, 8);
  std::memcpy(out.data() + 24, &count, 8);
  std::memcpy(out.data() + 32, &vocab, 8);
  out.append(reinterpret_cast<const char*>(tokens.data()), n * 4);
  std::string mask((n + 7) / 8, '\0');
  for (size_t t = 0; t < n; ++t) {
    if (bits[t]) mask[t / 8] = static_cast<char>(mask[t / 8] | 1 << (t % 8));
  }
  out += mask;
  out.resize((out.size() + 7) / 8 * 8, '\0');
  out.append(reinterpret_cast<const char*>(offsets.data()), offsets.size() * 8);
  return out;
}

inline void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline Doc doc(uint32_t first, size_t n, std::vector<bool> trained = {}) {
  Doc d;
  for (size_t i = 0; i < n; ++i) d.ids.push_back(first + static_cast<uint32_t>(i));
  d.trained = trained.empty() ? std::vector<bool>(n, true) : trained;
  return d;
}

}  // namespace strata::test
