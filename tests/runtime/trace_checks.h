// Checks that a trace file is Chrome trace-event JSON as Perfetto reads it,
// shared by the recorder's tests and the end-to-end ones.
#pragma once

#include <catch2/catch.hpp>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace strata::test {

struct TraceFile {
  nlohmann::json json;
  std::vector<nlohmann::json> events;        // not metadata
  std::map<int64_t, std::string> thread_names;  // tid -> track name
  std::string process_name;

  // Events of category `cat` (and name `name` when given).
  std::vector<nlohmann::json> of(const std::string& cat, const std::string& name = "") const {
    std::vector<nlohmann::json> found;
    for (const auto& e : events) {
      if (e.value("cat", "") == cat && (name.empty() || e["name"] == name)) found.push_back(e);
    }
    return found;
  }
  // Tids whose track name starts with `prefix`.
  std::set<int64_t> tids_named(const std::string& prefix) const {
    std::set<int64_t> tids;
    for (const auto& [tid, name] : thread_names) {
      if (name.rfind(prefix, 0) == 0) tids.insert(tid);
    }
    return tids;
  }
};

// Parses `path` and checks the structure every consumer relies on: a
// traceEvents array; every event with name, ph, ts, pid, tid; complete events
// with dur >= 0; one process; every tid that has events named by thread_name
// metadata; otherData with the event and dropped counts.
inline TraceFile read_trace(const std::string& path, int pid) {
  TraceFile t;
  std::ifstream in(path);
  REQUIRE(in.good());
  t.json = nlohmann::json::parse(in);  // throws (fails the test) on invalid JSON
  REQUIRE(t.json.is_object());
  REQUIRE(t.json["traceEvents"].is_array());
  CHECK(t.json["displayTimeUnit"] == "ms");
  REQUIRE(t.json["otherData"].is_object());
  CHECK(t.json["otherData"]["dropped_events"].is_number_unsigned());
  std::set<int64_t> tids_with_events;
  for (const auto& e : t.json["traceEvents"]) {
    REQUIRE(e.is_object());
    REQUIRE(e["name"].is_string());
    REQUIRE(e["ph"].is_string());
    REQUIRE(e["ts"].is_number());
    REQUIRE(e["pid"].is_number_integer());
    REQUIRE(e["tid"].is_number_integer());
    CHECK(e["pid"].get<int>() == pid);
    const std::string ph = e["ph"];
    if (ph == "M") {
      REQUIRE(e["args"]["name"].is_string());
      if (e["name"] == "thread_name") t.thread_names[e["tid"].get<int64_t>()] = e["args"]["name"];
      if (e["name"] == "process_name") t.process_name = e["args"]["name"];
      continue;
    }
    CHECK((ph == "X" || ph == "B" || ph == "i" || ph == "C"));
    if (ph == "X") {
      REQUIRE(e["dur"].is_number());
      CHECK(e["dur"].get<double>() >= 0);
    }
    if (e.contains("args")) CHECK(e["args"].is_object());
    tids_with_events.insert(e["tid"].get<int64_t>());
    t.events.push_back(e);
  }
  CHECK(t.json["otherData"]["events"].get<size_t>() == t.events.size());
  CHECK(!t.process_name.empty());
  for (int64_t tid : tids_with_events) {
    INFO("tid " << tid);
    CHECK(t.thread_names.count(tid) == 1);
  }
  return t;
}

}  // namespace strata::test
