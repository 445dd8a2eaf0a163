// Runs of a resumable job killed with SIGKILL at moments and resumed, for the
// tests that hold a resumed run to the uninterrupted one bit for bit (Catch
// assertions inside: include from a Catch test only).
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/support/finetune_files.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

namespace strata::test {

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Kill delays spread over an uninterrupted run that took `reference` (wall
// time, this machine, now): they land in start-up, in steps, in checkpoint
// writes and in the export however fast the run is, and the first three add
// up to under half a run, so at least three attempts are killed before one
// can finish even when the attempts run twice as fast as the reference did
// (a reference slowed by the tests beside it; first three adding up to 0.9
// of it let a third attempt 10% faster finish, as a CI run saw; fixed
// delays let a fast machine finish on the third).
inline std::vector<int> kill_delays_over(std::chrono::milliseconds reference) {
  std::vector<int> delays;
  for (double fraction : {0.15, 0.1, 0.2, 0.25, 0.5, 0.35, 0.2, 0.6, 0.45, 0.7}) {
    delays.push_back(std::max(150, static_cast<int>(fraction * static_cast<double>(reference.count()))));
  }
  return delays;
}

// run_command, and the wall time it took (the uninterrupted run whose
// duration kill_delays_over spreads the kills over).
struct TimedCommand {
  CommandResult result;
  std::chrono::milliseconds took;
};
inline TimedCommand run_timed(const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  CommandResult result = run_command(command);
  return {std::move(result), std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::steady_clock::now() - start)};
}

// Runs `args` (a resumable finetune) again and again, each attempt killed
// with SIGKILL (every process of it, at once) after a delay unless it
// finishes first, each next attempt resuming from `ckpt`, until one finishes;
// returns how many were killed.
// `delays_ms`: the delay of each killed attempt (then one is let finish);
// empty: ten from 450 ms to 1.5 s. Catch assertions: a test's helper.
inline int run_killed_and_resumed(const TempDir& dir, const std::string& args, const std::string& ckpt,
                                  std::vector<int> delays_ms = {}) {
  const std::string script = write_file(dir, "kill.sh", R"SH(#!/usr/bin/env bash
set -u
args="$1"; delay="$2"; ckpt="$3"; log="$4"
resume=""
if ls "$ckpt"/step_*/manifest.json >/dev/null 2>&1; then resume="--resume"; fi
setsid bash -c "exec $args $resume" >"$log" 2>&1 &
sid=$!
end=$(( $(date +%s%N) + ${delay%.*}000000 ))
while kill -0 $sid 2>/dev/null && [ "$(date +%s%N)" -lt "$end" ]; do sleep 0.02; done
if kill -0 $sid 2>/dev/null; then
  pkill -KILL -s $sid; while pgrep -s $sid >/dev/null; do sleep 0.02; done
  echo killed; exit 0
fi
wait $sid; rc=$?; echo "exited $rc"
)SH");
  // Start-up (rendezvous, engine, model) takes a few hundred ms, a step tens:
  // these land in start-up, in steps, in checkpoint writes and in the export.
  if (delays_ms.empty()) delays_ms = {700, 450, 900, 600, 1100, 800, 550, 1300, 1000, 1500};
  const auto killed_attempts = static_cast<int>(delays_ms.size());
  int kills = 0;
  for (int attempt = 0; attempt < killed_attempts + 20; ++attempt) {
    // Then let it finish.
    const int delay = attempt < killed_attempts ? delays_ms[static_cast<size_t>(attempt)] : 600000;
    const std::string log = dir.file("attempt" + std::to_string(attempt) + ".log");
    const auto r = run_command("bash " + script + " '" + args + "' " + std::to_string(delay) + " " + ckpt + " " + log);
    INFO("attempt " << attempt << ": " << r.output << file_bytes(log));
    REQUIRE(r.exit_code == 0);
    if (r.output.find("killed") != std::string::npos) {
      ++kills;
      continue;
    }
    REQUIRE_THAT(r.output, Catch::Contains("exited 0"));
    return kills;
  }
  FAIL("the run never finished");
  return kills;
}


}  // namespace strata::test
