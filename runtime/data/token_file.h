// Token files for training, read-only and memory-mapped, and the deterministic
// loader that cuts them into (ids, targets) micro-batches for each rank.
//
// Formats (TokenFormat):
//   kLlmc   llm.c's .bin: a header of 256 little-endian int32 — [0] magic
//           20240520, [1] version 1, [2] token count — then that many uint16
//           tokens. The count must match the file size exactly.
//   kU16    raw little-endian uint16 tokens, no header.
//   kU32    raw little-endian uint32 tokens, no header.
//   kText   any file as bytes: each byte is a token (vocabulary 256), for demos.
// kAuto picks kLlmc when the file starts with the llm.c magic and refuses
// any other file, naming the formats (a name says nothing about the bytes:
// train.jsonl read as uint16 would train on byte pairs). Prepared data
// (prepared_file.h) is read by the batch sources (batches.h), not here.
//
// Samples: the stream of N tokens is cut into W = (N - 1) / seq windows of
// seq + 1 tokens (window w starts at token w * seq); a sample's ids are the
// first seq tokens of a window, its targets the last seq (the next token).
// Every epoch visits every window once in an order fixed by (seed, epoch);
// global sample g of a step goes to rank (g / micro_batch) % world, so ranks
// read disjoint samples and the world size does not change which samples a
// step uses. The cursor (samples consumed) is the whole state to checkpoint.
//
// Ownership: TokenFile owns its mapping; a TokenLoader borrows its TokenFile.
// Thread-safety: TokenFile is immutable after open (any thread may read);
// TokenLoader is not thread-safe.
// Errors: Error(kIo) when the file cannot be opened or mapped (with errno
// text), Error(kBadArgument) for a corrupt or too-short file and for a token
// outside the vocabulary — each naming the file and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/data/mapped_file.h"

namespace strata::data {

enum class TokenFormat : uint8_t { kAuto, kLlmc, kU16, kU32, kText };
std::string_view token_format_name(TokenFormat format);  // "llmc", "u16", "u32", "text"
// Parses "auto", "llmc", "u16", "u32", "text"; throws Error(kBadArgument).
TokenFormat parse_token_format(std::string_view name);

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

class TokenFile {
 public:
  static TokenFile open(const std::string& path, TokenFormat format = TokenFormat::kAuto);
  TokenFile(TokenFile&&) noexcept = default;  // the mapping moves, its address stays
  TokenFile& operator=(TokenFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }
  int64_t size() const { return count_; }  // tokens
  int64_t token(int64_t i) const;          // 0 <= i < size()

 private:
  TokenFile() = default;

  std::string path_;
  TokenFormat format_ = TokenFormat::kAuto;
  MappedFile file_;
  const unsigned char* tokens_ = nullptr;  // first token
  int64_t count_ = 0;
  int width_ = 2;  // bytes per token
};

struct TokenLoaderOptions {
  int64_t seq = 0;          // tokens per sample (targets are the next tokens)
  int64_t micro_batch = 1;  // samples per rank per micro-batch
  int rank = 0, world = 1;
  uint64_t seed = 0;        // order of windows within each epoch
  int64_t vocab = 0;        // > 0: tokens must be < vocab
};

class TokenLoader {
 public:
  // Throws kBadArgument naming the file when it holds fewer than seq + 1
  // tokens (not one whole sample), or for invalid options.
  TokenLoader(const TokenFile& file, TokenLoaderOptions options);

  // This rank's next micro-batch: ids and targets, each [micro_batch * seq],
  // and advances the cursor past the whole world's micro-batch. Throws
  // kBadArgument naming the file and token offset for a token >= vocab.
  void next(std::vector<int32_t>& ids, std::vector<int32_t>& targets);

  // Samples consumed so far by all ranks together; restore with set_cursor.
  uint64_t cursor() const { return cursor_; }
  void set_cursor(uint64_t cursor) { cursor_ = cursor; }
  int64_t windows() const { return windows_; }  // samples per epoch
  uint64_t epoch() const { return cursor_ / static_cast<uint64_t>(windows_); }

 private:
  int64_t window_of(uint64_t sample) const;  // the window global sample `sample` reads

  const TokenFile& file_;
  TokenLoaderOptions options_;
  int64_t windows_ = 0;
  uint64_t cursor_ = 0;
};

}  // namespace strata::data
