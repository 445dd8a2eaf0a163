// PreparedFile: mmap and validation of the prepared-data format.
#include "runtime/data/prepared_file.h"


#include <cstring>
#include <utility>

#include "core/error.h"

namespace strata::data {
namespace {

uint64_t read_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

}  // namespace

bool is_prepared_data(const unsigned char* bytes, size_t nbytes) {
  return nbytes >= 8 && std::memcmp(bytes, kPreparedMagic, 8) == 0;
}

PreparedFile PreparedFile::open(const std::string& path) {
  PreparedFile f;
  f.path_ = path;
  f.file_ = MappedFile::open(path, "prepared data file");
  const size_t nbytes = f.file_.size();
  const unsigned char* b = f.file_.bytes();
  STRATA_CHECK(nbytes >= static_cast<size_t>(kPreparedHeaderBytes) && is_prepared_data(b, nbytes), kBadArgument,
               "{}: not a strata prepared-data file (no \"STRATAPD\" header; make one with `strata data prepare`)",
               path);
  const uint64_t version = read_le(b + 8, 4), header = read_le(b + 12, 4);
  STRATA_CHECK(version == kPreparedVersion && header == static_cast<uint64_t>(kPreparedHeaderBytes), kBadArgument,
               "{}: prepared-data version {} is not supported (this strata reads version {}); prepare it again",
               path, version, kPreparedVersion);
  const uint64_t n = read_le(b + 16, 8), d = read_le(b + 24, 8), vocab = read_le(b + 32, 8);
  // Sizes that would overflow are as wrong as sizes that disagree with the file.
  constexpr uint64_t kLimit = uint64_t{1} << 56;
  const bool plausible = n < kLimit && d < kLimit && vocab < kLimit;
  const uint64_t mask_at = kPreparedHeaderBytes + 4 * n;
  const uint64_t offsets_at = (mask_at + (n + 7) / 8 + 7) / 8 * 8;
  const uint64_t expected = offsets_at + 8 * (d + 1);
  STRATA_CHECK(plausible && expected == nbytes, kBadArgument,
               "{}: {} bytes, but its header says {} tokens in {} documents, which take {} bytes (truncated or "
               "corrupt; prepare it again)",
               path, nbytes, n, d, plausible ? expected : 0);
  STRATA_CHECK(d > 0 && n > 0, kBadArgument, "{}: holds no documents", path);
  f.token_bytes_ = b + kPreparedHeaderBytes;
  f.mask_ = b + mask_at;
  f.offsets_ = b + offsets_at;
  f.tokens_count_ = static_cast<int64_t>(n);
  f.documents_ = static_cast<int64_t>(d);
  f.vocab_ = static_cast<int64_t>(vocab);
  uint64_t previous = read_le(f.offsets_, 8);
  STRATA_CHECK(previous == 0, kBadArgument, "{}: the first document offset is {}, not 0 (corrupt)", path, previous);
  for (uint64_t i = 1; i <= d; ++i) {
    const uint64_t offset = read_le(f.offsets_ + 8 * i, 8);
    STRATA_CHECK(offset > previous && offset <= n, kBadArgument,
                 "{}: document {} ends at token {}, not after its start {} and within the {} tokens (corrupt)", path,
                 i - 1, offset, previous, n);
    previous = offset;
  }
  STRATA_CHECK(previous == n, kBadArgument, "{}: the documents end at token {}, the file holds {} (corrupt)", path,
               previous, n);
  return f;
}

int64_t PreparedFile::document_begin(int64_t d) const { return static_cast<int64_t>(read_le(offsets_ + 8 * d, 8)); }

uint32_t PreparedFile::token(int64_t i) const { return static_cast<uint32_t>(read_le(token_bytes_ + 4 * i, 4)); }

}  // namespace strata::data
