// Token files (llm.c .bin, raw uint16/uint32, text bytes) and the loader:
// formats, corrupt and short files, determinism, rank disjointness, epochs and
// the checkpointable cursor.
#include <catch2/catch.hpp>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"
#include "runtime/data/token_file.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::data;

namespace {

void write_llmc(const std::string& path, const std::vector<uint16_t>& tokens, int32_t magic = kLlmcMagic,
                int32_t version = 1, int64_t claimed = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(claimed >= 0 ? claimed : static_cast<int64_t>(tokens.size()));
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
}

std::vector<uint16_t> iota_tokens(size_t n) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i % 1000);
  return t;
}

}  // namespace

TEST_CASE("token files: llm.c, raw and text formats", "[data]") {
  test::TempDir dir("data-formats");
  write_llmc(dir.file("a.bin"), iota_tokens(100));
  const TokenFile a = TokenFile::open(dir.file("a.bin"));
  CHECK(a.format() == TokenFormat::kLlmc);
  CHECK(a.size() == 100);
  CHECK(a.token(57) == 57);

  std::vector<uint32_t> wide = {70000, 1, 2};
  std::ofstream(dir.file("w.u32"), std::ios::binary)
      .write(reinterpret_cast<const char*>(wide.data()), 12);
  const TokenFile w = TokenFile::open(dir.file("w.u32"), TokenFormat::kU32);
  CHECK(w.format() == TokenFormat::kU32);
  CHECK(w.token(0) == 70000);

  std::ofstream(dir.file("t.txt")) << "hello";
  const TokenFile t = TokenFile::open(dir.file("t.txt"), TokenFormat::kText);
  CHECK(t.format() == TokenFormat::kText);
  CHECK(t.size() == 5);
  CHECK(t.token(1) == 'e');
  CHECK(parse_token_format("u16") == TokenFormat::kU16);
  REQUIRE_THROWS_WITH(parse_token_format("u8"), Catch::Contains("expected auto, llmc"));
  // auto goes by the bytes, never by the name: anything but llm.c's magic is refused, naming the formats.
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("t.txt")),
                      Catch::Contains("t.txt") && Catch::Contains("cannot be told from its first bytes") &&
                          Catch::Contains("--data-format u16, u32 or text"));
  std::ofstream(dir.file("train.jsonl")) << "{\"messages\": []}\n";
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("train.jsonl")),
                      Catch::Contains("train.jsonl") && Catch::Contains("strata data prepare"));
}

TEST_CASE("corrupt, truncated and short token files are clear errors", "[data]") {
  test::TempDir dir("data-bad");
  write_llmc(dir.file("trunc.bin"), iota_tokens(100), kLlmcMagic, 1, /*claimed=*/200);
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("trunc.bin")),
                      Catch::Contains("trunc.bin") && Catch::Contains("says 200 tokens"));
  write_llmc(dir.file("v2.bin"), iota_tokens(10), kLlmcMagic, 2);
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("v2.bin")), Catch::Contains("version 2"));
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("v2.bin"), TokenFormat::kLlmc),
                      Catch::Contains("version 2"));
  std::ofstream(dir.file("head.bin"), std::ios::binary) << "abc";
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("head.bin")), Catch::Contains("cannot be told"));
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("head.bin"), TokenFormat::kLlmc),
                      Catch::Contains("shorter than llm.c's"));
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("head.bin"), TokenFormat::kU16),
                      Catch::Contains("not a whole number"));
  REQUIRE_THROWS_WITH(TokenFile::open(dir.file("absent.bin")), Catch::Contains("absent.bin"));
  REQUIRE_THROWS_WITH(TokenFile::open(dir.path()), Catch::Contains("not a regular file"));

  write_llmc(dir.file("short.bin"), iota_tokens(8));
  const TokenFile s = TokenFile::open(dir.file("short.bin"));
  REQUIRE_THROWS_WITH(TokenLoader(s, {.seq = 8}),
                      Catch::Contains("short.bin") && Catch::Contains("shorter than one sample"));
  TokenLoaderOptions o{.seq = 4, .vocab = 4};  // the window holds tokens 0..4
  TokenLoader l(s, o);
  std::vector<int32_t> ids, targets;
  REQUIRE_THROWS_WITH(l.next(ids, targets), Catch::Contains("outside the model's vocabulary"));
}

TEST_CASE("the loader: targets are the next tokens, ranks disjoint, epochs cover every window",
          "[data]") {
  test::TempDir dir("data-loader");
  write_llmc(dir.file("d.bin"), iota_tokens(1 + 10 * 7));  // exactly 10 windows of seq 7
  const TokenFile f = TokenFile::open(dir.file("d.bin"));
  std::multiset<int32_t> starts;
  std::vector<int32_t> ids, targets;
  std::vector<std::vector<int32_t>> by_rank(2);
  TokenLoader r0(f, {.seq = 7, .micro_batch = 1, .rank = 0, .world = 2, .seed = 3});
  TokenLoader r1(f, {.seq = 7, .micro_batch = 1, .rank = 1, .world = 2, .seed = 3});
  CHECK(r0.windows() == 10);
  for (int step = 0; step < 5; ++step) {  // one epoch: 5 steps x 2 ranks
    for (TokenLoader* l : {&r0, &r1}) {
      l->next(ids, targets);
      REQUIRE(ids.size() == 7);
      for (int t = 0; t + 1 < 7; ++t) CHECK(targets[t] == ids[t + 1]);
      CHECK(targets[6] == ids[6] + 1);
      CHECK(ids[0] % 7 == 0);  // a window start
      starts.insert(ids[0]);
    }
  }
  CHECK(starts.size() == 10);
  CHECK(std::set<int32_t>(starts.begin(), starts.end()).size() == 10);  // each window once
  CHECK(r0.epoch() == 1);

  // The same seed and cursor give the same samples; a restored cursor resumes exactly.
  TokenLoader a(f, {.seq = 7, .micro_batch = 2, .seed = 9});
  TokenLoader b(f, {.seq = 7, .micro_batch = 2, .seed = 9});
  std::vector<int32_t> ia, ta, ib, tb;
  a.next(ia, ta);
  a.next(ia, ta);
  b.set_cursor(2);
  b.next(ib, tb);
  CHECK(ia == ib);
  // A different seed orders the epoch differently.
  TokenLoader c(f, {.seq = 7, .micro_batch = 10, .seed = 10});
  TokenLoader d(f, {.seq = 7, .micro_batch = 10, .seed = 11});
  c.next(ia, ta);
  d.next(ib, tb);
  CHECK(ia != ib);
  // ...but one epoch still visits every window once.
  std::set<int32_t> seen;
  for (int s = 0; s < 10; ++s) seen.insert(ib[static_cast<size_t>(s * 7)]);
  CHECK(seen.size() == 10);
}
