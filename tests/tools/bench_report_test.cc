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

// A tiny workload on a 2-layer model: MHA (1 KV head of 8 dims), or MLA (one latent of 32 + 16
// values per token and layer).
const std::string kTinyWorkload =
    "--layers 2 --page-size 16 --device-tokens 512 --host-ratio 2 "
    "--cost-per-token-layer 0 --decode-step-seconds 0 --prefetch-threshold-tokens 16 "
    "--request-tokens 48 --output-tokens 8 --system-prompt-tokens 16 ";
const std::string kTiny = "--kv-heads 1 --head-dim 8 " + kTinyWorkload;
const std::string kTinyMla =
    "--attention mla --kv-lora-rank 32 --qk-rope-head-dim 16 " + kTinyWorkload;
constexpr double kTinyMlaPageBytes = 2 * (32 + 16) * 2 * 16;  // layers x latent x fp16 x page

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
    // What the store wrote: none without L3; with it, some, and never more than it was handed.
    EXPECT_EQ(j["configurations"][1]["l3_stored_bytes"].get<double>(), 0);
    EXPECT_GT(j["configurations"][2]["l3_stored_bytes"].get<double>(), 0);
    EXPECT_LE(j["configurations"][2]["l3_stored_bytes"].get<double>(),
              j["configurations"][2]["tiers"]["l2_to_l3"]["bytes"].get<double>());
    EXPECT_GT(j["configurations"][2]["verified_pages"].get<double>(), 0);
    // Prefetch confirmation: none without L3 (InstancesShareL3... checks it with L3 hits).
    EXPECT_EQ(j["configurations"][1]["prefetch_confirm_ms"]["count"].get<double>(), 0);
    std::ifstream svg(plot.path);
    std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text.rfind("<svg", 0), 0u);
    EXPECT_NE(text.find("host+file"), std::string::npos);
    EXPECT_NE(text.find("</svg>"), std::string::npos);
  }
}

// Two engine processes share one file store; every conversation alternates between them, so
// its earlier rounds are found only in L3, and those hits are reported as cross-instance. The
// same for an MHA model and an MLA one (one key namespace for every rank and instance).
TEST(HicacheBench, InstancesShareL3AcrossProcessesForMhaAndMla) {
  for (const std::string& model : {kTiny, kTinyMla}) {
    SCOPED_TRACE(model);
    TempFile report("hicache-bench-instances.json");
    const BenchRun r =
        run_bench(model + "--clients 4 --rounds 3 --instances 2 --tiers file --report " +
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
    // Prefetch confirmation (last page landed -> the cache took the pages), over both
    // instances: counted, and p50 <= p99 (the bucket bounds that hold them, in ms).
    const json& confirm = c["prefetch_confirm_ms"];
    EXPECT_GT(confirm["count"].get<double>(), 0) << confirm;
    EXPECT_GT(confirm["p50_at_most"].get<double>(), 0) << confirm;
    EXPECT_LE(confirm["p50_at_most"].get<double>(), confirm["p99_at_most"].get<double>())
        << confirm;
    // ... and in steps begun meanwhile: as many confirmations, one rank, taken at the first
    // step after the pages landed (the bucket bound 1 holds every one).
    const json& steps = c["prefetch_confirm_steps"];
    EXPECT_EQ(steps["count"].get<double>(), confirm["count"].get<double>()) << steps;
    EXPECT_LE(steps["p99_at_most"].get<double>(), 1) << steps;
    EXPECT_EQ(c["prefetch_rank_wait_steps"]["count"].get<double>(), 0) << "one rank: no skew";
    if (model == kTinyMla) {
      EXPECT_EQ(c["page_bytes"].get<double>(), kTinyMlaPageBytes);
    }
  }
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
  // Under TP each confirmation (from the last rank's landing) comes with the rank's wait.
  EXPECT_EQ(file["prefetch_rank_wait_steps"]["count"].get<double>(),
            file["prefetch_confirm_steps"]["count"].get<double>());
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
  // MHA: each rank backs up its own slice (the MLA test below expects rank 0 alone).
  ASSERT_EQ(tp2["tp"]["per_rank"].size(), 2u) << tp2["tp"];
  for (const json& rank : tp2["tp"]["per_rank"]) {
    EXPECT_GT(rank["l2_to_l3_pages"].get<double>(), 0) << rank;
  }
  const BenchRun rate = run_bench("--tp 2 --request-rate 5");
  EXPECT_EQ(rate.status, 2);
  EXPECT_NE(rate.output.find("--tp > 1 needs --request-rate 0"), std::string::npos) << rate.output;
}

// --storage-admission exclusive: pages reach L3 as the host evicts them (a host pool no larger
// than the device's), every page served is verified, on one rank and on two, whose agreed
// backup acks leave both ranks with the same L3 writes; a bad value is refused naming it.
TEST(HicacheBench, ExclusiveStorageAdmissionVerifiesEveryPageOnOneRankAndUnderTp) {
  for (const int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    TempFile report("hicache-bench-exclusive-" + std::to_string(tp) + ".json");
    const BenchRun r = run_bench(kTiny + "--clients 8 --rounds 4 --tiers file --host-ratio 1 " +
                                 "--storage-admission exclusive --tp " + std::to_string(tp) +
                                 " --report " + report.path.string());
    ASSERT_EQ(r.status, 0) << r.output;
    const json c = read_json(report.path)["configurations"][0];
    check_adds_up(c, 32);
    EXPECT_GT(c["verified_pages"].get<double>(), 0);
    EXPECT_GT(c["tiers"]["l2_to_l3"]["pages"].get<double>(), 0) << "the host evicted into L3";
    if (tp == 2) {
      ASSERT_EQ(c["tp"]["per_rank"].size(), 2u) << c["tp"];
      EXPECT_EQ(c["tp"]["per_rank"][0]["l2_to_l3_pages"], c["tp"]["per_rank"][1]["l2_to_l3_pages"]);
    }
  }
  const BenchRun bad = run_bench("--storage-admission sometimes");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.output.find("key 'storage_admission' is \"sometimes\""), std::string::npos)
      << bad.output;
}

// Tenants asking about the same document: with one identity the later questions hit the
// document's pages; with a tenant per question none hits another's, on any tier, and every
// page served is still verified (page data derives from the identity).
// --model hybrid: the hybrid reference model (state checkpoints and an indexer's keys beside
// the KV) on every tier, one rank and TP 2: every KV and sidecar page a request restores is
// verified, the sidecar pages move between the tiers (their bytes per tier in the report), and
// L3 serves hits. A bad sidecars value is refused naming the pool and the key.
TEST(HicacheBench, TheHybridModelVerifiesEveryKvAndSidecarPageOnEveryTier) {
  for (const int tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    TempFile report("hicache-bench-hybrid-" + std::to_string(tp) + ".json");
    const BenchRun r = run_bench("--model hybrid " + kTinyWorkload +
                                 "--clients 8 --rounds 4 --compare --tp " + std::to_string(tp) +
                                 " --report " + report.path.string());
    ASSERT_EQ(r.status, 0) << r.output;
    const json configs = read_json(report.path)["configurations"];
    ASSERT_EQ(configs.size(), 3u);
    for (const json& c : configs) {
      check_adds_up(c, 32);
      EXPECT_GT(c["sidecars"]["verified_pages"].get<double>(), 0) << c["name"];
    }
    EXPECT_GT(configs[1]["sidecars"]["l1_to_l2_bytes"].get<double>(), 0) << "host: state written";
    EXPECT_GT(configs[2]["sidecars"]["l2_to_l3_bytes"].get<double>(), 0) << "file: state backed up";
    EXPECT_GT(configs[2]["tokens"]["cached"].get<double>(), configs[0]["tokens"]["cached"].get<double>());
  }
  const BenchRun bad = run_bench(
      R"(--tiers host --sidecars '{"state": {"policy": "trailing", "slot_bytes": 63, "device_pages": 2, )"
      R"("host_pages": 4, "dtype": "fp32"}}')");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.output.find("sidecar pool 'state'"), std::string::npos) << bad.output;
}

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

// --kv-events-view needs the events and one process running one configuration; a bad
// kv_events key is refused naming it, before anything runs.
TEST(HicacheBench, KvEventsFlagsAreCheckedBeforeTheRun) {
  for (const std::string& flags :
       {std::string("--kv-events-view /tmp/v.json"),
        std::string("--kv-events tcp://*:0 --kv-events-view /tmp/v.json --compare"),
        std::string("--kv-events tcp://*:0 --kv-events-view /tmp/v.json --tp 2")}) {
    const BenchRun r = run_bench(kTiny + flags);
    EXPECT_EQ(r.status, 2) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find("--kv-events-view '/tmp/v.json' needs --kv-events, one configuration"),
              std::string::npos)
        << r.output;
  }
  BenchRun r = run_bench(kTiny + "--kv-events tcp://*:0 --kv-events-media TAPE");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'kv_events.media' is \"TAPE\""), std::string::npos) << r.output;
  r = run_bench(kTiny + "--kv-events-topic kv");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("'kv_events.topic' is set, but kv_events.endpoint is not"),
            std::string::npos)
      << r.output;
}

// The what-if L3 throttle: refused where no L3 store exists, naming the flags; on the file tier
// the run verifies every page, the report keeps the flags, and what L3 moved went no faster than
// the throttle's link (the controller's read time includes the throttle's wait).
TEST(HicacheBench, TheL3ThrottleSlowsTheStoreAndIsRefusedWithoutOne) {
  BenchRun r = run_bench(kTiny + "--tiers host --l3-latency-ms 5");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--l3-bandwidth-mbps / --l3-latency-ms slow the L3 store, but --tiers "
                          "host has none"),
            std::string::npos)
      << r.output;
  r = run_bench(kTiny + "--tiers file --l3-bandwidth-mbps -3");
  EXPECT_EQ(r.status, 2) << r.output;
  // The store filled by an unthrottled run first (--keep-storage), so that the throttled run, a
  // fresh engine with the same workload, finds its prefixes in L3 however late its own backups
  // land (on a loaded machine they may land after every request that could use them).
  TempFile report("hicache-bench-throttle.json"), store("hicache-bench-throttle-l3");
  const std::string workload = kTiny + "--clients 8 --rounds 3 --host-ratio 1 --tiers file "
                               "--keep-storage --storage-dir " + store.path.string() + " ";
  r = run_bench(workload);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_bench(workload + "--l3-bandwidth-mbps 20 --l3-latency-ms 2 --report " +
                report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  EXPECT_EQ(j["settings"]["l3_bandwidth_mbps"].get<double>(), 20);
  EXPECT_EQ(j["settings"]["l3_latency_ms"].get<double>(), 2);
  const json& c = j["configurations"][0];
  check_adds_up(c, 24);
  const json& read = c["tiers"]["l3_to_l2"];
  ASSERT_GT(read["bytes"].get<double>(), 0) << "no L3 reads to throttle";
  EXPECT_LE(read["gbps"].get<double>(), 0.020) << read;
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

// An MLA model from flags: it runs with every page verified (the main job's MHA defaults,
// kv_heads and head_dim, are not applied to it), its pages are the latent's size; an explicit
// --kv-heads, or an MLA model without its widths, is refused naming the key.
TEST(HicacheBench, MlaModelRunsFromFlagsAndKeysThatDoNotApplyAreRefused) {
  TempFile report("hicache-bench-mla.json");
  BenchRun r =
      run_bench(kTinyMla + "--clients 4 --rounds 3 --compare --report " + report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  ASSERT_EQ(j["configurations"].size(), 3u);
  for (const json& c : j["configurations"]) {
    check_adds_up(c, 12);
    EXPECT_EQ(c["page_bytes"].get<double>(), kTinyMlaPageBytes) << c["name"];
  }
  EXPECT_EQ(
      j["settings"]["cache"]["model"],
      (json{{"attention", "mla"}, {"layers", 2}, {"kv_lora_rank", 32}, {"qk_rope_head_dim", 16}}));
  EXPECT_GT(j["configurations"][2]["tiers"]["l2_to_l3"]["pages"].get<double>(), 0);
  r = run_bench(kTinyMla + "--kv-heads 4");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'model.kv_heads' does not apply to model.attention 'mla'"),
            std::string::npos)
      << r.output;
  r = run_bench("--attention mla --qk-rope-head-dim 64");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'model.kv_lora_rank' is required"), std::string::npos) << r.output;
}

// An MLA model from a config file, as a model object and as a preset (scaled down by the
// file's own keys, which win over the preset's); a bad preset or one the file contradicts is
// refused naming it.
TEST(HicacheBench, MlaModelRunsFromAConfigFileAndTheDeepSeekPreset) {
  TempFile config("hicache-bench-mla-config.json"), report("hicache-bench-mla-config-report.json");
  {
    std::ofstream(config.path) << R"({"model": {"attention": "mla", "layers": 2, "kv_lora_rank": 32,
                                                "qk_rope_head_dim": 16}, "page_size": 16,
                                      "clients": 4, "rounds": 3, "device_tokens": 512})";
  }
  // (The file's keys below set the rest; flags would win over them.)
  const std::string workload =
      "--cost-per-token-layer 0 --decode-step-seconds 0 "
      "--prefetch-threshold-tokens 16 --output-tokens 8 --report ";
  BenchRun r = run_bench("--config " + config.path.string() +
                         " --request-tokens 48 --system-prompt-tokens 16 " + workload +
                         report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  json c = read_json(report.path)["configurations"][0];
  check_adds_up(c, 12);
  EXPECT_EQ(c["page_bytes"].get<double>(), kTinyMlaPageBytes);
  // The preset: DeepSeek-V3's latent (512 + 64, bf16, page 64) on 2 of its 61 layers.
  {
    std::ofstream(config.path) << R"({"model": "deepseek-v3", "layers": 2, "clients": 4,
                                      "rounds": 3, "device_tokens": 1024,
                                      "request_tokens": 128, "system_prompt_tokens": 64})";
  }
  r = run_bench("--config " + config.path.string() + " " + workload + report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json j = read_json(report.path);
  c = j["configurations"][0];
  check_adds_up(c, 12);
  EXPECT_EQ(c["page_size"].get<double>(), 64);
  EXPECT_EQ(c["page_bytes"].get<double>(), 2.0 * 576 * 2 * 64);
  EXPECT_EQ(j["settings"]["model"], "deepseek-v3");
  EXPECT_EQ(j["settings"]["cache"]["model"]["dtype"], "bf16");
  { std::ofstream(config.path) << R"({"model": "deepseek-v3", "attention": "mha"})"; }
  r = run_bench("--config " + config.path.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("contradicts the preset 'deepseek-v3'"), std::string::npos) << r.output;
  r = run_bench("--model deepseek-v4");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("unknown preset 'deepseek-v4'; known: deepseek-v3"), std::string::npos)
      << r.output;
  { std::ofstream(config.path) << R"({"model": 3})"; }
  r = run_bench("--config " + config.path.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'model' is 3"), std::string::npos) << r.output;
}

// MLA under --tp 2: the ranks hold the same KV under one key namespace, so rank 0 alone backs
// it up and every rank reads it from L3 (the ranks agree on each hit: the same L3 tokens on
// every rank). With --instances 2 the rounds hand over through L3 and every rank of both
// instances hits there, across instances too.
TEST(HicacheBench, MlaTpRanksEveryRankHitsL3AndRankZeroAloneBacksUp) {
  TempFile one("hicache-bench-mla-tp.json"), both("hicache-bench-mla-tp-instances.json");
  BenchRun r = run_bench(kTinyMla +
                         "--clients 8 --rounds 4 --host-ratio 1 --tiers file --tp 2 "
                         "--tp-timeout-ms 60000 --report " +
                         one.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  json c = read_json(one.path)["configurations"][0];
  check_adds_up(c, 32);
  ASSERT_EQ(c["tp"]["per_rank"].size(), 2u) << c["tp"];
  const json& rank0 = c["tp"]["per_rank"][0];
  const json& rank1 = c["tp"]["per_rank"][1];
  EXPECT_GT(rank0["l2_to_l3_pages"].get<double>(), 0) << c["tp"];
  EXPECT_EQ(rank1["l2_to_l3_pages"].get<double>(), 0) << c["tp"];
  EXPECT_EQ(rank0["storage_hit_tokens"], rank1["storage_hit_tokens"]) << c["tp"];
  EXPECT_EQ(rank0["l3_to_l2_pages"], rank1["l3_to_l2_pages"]) << c["tp"];
  EXPECT_GT(rank1["verified_pages"].get<double>(), 0) << c["tp"];
  EXPECT_NE(r.output.find("L2->L3 pages by rank"), std::string::npos) << r.output;

  r = run_bench(kTinyMla + "--clients 4 --rounds 3 --tiers file --tp 2 --instances 2 --report " +
                both.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  c = read_json(both.path)["configurations"][0];
  check_adds_up(c, 12);
  EXPECT_GT(c["tokens"]["cross_instance_storage_hit"].get<double>(), 0);
  ASSERT_EQ(c["tp"]["per_rank"].size(), 4u) << c["tp"];
  for (const json& rank : c["tp"]["per_rank"]) {
    SCOPED_TRACE(rank.dump());
    EXPECT_GT(rank["storage_hit_tokens"].get<double>(), 0);
    EXPECT_GT(rank["l3_to_l2_pages"].get<double>(), 0);
    EXPECT_GT(rank["verified_pages"].get<double>(), 0);
    EXPECT_EQ(rank["mismatched_pages"].get<double>(), 0);
    if (rank["rank"] == 0) {
      EXPECT_GT(rank["l2_to_l3_pages"].get<double>(), 0);
    } else {
      EXPECT_EQ(rank["l2_to_l3_pages"].get<double>(), 0);
    }
  }
}

// --storage is the store of the tier its backend names: its keys are used there (records land
// in its root), and it is refused (exit 2, naming it) where no configuration run uses it, where
// a flag names the same thing, and where its backend is not a tier. SGLang's store keys are
// refused with the way to say it.
TEST(HicacheBench, StorageObjectIsTheStoreOfItsTierAndRefusedWhereNothingUsesIt) {
  TempFile root("hicache-bench-user-store"), report("hicache-bench-user-store.json");
  const std::string store =
      R"('{"backend": "file", "root": ")" + root.path.string() + R"(", "io_threads": 1}')";
  BenchRun r = run_bench(kTiny + "--clients 4 --rounds 3 --tiers file --storage " + store +
                         " --report " + report.path.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const json c = read_json(report.path)["configurations"][0];
  check_adds_up(c, 12);
  std::size_t records = 0;
  for (const auto& e : fs::directory_iterator(root.path)) records += e.is_regular_file() ? 1 : 0;
  EXPECT_GT(records, 0u) << "nothing stored in the --storage root";
  EXPECT_GE(static_cast<double>(records), c["tiers"]["l2_to_l3"]["pages"].get<double>());

  r = run_bench(kTiny + "--tiers host --storage " + store);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("storage (backend 'file') is the store of the file tier, and no "
                          "configuration run uses it (host)"),
            std::string::npos)
      << r.output;
  // The same store given as "storage" in a --config file: refused for the host tier too.
  TempFile host_config("hicache-bench-host-storage.json");
  {
    std::ofstream(host_config.path) << R"({"tiers": "host", "storage": {"backend": "file", "root": ")"
                                    << root.path.string() << R"("}})";
  }
  r = run_bench(kTiny + "--config " + host_config.path.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("storage (backend 'file') is the store of the file tier, and no "
                          "configuration run uses it (host)"),
            std::string::npos)
      << r.output;
  r = run_bench(kTiny + "--compare --compare-configs device,host --storage " + store);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("no configuration run uses it (device, host)"), std::string::npos)
      << r.output;
  r = run_bench(kTiny + "--tiers file --storage-dir /tmp --storage " + store);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("storage.root and --storage-dir both name"), std::string::npos)
      << r.output;
  r = run_bench(kTiny + R"(--tiers file --storage '{"backend": "s3"}')");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("storage: backend 's3'"), std::string::npos) << r.output;
  // A redis store object is the redis tier's Redis (here one nobody answers for, named).
  r = run_bench(
      kTiny + R"(--tiers redis --storage '{"backend": "redis", "host": "127.0.0.1", "port": 1}')");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:1 does not answer at start"), std::string::npos) << r.output;
  r = run_bench(kTiny +
                R"(--tiers redis --redis 127.0.0.1:1 --storage '{"backend": "redis", "port": 7}')");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--redis both name the Redis"), std::string::npos) << r.output;
  TempFile config("hicache-bench-sglang-store.json");
  { std::ofstream(config.path) << R"({"hicache_storage_backend": "file"})"; }
  r = run_bench("--config " + config.path.string());
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'hicache_storage_backend' (SGLang's) is not taken"),
            std::string::npos)
      << r.output;
}

// The TP group's keys are hicache-bench's to set (--tp N starts the ranks): given by hand they
// are refused at once, naming the key, instead of one process waiting for peers that never
// come; the group's timeouts without --tp would be read by nothing, and are refused too.
TEST(HicacheBench, TpGroupKeysWithoutTpAreRefusedAtOnce) {
  for (const std::string args :
       {"--tp-rank 1 --tp-size 2", "--tp-size 2", "--tp-store-dir /tmp/x", "--tp 2 --tp-rank 0"}) {
    SCOPED_TRACE(args);
    const auto start = std::chrono::steady_clock::now();
    const BenchRun r = run_bench(args);
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("this tool starts its TP ranks itself (--tp N)"), std::string::npos)
        << r.output;
    // The rendezvous would have waited tp_connect_timeout_ms (120 s) for the missing peer; the
    // refusal comes before anything starts (10-90 ms measured, 2026-11-28).
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  }
  const BenchRun r = run_bench("--tp-timeout-ms 500");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'tp_timeout_ms' applies to TP groups only"), std::string::npos)
      << r.output;
}

}  // namespace
