// strata's prepared-data file, written by `strata data prepare`
// (python/strata_data/prepared_format.py holds the writer and the same
// description): documents of tokens with a loss-mask bit per token.
//
//   offset 0   8 bytes   magic "STRATAPD"
//          8   u32       version (1)
//         12   u32       header bytes (64)
//         16   u64       N, the token count
//         24   u64       D, the document count
//         32   u64       V, the tokenizer's vocabulary size (every id < V)
//         40   24 bytes  zero
//         64   u32 x N   token ids, documents one after another
//              u8 x ceil(N / 8)  loss mask: bit (t % 8) of byte t / 8 is 1 when
//                        token t is a training target (predicted from the
//                        tokens before it in its document)
//              zero bytes up to a multiple of 8
//              u64 x (D + 1)  document offsets 0 = o_0 < o_1 < ... < o_D = N
// All integers little-endian; the file size is exactly what N and D say.
//
// Ownership: owns its read-only mapping. Thread-safety: immutable after open.
// Errors: Error(kIo) when the file cannot be read, Error(kBadArgument) naming
// the file and what is wrong for anything else (magic, version, a size that
// disagrees with the header: truncated, offsets out of order).
#pragma once

#include <cstdint>
#include <string>

#include "runtime/data/mapped_file.h"

namespace strata::data {

inline constexpr char kPreparedMagic[9] = "STRATAPD";
inline constexpr uint32_t kPreparedVersion = 1;
inline constexpr int64_t kPreparedHeaderBytes = 64;

// Whether the first bytes of a file are the prepared-data magic.
bool is_prepared_data(const unsigned char* bytes, size_t nbytes);

class PreparedFile {
 public:
  static PreparedFile open(const std::string& path);
  PreparedFile(PreparedFile&&) noexcept = default;  // the mapping moves, its address stays
  PreparedFile& operator=(PreparedFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  int64_t tokens() const { return tokens_count_; }
  int64_t documents() const { return documents_; }
  int64_t vocab_size() const { return vocab_; }
  int64_t document_begin(int64_t d) const;  // first token of document d
  int64_t document_end(int64_t d) const { return document_begin(d + 1); }
  uint32_t token(int64_t i) const;
  bool trained(int64_t i) const { return (mask_[i / 8] >> (i % 8) & 1) != 0; }

 private:
  PreparedFile() = default;

  std::string path_;
  MappedFile file_;
  const unsigned char* token_bytes_ = nullptr;
  const unsigned char* mask_ = nullptr;
  const unsigned char* offsets_ = nullptr;
  int64_t tokens_count_ = 0, documents_ = 0, vocab_ = 0;
};

}  // namespace strata::data
