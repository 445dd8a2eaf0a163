// TokenFile (mmap + validation per format) and TokenLoader (windows, a keyed
// permutation per epoch, rank assignment).
#include "runtime/data/token_file.h"


#include <cstring>
#include <utility>

#include "core/error.h"
#include "runtime/data/prepared_file.h"
#include "runtime/data/sample_order.h"

namespace strata::data {
namespace {

int32_t read_i32_le(const unsigned char* p) {
  return static_cast<int32_t>(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                              static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24);
}

}  // namespace

std::string_view token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::kAuto: return "auto";
    case TokenFormat::kLlmc: return "llmc";
    case TokenFormat::kU16: return "u16";
    case TokenFormat::kU32: return "u32";
    case TokenFormat::kText: return "text";
  }
  return "?";
}

TokenFormat parse_token_format(std::string_view name) {
  for (TokenFormat f : {TokenFormat::kAuto, TokenFormat::kLlmc, TokenFormat::kU16,
                        TokenFormat::kU32, TokenFormat::kText}) {
    if (name == token_format_name(f)) return f;
  }
  raise(ErrorCategory::kBadArgument,
        "unknown token file format \"{}\" (expected auto, llmc, u16, u32 or text)", name);
}

TokenFile TokenFile::open(const std::string& path, TokenFormat format) {
  TokenFile f;
  f.path_ = path;
  f.file_ = MappedFile::open(path, "token file");
  const size_t nbytes = f.file_.size();
  const unsigned char* bytes = f.file_.bytes();
  if (format == TokenFormat::kAuto) {
    // By the first bytes, never by the name: a file that does not say what it is is refused.
    if (nbytes >= 4 && read_i32_le(bytes) == kLlmcMagic) {
      format = TokenFormat::kLlmc;
    } else {
      const bool prepared = is_prepared_data(bytes, nbytes);
      const bool json = nbytes > 0 && (bytes[0] == '{' || bytes[0] == '[');
      raise(ErrorCategory::kBadArgument,
            "{}: {}. --data-format auto reads llm.c token files (magic {}) and strata's prepared data (\"STRATAPD\", "
            "from `strata data prepare`); raw tokens need --data-format u16, u32 or text",
            path,
            prepared ? "is prepared data, which this reader does not read (a token stream was expected)"
            : json   ? "looks like JSON lines: prepare it first with `strata data prepare --model HF_DIR --input "
                       "FILE.jsonl --format chat|prompt-completion|text --out DATA`"
                     : "its format cannot be told from its first bytes",
            kLlmcMagic);
    }
  }
  f.format_ = format;
  switch (format) {
    case TokenFormat::kLlmc: {
      STRATA_CHECK(nbytes >= static_cast<size_t>(kLlmcHeaderBytes), kBadArgument,
                   "{}: {} bytes, shorter than llm.c's {}-byte header", path, nbytes,
                   kLlmcHeaderBytes);
      const int32_t magic = read_i32_le(bytes), version = read_i32_le(bytes + 4),
                    count = read_i32_le(bytes + 8);
      STRATA_CHECK(magic == kLlmcMagic, kBadArgument,
                   "{}: not an llm.c token file (magic {}, expected {})", path, magic, kLlmcMagic);
      STRATA_CHECK(version == 1, kBadArgument,
                   "{}: llm.c token file version {} is not supported (expected 1: uint16 tokens)",
                   path, version);
      const size_t data = nbytes - static_cast<size_t>(kLlmcHeaderBytes);
      STRATA_CHECK(count >= 0 && data == static_cast<size_t>(count) * 2, kBadArgument,
                   "{}: the header says {} tokens ({} bytes) but {} bytes follow it (truncated or "
                   "corrupt)",
                   path, count, static_cast<int64_t>(count) * 2, data);
      f.tokens_ = bytes + kLlmcHeaderBytes;
      f.count_ = count;
      f.width_ = 2;
      break;
    }
    case TokenFormat::kU16:
    case TokenFormat::kU32: {
      f.width_ = format == TokenFormat::kU16 ? 2 : 4;
      STRATA_CHECK(nbytes % static_cast<size_t>(f.width_) == 0, kBadArgument,
                   "{}: {} bytes is not a whole number of {}-byte tokens (truncated?)", path,
                   nbytes, f.width_);
      f.tokens_ = bytes;
      f.count_ = static_cast<int64_t>(nbytes) / f.width_;
      break;
    }
    case TokenFormat::kText:
      f.width_ = 1;
      f.tokens_ = bytes;
      f.count_ = static_cast<int64_t>(nbytes);
      break;
    case TokenFormat::kAuto: break;
  }
  return f;
}

int64_t TokenFile::token(int64_t i) const {
  const unsigned char* p = tokens_ + i * width_;
  switch (width_) {
    case 1: return p[0];
    case 2: return static_cast<int64_t>(p[0] | p[1] << 8);
    default:
      return static_cast<int64_t>(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                                  static_cast<uint32_t>(p[2]) << 16 |
                                  static_cast<uint32_t>(p[3]) << 24);
  }
}

TokenLoader::TokenLoader(const TokenFile& file, TokenLoaderOptions options)
    : file_(file), options_(options) {
  STRATA_CHECK(options.seq > 0 && options.micro_batch > 0 && options.world > 0 &&
                   options.rank >= 0 && options.rank < options.world,
               kBadArgument, "token loader: bad options seq={} micro_batch={} rank={} world={}",
               options.seq, options.micro_batch, options.rank, options.world);
  STRATA_CHECK(file.size() >= options.seq + 1, kBadArgument,
               "{}: {} tokens is shorter than one sample of seq {} + 1 (ids and the next token)",
               file.path(), file.size(), options.seq);
  windows_ = (file.size() - 1) / options.seq;
}

int64_t TokenLoader::window_of(uint64_t sample) const {
  return window_of_sample(sample, windows_, options_.seed);
}

void TokenLoader::next(std::vector<int32_t>& ids, std::vector<int32_t>& targets) {
  const int64_t seq = options_.seq, mb = options_.micro_batch;
  ids.resize(static_cast<size_t>(mb * seq));
  targets.resize(ids.size());
  const uint64_t first = cursor_ + static_cast<uint64_t>(options_.rank * mb);
  for (int64_t s = 0; s < mb; ++s) {
    const int64_t start = window_of(first + static_cast<uint64_t>(s)) * seq;
    for (int64_t t = 0; t <= seq; ++t) {
      const int64_t tok = file_.token(start + t);
      STRATA_CHECK(options_.vocab <= 0 || tok < options_.vocab, kBadArgument,
                   "{}: token {} at position {} is outside the model's vocabulary [0, {})",
                   file_.path(), tok, start + t, options_.vocab);
      if (t < seq) ids[static_cast<size_t>(s * seq + t)] = static_cast<int32_t>(tok);
      if (t > 0) targets[static_cast<size_t>(s * seq + t - 1)] = static_cast<int32_t>(tok);
    }
  }
  cursor_ += static_cast<uint64_t>(mb * options_.world);
}

}  // namespace strata::data
