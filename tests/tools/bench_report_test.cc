// hicache-bench end to end: the tool runs as a user runs it (a child process), on tiny settings,
// and its JSON report must parse and add up: hits + misses = lookups, tokens per tier sum to the
// hits, bytes per tier are whole pages and cover the pages served from that tier, every request
// is reported once, and no page was wrong. Bad settings exit with 2 and name the value.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct BenchRun {
  int status = -1;
  std::string output;
};

BenchRun run_bench(const std::string& args) {
  BenchRun r;
  const std::string cmd = std::string(HICACHE_BENCH_PATH) + " --no-progress " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p) != nullptr) r.output += buf;
  const int s = ::pclose(p);
  r.status = WIFEXITED(s) ? WEXITSTATUS(s) : -1;
  return r;
}

struct TempFile {
  fs::path path;
  explicit TempFile(const std::string& name)
      : path(fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()))) {}
  ~TempFile() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

const std::string kTiny =
    "--layers 2 --kv-heads 1 --head-dim 8 --page-size 16 --device-tokens 512 --host-ratio 2 "
    "--cost-per-token-layer 0 --decode-step-seconds 0 --prefetch-threshold-tokens 16 "
    "--request-tokens 48 --output-tokens 8 --system-prompt-tokens 16 ";

// The checks every configuration's summary must pass.
void check_adds_up(const json& c, double expected_requests) {
  SCOPED_TRACE(c["name"].get<std::string>());
  EXPECT_EQ(c["requests"].get<double>() + c["rejected_requests"].get<double>(), expected_requests);
  EXPECT_EQ(c["mismatched_pages"].get<double>(), 0) << c["first_mismatch"];
  const json& l = c["lookups"];
  EXPECT_EQ(l["hits"].get<double>() + l["misses"].get<double>(), l["lookups"].get<double>());
  const json& t = c["tokens"];
  EXPECT_EQ(t["device_hit"].get<double>() + t["host_hit"].get<double>() + t["storage_hit"].get<double>(),
            t["cached"].get<double>());
  EXPECT_EQ(t["cached"].get<double>(), l["hits"].get<double>());
  EXPECT_EQ(t["computed"].get<double>(), l["misses"].get<double>());
  EXPECT_GT(t["prompt"].get<double>(), 0);
  const double page_bytes = c["page_bytes"].get<double>();
  const double page_size = c["page_size"].get<double>();
  for (const char* tier : {"l1_to_l2", "l2_to_l1", "l2_to_l3", "l3_to_l2"}) {
    const json& b = c["tiers"][tier];
    const double pages = b["pages"].get<double>();
    EXPECT_EQ(pages, static_cast<double>(static_cast<long long>(pages))) << tier << ": not whole pages";
    EXPECT_EQ(b["bytes"].get<double>(), pages * page_bytes) << tier;
  }
  // What came from a tier crossed into the device: loaded pages cover the host and L3 hits.
  EXPECT_GE(c["tiers"]["l2_to_l1"]["pages"].get<double>() * page_size,
            t["host_hit"].get<double>() + t["storage_hit"].get<double>());
  EXPECT_GE(c["tiers"]["l3_to_l2"]["pages"].get<double>() * page_size, t["storage_hit"].get<double>());
  double round_requests = 0;
  for (const json& r : c["per_round"]) round_requests += r["requests"].get<double>();
  EXPECT_EQ(round_requests, c["requests"].get<double>());
  EXPECT_GT(c["ttft_ms"]["p99"].get<double>(), 0);
  EXPECT_GE(c["ttft_ms"]["p99"].get<double>(), c["ttft_ms"]["p50"].get<double>());
  EXPECT_GE(c["e2e_ms"]["avg"].get<double>(), c["ttft_ms"]["avg"].get<double>());
}

TEST(HicacheBench, CompareReportAddsUpForEveryWorkload) {
  for (const std::string workload : {"multiturn", "longcontext", "tree"}) {
    SCOPED_TRACE(workload);
    TempFile report("hicache-bench-report.json"), plot("hicache-bench-plot.svg");
    const BenchRun r = run_bench(kTiny + "--workload " + workload +
                            " --clients 4 --rounds 3 --documents 3 --questions 3 "
                            "--document-tokens 160 --trees 2 --branching 2 --depth 3 --compare "
                            "--report " + report.path.string() + " --plot " + plot.path.string());
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("ok: every page verified"), std::string::npos) << r.output;
    const json j = read_json(report.path);
    EXPECT_EQ(j["workload"], workload);
    EXPECT_EQ(j["settings"]["clients"], 4);
    EXPECT_EQ(j["settings"]["workload"], workload);
    ASSERT_EQ(j["configurations"].size(), 3u);
    EXPECT_EQ(j["configurations"][0]["name"], "device");
    EXPECT_EQ(j["configurations"][1]["name"], "host");
    EXPECT_EQ(j["configurations"][2]["name"], "host+file");
    const double requests = workload == "multiturn" ? 12 : workload == "longcontext" ? 9 : -1;
    for (const json& c : j["configurations"]) {
      check_adds_up(c, requests > 0 ? requests : c["requests"].get<double>());
    }
    const json& device = j["configurations"][0];
    EXPECT_EQ(device["tokens"]["host_hit"].get<double>(), 0);
    EXPECT_EQ(device["tiers"]["l1_to_l2"]["bytes"].get<double>(), 0);
    EXPECT_EQ(j["configurations"][1]["tiers"]["l2_to_l3"]["bytes"].get<double>(), 0);
    EXPECT_GT(j["configurations"][2]["tiers"]["l2_to_l3"]["bytes"].get<double>(), 0);
    EXPECT_GT(j["configurations"][2]["verified_pages"].get<double>(), 0);
    std::ifstream svg(plot.path);
    std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.rfind("<svg", 0), 0u);
    EXPECT_NE(text.find("host+file"), std::string::npos);
    EXPECT_NE(text.find("</svg>"), std::string::npos);
  }
}

// Two engine processes share one file store; every conversation alternates between them, so
// its earlier rounds are found only in L3, and those hits are reported as cross-instance.
TEST(HicacheBench, InstancesShareL3AcrossProcesses) {
  TempFile report("hicache-bench-instances.json");
  const BenchRun r = run_bench(kTiny + "--clients 4 --rounds 3 --instances 2 --tiers file --report " +
                          report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  ASSERT_EQ(j["configurations"].size(), 1u);
  const json& c = j["configurations"][0];
  EXPECT_EQ(c["instances"], 2);
  check_adds_up(c, 12);
  EXPECT_GT(c["tokens"]["storage_hit"].get<double>(), 0);
  EXPECT_GT(c["tokens"]["cross_instance_storage_hit"].get<double>(), 0);
  EXPECT_GT(c["verified_pages"].get<double>(), 0);
}

// --tp 2: each instance is two rank processes over Gloo, each with its own slice of the KV
// (page data salted by rank: a page of the other rank's slice would fail its check) and its
// own pools, sharing the file store; with --instances and under --compare. The ranks stay in
// step (a divergence fails the run), every rank's pages are verified, and the scheduler made
// fewer than one collective call per step on average (the cache's step reduction when an op is
// in flight, the engine's agreement on its loads), none without a host tier.
TEST(HicacheBench, TpRanksAsProcessesVerifyEveryPageWithOneCollectivePerStep) {
  TempFile report("hicache-bench-tp.json"), single("hicache-bench-tp1.json");
  const BenchRun one = run_bench(kTiny + "--clients 4 --rounds 3 --tiers file --report " +
                                 single.path.string());
  ASSERT_EQ(one.status, 0) << one.output;
  const BenchRun r = run_bench(kTiny + "--clients 4 --rounds 3 --tp 2 --instances 2 --compare "
                                       "--report " + report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  ASSERT_EQ(j["configurations"].size(), 3u);
  for (const json& c : j["configurations"]) {
    check_adds_up(c, 12);
    EXPECT_EQ(c["tp"]["ranks"], 2);
    EXPECT_GT(c["verified_pages"].get<double>(), 0);
    const double per_step = c["tp"]["collectives_per_step"].get<double>();
    // Device only: nothing ever in flight, so no step reduces at all.
    if (c["name"] == "device") {
      EXPECT_EQ(per_step, 0);
    } else {
      EXPECT_GT(per_step, 0) << c["name"];
    }
    EXPECT_LT(per_step, 1) << c["name"];
  }
  const json& file = j["configurations"][2];
  EXPECT_EQ(file["name"], "host+file");
  EXPECT_GT(file["tokens"]["storage_hit"].get<double>(), 0);
  EXPECT_GT(file["tp"]["storage_thread_collectives"].get<double>(), 0);
  const json tp1 = read_json(single.path)["configurations"][0];
  EXPECT_EQ(tp1["tp"]["ranks"], 1);
  EXPECT_EQ(tp1["tp"]["collectives_per_step"].get<double>(), 0);
  // The same workload at every TP size: a single instance of ranks runs all rounds at once, as
  // one process does (it ran round by round, a different workload with a lower hit rate); with
  // --instances, or --barrier, round by round.
  EXPECT_FALSE(tp1["barrier"].get<bool>());
  for (const json& c : j["configurations"]) EXPECT_TRUE(c["barrier"].get<bool>()) << c["name"];
  TempFile ranks("hicache-bench-tp2.json");
  const BenchRun two = run_bench(kTiny + "--clients 4 --rounds 3 --tiers file --tp 2 --report " +
                                 ranks.path.string());
  ASSERT_EQ(two.status, 0) << two.output;
  const json tp2 = read_json(ranks.path)["configurations"][0];
  EXPECT_EQ(tp2["tp"]["ranks"], 2);
  EXPECT_FALSE(tp2["barrier"].get<bool>());
  check_adds_up(tp2, 12);
  EXPECT_GT(tp2["verified_pages"].get<double>(), 0);
  const BenchRun rate = run_bench("--tp 2 --request-rate 5");
  EXPECT_EQ(rate.status, 2);
  EXPECT_NE(rate.output.find("--tp > 1 needs --request-rate 0"), std::string::npos) << rate.output;
}

// Tenants asking about the same document: with one identity the later questions hit the
// document's pages; with a tenant per question none hits another's, on any tier, and every
// page served is still verified (page data derives from the identity).
TEST(HicacheBench, TenantsNeverHitEachOthersPages) {
  const std::string args = kTiny + "--workload longcontext --documents 1 --questions 4 "
                                   "--document-tokens 256 --report ";
  TempFile shared("hicache-bench-one-tenant.json"), apart("hicache-bench-tenants.json");
  const BenchRun one = run_bench(args + shared.path.string());
  ASSERT_EQ(one.status, 0) << one.output;
  const BenchRun four = run_bench(args + apart.path.string() + " --tenants 4");
  ASSERT_EQ(four.status, 0) << four.output;
  const json a = read_json(shared.path)["configurations"][0];
  const json b = read_json(apart.path)["configurations"][0];
  check_adds_up(a, 4);
  check_adds_up(b, 4);
  EXPECT_GT(a["tokens"]["cached"].get<double>(), 0) << "one tenant: the document is shared";
  EXPECT_EQ(b["tokens"]["cached"].get<double>(), 0) << "a tenant hit another's pages";
  EXPECT_GT(b["verified_pages"].get<double>() + b["tokens"]["computed"].get<double>(), 0);
  EXPECT_NE(run_bench("--tenants 0").status, 0);
}

// --l3-detach-every: L3 goes away and comes back (reopened from the config) during the run;
// every page still verifies, the report adds up, and L3 served hits across the windows.
TEST(HicacheBench, L3DetachedAndAttachedMidRunStillVerifiesEveryPage) {
  TempFile report("hicache-bench-detach.json");
  const BenchRun r = run_bench(kTiny + "--clients 4 --rounds 5 --tiers file --l3-detach-every 20 "
                                       "--report " + report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json c = read_json(report.path)["configurations"][0];
  check_adds_up(c, 20);
  EXPECT_GE(c["counters"]["l3_detaches"].get<double>(), 2) << r.output;
  EXPECT_GT(c["tiers"]["l2_to_l3"]["pages"].get<double>(), 0);
  EXPECT_GT(c["verified_pages"].get<double>(), 0);
  EXPECT_NE(run_bench("--l3-detach-every -1").status, 0);
}

// An instance that does not finish a round within --instance-timeout-s fails the run (exit 1,
// naming the instance and the round) instead of holding the parent for ever; the parent kills
// and reaps every instance before it returns. Here each round lasts at least 10 s (1000
// simulated decode steps of 10 ms sleep each) against a 0.3 s limit, so the limit always fires.
TEST(HicacheBench, AnInstanceThatDoesNotAnswerInTimeFailsTheRun) {
  const auto start = std::chrono::steady_clock::now();
  const BenchRun r = run_bench(kTiny + "--clients 4 --rounds 3 --instances 2 --tiers file "
                               "--device-tokens 4096 --output-tokens 1000 "
                               "--decode-step-seconds 0.01 --instance-timeout-s 0.3");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("instance 0 gave no answer within 0.3 s to round 0"), std::string::npos)
      << r.output;
  // Well before the run would have ended by itself (3 rounds of at least 10 s each).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8)) << r.output;
}

TEST(HicacheBench, BadSettingsExitWithUsageAndNameTheValue) {
  BenchRun r = run_bench("--workload nope");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("unknown workload 'nope'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("usage: hicache-bench"), std::string::npos);
  r = run_bench("--host-layout sideways");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("'sideways'"), std::string::npos) << r.output;
  r = run_bench("--clients -3");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("clients: '-3'"), std::string::npos) << r.output;
  r = run_bench("--instance-timeout-s -1");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("instance_timeout_s: '-1'"), std::string::npos) << r.output;
  r = run_bench("--no-such-flag 1");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("unknown flag '--no-such-flag'"), std::string::npos) << r.output;
  r = run_bench("--tiers redis");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("--redis"), std::string::npos) << r.output;
  // A Redis nobody answers for fails at start (it ran to the end and said "ok" before).
  r = run_bench(kTiny + "--tiers redis --redis 127.0.0.1:1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:1 does not answer at start"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("ok: every page verified"), std::string::npos) << r.output;
  TempFile config("hicache-bench-config.json");
  {
    std::ofstream(config.path) << R"({"workload": "tree", "depth": 0})";
  }
  r = run_bench("--config " + config.path.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("depth: '0'"), std::string::npos) << r.output;
  {
    std::ofstream(config.path) << R"({"colour": "blue"})";
  }
  r = run_bench("--config " + config.path.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("unknown key 'colour'"), std::string::npos) << r.output;
  // JSON values of the wrong type: named, not turned into text.
  for (const std::string bad : {R"({"report": null})", R"({"clients": "8"})", R"({"barrier": 1})",
                                R"({"request_rate": "fast"})", R"({"clients": 2.5})"}) {
    {
      std::ofstream(config.path) << bad;
    }
    r = run_bench("--config " + config.path.string());
    EXPECT_EQ(r.status, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("it must be"), std::string::npos) << bad << "\n" << r.output;
  }
}

// --metrics-port: the cache's /metrics is served while the workload runs (0: a free port, which
// the bench prints); a port out of range is refused before anything runs, naming the key.
TEST(HicacheBench, MetricsPortServesTheCachesMetricsAndABadOneIsRefused) {
  BenchRun r = run_bench(kTiny + "--clients 2 --rounds 2 --tiers host --metrics-port 0");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("host: metrics at http://127.0.0.1:"), std::string::npos) << r.output;
  r = run_bench(kTiny + "--tiers host --metrics-port 70000");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'metrics_port' is 70000"), std::string::npos) << r.output;
  r = run_bench(kTiny + "--tiers host --write-polcy write_back");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("unknown flag '--write-polcy' (the key 'write_policy'?)"),
            std::string::npos)
      << r.output;
}

// Conversations that outgrow the device pool: the engine rejects the rounds that can never fit,
// the report counts them, and the follow-up rounds still run (the runner once gave up instead).
TEST(HicacheBench, RejectedRoundsAreReportedAndTheirFollowUpsStillRun) {
  TempFile report("hicache-bench-rejected.json");
  const BenchRun r = run_bench(kTiny + "--clients 2 --rounds 14 --device-tokens 256 --tiers host "
                               "--report " + report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  const json& c = j["configurations"][0];
  EXPECT_GT(c["rejected_requests"].get<double>(), 0) << "the conversations never outgrew the pool";
  check_adds_up(c, 28);
}

// Settings from a JSON file, with a flag overriding one of them.
TEST(HicacheBench, JsonConfigIsReadAndFlagsOverrideIt) {
  TempFile config("hicache-bench-config2.json"), report("hicache-bench-config2-report.json");
  {
    std::ofstream(config.path) << R"({"workload": "longcontext", "documents": 2, "questions": 2,
                                      "document_tokens": 64, "tiers": "host", "clients": 9})";
  }
  const BenchRun r = run_bench(kTiny + "--config " + config.path.string() + " --questions 3 --report " +
                          report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  EXPECT_EQ(j["workload"], "longcontext");
  EXPECT_EQ(j["settings"]["questions"], 3);
  EXPECT_EQ(j["settings"]["clients"], 9);
  EXPECT_EQ(j["configurations"][0]["name"], "host");
  check_adds_up(j["configurations"][0], 6);
}

}  // namespace
