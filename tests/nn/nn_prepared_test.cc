// Prepared data (runtime/data/prepared_file.h) and the document batches
// (runtime/data/batches.h): the documented layout read back, damaged files
// refused by name, packing (positions restarting, masks honoured, padding),
// one document per sample, the training order and the evaluation split.
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "runtime/data/batches.h"
#include "runtime/data/prepared_file.h"
#include "tests/support/prepared_data.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::data;
using strata::test::Doc;
using strata::test::doc;
using strata::test::prepared_bytes;
using strata::test::write;

TEST_CASE("prepared data: the documented layout reads back, damaged files are refused by name", "[data]") {
  test::TempDir dir("prepared");
  const std::vector<Doc> docs = {doc(10, 3, {false, false, true}), doc(20, 9), doc(40, 1)};
  write(dir.file("d.sd"), prepared_bytes(docs, 100));
  const PreparedFile f = PreparedFile::open(dir.file("d.sd"));
  CHECK(f.documents() == 3);
  CHECK(f.tokens() == 13);
  CHECK(f.vocab_size() == 100);
  CHECK(f.document_begin(1) == 3);
  CHECK(f.document_end(2) == 13);
  CHECK(f.token(4) == 21);
  CHECK(!f.trained(1));
  CHECK(f.trained(2));

  const std::string good = prepared_bytes(docs, 100);
  write(dir.file("trunc.sd"), good.substr(0, good.size() - 3));
  REQUIRE_THROWS_WITH(PreparedFile::open(dir.file("trunc.sd")),
                      Catch::Contains("trunc.sd") && Catch::Contains("truncated"));
  std::string v2 = good;
  v2[8] = 2;
  write(dir.file("v2.sd"), v2);
  REQUIRE_THROWS_WITH(PreparedFile::open(dir.file("v2.sd")), Catch::Contains("version 2"));
  std::string disordered = good;
  const uint64_t before = 2;  // offsets 0, 3, 12, 13: document 1 would end at 2, before its start
  std::memcpy(disordered.data() + disordered.size() - 16, &before, 8);
  write(dir.file("order.sd"), disordered);
  REQUIRE_THROWS_WITH(PreparedFile::open(dir.file("order.sd")), Catch::Contains("order.sd") && Catch::Contains("corrupt"));
  write(dir.file("random.bin"), std::string("\x13\x88\xfe\x01random bytes", 16));
  REQUIRE_THROWS_WITH(PreparedFile::open(dir.file("random.bin")), Catch::Contains("not a strata prepared-data file"));
  // --data-format auto: by the magic; a prepared file is read as documents, anything unknown refused.
  REQUIRE_THROWS_WITH(open_batches(dir.file("random.bin"), "auto", {.seq = 4}),
                      Catch::Contains("random.bin") && Catch::Contains("cannot be told from its first bytes"));
  REQUIRE_THROWS_WITH(open_batches(dir.file("trunc.sd"), "auto", {.seq = 4}), Catch::Contains("truncated"));
  CHECK(open_batches(dir.file("d.sd"), "auto", {.seq = 4})->describe().find("prepared") != std::string::npos);
}

TEST_CASE("document batches: packing restarts positions, honours the mask, never predicts across documents",
          "[data]") {
  test::TempDir dir("packing");
  // Lengths 3, 4, 2, 6 (cut to seq 5), 1; seq 5: windows [3], [4], [2] + ... next-fit.
  write(dir.file("d.sd"), prepared_bytes({doc(10, 3, {true, false, true}), doc(20, 4), doc(30, 2), doc(40, 6),
                                          doc(50, 1)},
                                         100));
  std::unique_ptr<Batches> packed = open_batches(dir.file("d.sd"), "prepared", {.seq = 5, .micro_batch = 1});
  // next-fit in file order: [3 + ...] 3+4 > 5 -> [d0], [d1], [d2], [d3 cut to 5], [d4 alone: nothing trained: dropped]
  CHECK(packed->windows() == 4);
  CHECK(packed->describe().find("1 documents longer than --seq cut") != std::string::npos);
  CHECK(packed->describe().find("1 documents with nothing to train") != std::string::npos);
  Batch b;
  packed->eval_batch(0, b);  // file order: window 0 = document 0 and padding
  CHECK(b.ids == std::vector<int32_t>{10, 11, 12, 0, 0});
  CHECK(b.positions == std::vector<int32_t>{0, 1, 2, 0, 1});
  // Token 11 is not trained, so position 0 predicts nothing; position 1 predicts 12; the last predicts nothing.
  CHECK(b.targets == std::vector<int32_t>{ops::kIgnoreIndex, 12, ops::kIgnoreIndex, ops::kIgnoreIndex,
                                          ops::kIgnoreIndex});

  write(dir.file("p.sd"), prepared_bytes({doc(10, 2), doc(20, 2), doc(30, 3), doc(40, 4)}, 100));
  std::unique_ptr<Batches> p = open_batches(dir.file("p.sd"), "prepared", {.seq = 8});
  CHECK(p->windows() == 2);  // [2 + 2 + 3], [4]
  p->eval_batch(0, b);
  CHECK(b.ids == std::vector<int32_t>{10, 11, 20, 21, 30, 31, 32, 0});
  CHECK(b.positions == std::vector<int32_t>{0, 1, 0, 1, 0, 1, 2, 0});
  const int32_t x = ops::kIgnoreIndex;
  CHECK(b.targets == std::vector<int32_t>{11, x, 21, x, 31, 32, x, x});
  // --no-packing: one document per sample.
  std::unique_ptr<Batches> single = open_batches(dir.file("p.sd"), "prepared", {.seq = 8, .packing = false});
  CHECK(single->windows() == 4);
  single->eval_batch(1, b);
  CHECK(b.ids == std::vector<int32_t>{20, 21, 0, 0, 0, 0, 0, 0});
  CHECK(b.positions == std::vector<int32_t>{0, 1, 0, 1, 2, 3, 4, 5});

  // Training: two ranks read disjoint windows, one epoch covers each once; evaluation splits in file order.
  std::set<int32_t> firsts;
  std::vector<std::unique_ptr<Batches>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(open_batches(dir.file("p.sd"), "prepared", {.seq = 8, .rank = r, .world = 2, .packing = false}));
  }
  for (int step = 0; step < 2; ++step) {
    for (auto& r : ranks) {
      r->next(b);
      firsts.insert(b.ids[0]);
    }
  }
  CHECK(firsts == std::set<int32_t>{10, 20, 30, 40});
  CHECK(ranks[0]->eval_batches() == 2);
  ranks[1]->eval_batch(1, b);  // sample 3: document 3
  CHECK(b.ids[0] == 40);
  // Ids are checked against the model's vocabulary before step 1.
  REQUIRE_THROWS_WITH(p->check_ids(35), Catch::Contains("p.sd") && Catch::Contains("token 40") &&
                                            Catch::Contains("outside the model's vocabulary"));
  REQUIRE_THROWS_WITH(open_batches(dir.file("p.sd"), "u16", {.seq = 4, .packing = false}),
                      Catch::Contains("--no-packing"));
}
