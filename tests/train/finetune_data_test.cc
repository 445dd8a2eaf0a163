// `strata finetune` on data as people fine-tune on: prepared documents with
// loss masks (packed or not), held-out evaluation, --keep-best; and every
// file that is not what it should be refused before step 1, naming it.
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/finetune_files.h"
#include "tests/support/prepared_data.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

using strata::test::Doc;
using strata::test::prepared_bytes;
using strata::test::run_command;
using strata::test::small_model;
using strata::test::strata_binary;
using strata::test::write_file;

namespace {

// Documents of the small model's vocabulary (256): a prompt (not trained)
// then an answer (trained) that repeats the prompt's first tokens, so the
// answers are learnable.
std::vector<Doc> qa_documents(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Doc> docs;
  for (int i = 0; i < count; ++i) {
    Doc d;
    const size_t prompt = 4 + rng() % 8;
    for (size_t t = 0; t < prompt; ++t) d.ids.push_back(rng() % 200);
    for (size_t t = 0; t < 4; ++t) d.ids.push_back(d.ids[t] + 1);
    d.ids.push_back(255);  // end of answer
    d.trained.assign(d.ids.size(), false);
    for (size_t t = prompt; t < d.ids.size(); ++t) d.trained[t] = true;
    docs.push_back(d);
  }
  return docs;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("strata finetune: JSONL, random bytes, an id outside the vocabulary and a truncated prepared file are "
          "refused before step 1, naming the file",
          "[finetune][data]") {
  strata::test::TempDir dir;
  const std::string model = small_model(dir);
  const std::string jsonl = write_file(dir, "train.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
  const std::string noise = write_file(dir, "noise.bin", std::string("\x07\xff\x13 random bytes here", 20));
  std::vector<uint32_t> ids(200, 7);
  ids[150] = 300;  // the small model's vocabulary is 256
  const std::string wide = dir.file("ids.u32");
  std::ofstream(wide, std::ios::binary).write(reinterpret_cast<const char*>(ids.data()), 800);
  const std::string good = prepared_bytes(qa_documents(10, 1), 256);
  const std::string truncated = dir.file("cut.sd");
  strata::test::write(truncated, good.substr(0, good.size() - 5));
  const struct {
    std::string what, args, expect;
  } cases[] = {
      {"JSONL", "--data " + jsonl, "strata data prepare"},
      {"random bytes", "--data " + noise, "cannot be told from its first bytes"},
      {"an id >= vocab", "--data " + wide + " --data-format u32", "outside the model's vocabulary"},
      {"a truncated prepared file", "--data " + truncated, "truncated"},
      {"a truncated evaluation file", "--data " + dir.file("ok.sd") + " --eval-data " + truncated, "truncated"},
  };
  strata::test::write(dir.file("ok.sd"), good);
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const auto r = run_command(strata_binary() + " finetune --init " + model + " --seq 32 --steps 2 --out " +
                               dir.file("out") + " " + c.args + " 2>&1");
    INFO(r.output);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.output, Catch::Contains(c.expect));
    CHECK_THAT(r.output, !Catch::Contains("step 1/"));
  }
}

TEST_CASE("strata run -n 2 -- strata finetune on packed prepared data with evaluation under ZeRO-3: the masked "
          "losses fall, the evaluation keeps the operator trace, --keep-best keeps the lowest",
          "[finetune][data]") {
  strata::test::TempDir dir;
  strata::test::write(dir.file("train.sd"), prepared_bytes(qa_documents(200, 2), 256));
  strata::test::write(dir.file("eval.sd"), prepared_bytes(qa_documents(24, 3), 256));
  const std::string config = write_file(dir, "ds.json", R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 100000},
    "strata": {"log_level": "info"},
    "csv_monitor": {"enabled": true, "output_path": ")" + dir.file("monitors") + R"(", "job_name": "job"}})");
  const std::string out = dir.file("out"), save = dir.file("ckpt");
  const auto r = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " + config +
                             " --init " + small_model(dir) + " --data " + dir.file("train.sd") + " --eval-data " +
                             dir.file("eval.sd") + " --eval-every 4 --eval-batches 2 --steps 16 --seq 48 --out " +
                             out + " --save " + save + " --save-every 100 --keep-checkpoints 1 --keep-best 2>&1");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("prepared: 200 documents") && Catch::Contains("packed") &&
                           Catch::Contains("evaluation on") && Catch::Contains("eval loss"));
  // The evaluation passes are outside the stage-3 operator trace: prefetch is never switched off.
  CHECK_THAT(r.output, !Catch::Contains("operator trace"));
  std::vector<nlohmann::json> steps;
  {
    std::ifstream in(out + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line));
  }
  REQUIRE(steps.size() == 16);
  std::vector<double> evals;
  for (const auto& s : steps) {
    // Only the answers are trained: far fewer targets than tokens (2 ranks x 2 x 48).
    CHECK(s["tokens"].get<int64_t>() < 2 * 2 * 48 / 2);
    if (s.contains("eval_loss")) evals.push_back(s["eval_loss"].get<double>());
  }
  REQUIRE(evals.size() == 4);  // steps 4, 8, 12, 16
  INFO("eval losses " << evals[0] << " ... " << evals[3]);
  CHECK(evals[3] < evals[0]);
  CHECK_THAT(read_text(out + "/loss.svg"), Catch::Contains("class=\"eval\""));
  // --keep-best: best.json names the lowest evaluation's checkpoint, kept beside the newest.
  const nlohmann::json best = nlohmann::json::parse(read_text(save + "/best.json"));
  double lowest = evals[0];
  for (double e : evals) lowest = std::min(lowest, e);
  CHECK(best["eval_loss"].get<double>() == Approx(lowest));
  CHECK(std::filesystem::exists(save + "/" + best["checkpoint"].get<std::string>() + "/manifest.json"));
  CHECK(std::filesystem::exists(save + "/step_00000016/manifest.json"));
  // csv_monitor: DeepSpeed's layout, one file per value.
  const std::string losses = read_text(dir.file("monitors") + "/job/train_loss.csv");
  CHECK_THAT(losses, Catch::StartsWith("step,train/loss\n1,"));
  CHECK_THAT(read_text(dir.file("monitors") + "/job/eval_loss.csv"), Catch::StartsWith("step,eval/loss\n4,"));
  // Resumed with --keep-best: the best so far stays protected until a lower evaluation replaces it.
  const auto resumed = run_command(strata_binary() + " run -n 2 -- " + strata_binary() + " finetune --config " +
                                   config + " --init " + dir.file("small.json") + " --data " + dir.file("train.sd") +
                                   " --eval-data " + dir.file("eval.sd") +
                                   " --eval-every 4 --eval-batches 2 --steps 20 --seq 48 --out " + dir.file("out2") +
                                   " --save " + save + " --save-every 100 --keep-checkpoints 1 --keep-best --resume 2>&1");
  INFO(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  const nlohmann::json best_after = nlohmann::json::parse(read_text(save + "/best.json"));
  CHECK(best_after["eval_loss"].get<double>() <= best["eval_loss"].get<double>());
  CHECK(std::filesystem::exists(save + "/" + best_after["checkpoint"].get<std::string>() + "/manifest.json"));
  CHECK(std::filesystem::exists(save + "/step_00000020/manifest.json"));
  // csv_monitor appends after a resume (as DeepSpeed's): step 16's line, then 17's.
  CHECK_THAT(read_text(dir.file("monitors") + "/job/train_loss.csv"), Catch::Contains("\n16,") && Catch::Contains("\n17,"));
}
