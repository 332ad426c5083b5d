#include "tools/workload/simulated_engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <thread>

#include "pools/kv_layout.h"
#include "tools/workload/engine_stack.h"
#include "tools/workload/report.h"
#include "storage/file_storage.h"
#include "tests/controller/faulty_device.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;
constexpr std::int32_t kPage = 4;

KVGeometry geometry() { return KVGeometry::mha(3, 1, 8, DType::kFloat16, kPage); }

KeyNamespace key_ns() {
  return {.model = "sim", .fingerprint = "r1", .dtype = "fp16", .layout = "layer_first",
          .page_size = kPage};
}

// The file store, with a gate a test may hold to keep prefetch reads waiting.
class GatedStore final : public StorageBackend {
 public:
  explicit GatedStore(StorageBackend& inner) : inner_(inner) {}
  std::string_view name() const override { return "gated"; }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    return inner_.batch_exists(keys);
  }
  bool remove(const std::string& key) override { return inner_.remove(key); }
  void clear() override { inner_.clear(); }
  std::mutex gate;
  std::atomic<int> reads_at_gate{0};

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    ++reads_at_gate;
    std::lock_guard pass(gate);
    return inner_.batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    return inner_.batch_set(keys, src);
  }

 private:
  StorageBackend& inner_;
};

// One engine: pools, controllers, tree, main loop; L3 is a file store under `root` (shared by
// engines built on the same root).
struct Stack {
  testing::FaultyDevice device;  // the host backend; its loads fail only when a test says so
  DeviceKVPool device_pool;
  HostKVPool host_pool;
  HiCacheController controller;
  FileStorage file;
  GatedStore store{file};
  LocalCollective local;
  KeyNamespace ns = key_ns();
  StorageController storage;
  HiRadixCache cache;
  SimulatedEngine engine;
  Stack(const fs::path& root, std::int64_t device_pages, std::int64_t host_pages,
        SimulatedEngineConfig config = {}, RadixCacheConfig radix = {})
      : device_pool(device, geometry(), device_pages * kPage),
        host_pool(device, geometry(), HostLayout::kLayerFirst, host_pages * kPage),
        controller(device, device_pool, host_pool,
                   ControllerConfig{.write_policy = WritePolicy::kWriteThrough}),
        file(FileStorageConfig{.root = root.string()}),
        storage(host_pool, store, ns, local, local, local,
                {.policy = PrefetchPolicy::kWaitComplete}),
        cache(controller, device_pool, host_pool, radix, radix.host_tier ? &storage : nullptr,
              radix.host_tier ? &ns : nullptr),
        engine(cache, controller, device_pool, host_pool, device, config) {}
};

// A fresh directory, removed when the guard goes: declared before the Stack that uses it, so
// the file store (and its background unlink thread) is gone before the directory is removed.
struct TempRoot {
  fs::path path;
  explicit TempRoot(const std::string& name)
      : path(fs::temp_directory_path() / str_cat("hicache-sim-", name, "-", ::getpid())) {
    fs::remove_all(path);
  }
  ~TempRoot() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  operator const fs::path&() const { return path; }
};

// Requests over `families` shared prompts of 12 pages, each 2-12 pages long plus 0-2 own pages.
std::vector<SimulatedRequest> workload(int n, int families, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<SimulatedRequest> out;
  for (int i = 0; i < n; ++i) {
    SimulatedRequest r{str_cat("r", seed, "-", i), {}};
    const int f = static_cast<int>(rng() % families);
    const int shared = (2 + static_cast<int>(rng() % 11)) * kPage;
    for (int t = 0; t < shared; ++t) r.tokens.push_back(f * 10000 + t);
    const int own = static_cast<int>(rng() % 3) * kPage;
    for (int t = 0; t < own; ++t) r.tokens.push_back(1000000 + i * 100 + t);
    out.push_back(std::move(r));
  }
  return out;
}

// The bench's report echoes every setting: secrets at any depth are replaced, nothing else is.
TEST(BenchReport, SecretsInTheSettingsAreRedacted) {
  const nlohmann::json settings = nlohmann::json::parse(R"({
      "clients": 4,
      "cache": {"storage": {"backend": "redis", "host": "h", "password": "hunter2",
                            "tls": {"Private_Key": "k", "ca": "ca.pem"}},
                "model": {"layers": 2}},
      "list": [{"api_token": "t"}, {"name": "x"}]})");
  const nlohmann::json r = workload::redact_secrets(settings);
  EXPECT_EQ(r["cache"]["storage"]["password"], "<redacted>");
  EXPECT_EQ(r["cache"]["storage"]["tls"]["Private_Key"], "<redacted>");
  EXPECT_EQ(r["list"][0]["api_token"], "<redacted>");
  EXPECT_EQ(r["cache"]["storage"]["tls"]["ca"], "ca.pem");
  EXPECT_EQ(r["cache"]["storage"]["host"], "h");
  EXPECT_EQ(r["list"][1]["name"], "x");
  EXPECT_EQ(r["clients"], 4);
  EXPECT_EQ(r.dump().find("hunter2"), std::string::npos);
  EXPECT_EQ(settings["cache"]["storage"]["password"], "hunter2") << "the input is not changed";
}

TEST(SimulatedEngine, ServesEveryRequestThroughAllThreeTiersWithCorrectBytes) {
  const TempRoot root("tiers");
  {
    Stack s(root, 40, 48, {.max_batch = 4});
    // Two halves, with every backup landed in between, so that the second half's requests for
    // prompts the host pool no longer holds find them in L3 whatever the threads' timing.
    for (auto& r : workload(150, 8, 1)) s.engine.submit(std::move(r));
    s.engine.run_until_idle(2'000'000);  // a livelock fails below instead of hanging the suite
    while (s.cache.stats().backups_in_flight > 0 || s.cache.stats().writes_in_flight > 0) {
      s.cache.check_events();
    }
    for (auto& r : workload(150, 8, 3)) s.engine.submit(std::move(r));
    s.engine.run_until_idle(2'000'000);
    const auto& st = s.engine.stats();
    const auto cs = s.cache.stats();
    ASSERT_EQ(s.engine.waiting(), 0u)
        << "stuck: writes " << cs.writes_in_flight << " loads " << cs.loads_in_flight
        << " backups " << cs.backups_in_flight << " prefetches " << s.cache.prefetches_in_flight()
        << " device tokens " << cs.device_tokens << " host tokens " << cs.host_tokens
        << " free device " << s.device_pool.allocator().free_tokens() << " free host "
        << s.host_pool.free_tokens() << " device slots in the pending loads? steps " << st.steps;
    EXPECT_EQ(st.finished, 300);
    EXPECT_EQ(st.mismatched_pages, 0) << s.engine.first_mismatch();
    EXPECT_GT(st.verified_pages, 500);
    EXPECT_GT(st.device_hit_tokens, 0);
    EXPECT_GT(st.loaded_back_tokens, 0) << "host -> device never used";
    EXPECT_GT(s.cache.stats().prefetched_tokens, 0) << "L3 -> host never used";
    EXPECT_EQ(st.rejected, 0);
    EXPECT_EQ(s.cache.check_invariants(), "");
    std::printf("steps %lld, prompt %lld tokens: device %lld, loaded back %lld, computed %lld; "
                "prefetched %lld; %lld pages verified\n",
                static_cast<long long>(st.steps), static_cast<long long>(st.prompt_tokens),
                static_cast<long long>(st.device_hit_tokens),
                static_cast<long long>(st.loaded_back_tokens),
                static_cast<long long>(st.computed_tokens),
                static_cast<long long>(s.cache.stats().prefetched_tokens),
                static_cast<long long>(st.verified_pages));
  }
}

// The path CUDA takes (the CPU cannot read device memory): pages are written and verified
// through a pinned staging page and copies. Same bytes through all three tiers, and a page
// corrupted on the device behind the engine's back is caught.
TEST(SimulatedEngine, StagedPageDataIsVerifiedThroughCopiesAndCatchesACorruptPage) {
  const TempRoot root("staged");
  Stack s(root, 40, 48, {.max_batch = 4, .stage_page_data = true});
  auto settle = [&] {  // bounded: a lost ack fails the test instead of hanging the suite
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((s.cache.stats().backups_in_flight > 0 || s.cache.stats().writes_in_flight > 0) &&
           std::chrono::steady_clock::now() < give_up) {
      s.cache.check_events();
    }
    ASSERT_EQ(s.cache.stats().writes_in_flight, 0);
    ASSERT_EQ(s.cache.stats().backups_in_flight, 0);
  };
  for (auto& r : workload(80, 6, 5)) s.engine.submit(std::move(r));
  s.engine.run_until_idle(2'000'000);
  settle();
  for (auto& r : workload(80, 6, 6)) s.engine.submit(std::move(r));
  s.engine.run_until_idle(2'000'000);
  settle();
  const SimulatedEngineStats st = s.engine.stats();
  ASSERT_EQ(st.finished, 160);
  EXPECT_EQ(st.mismatched_pages, 0) << s.engine.first_mismatch();
  EXPECT_GT(st.verified_pages, 100);
  EXPECT_GT(st.loaded_back_tokens, 0) << "host -> device never used";
  EXPECT_GT(s.cache.stats().prefetched_tokens, 0) << "L3 -> host never used";

  // A prompt served just now is on the device; its bytes there are then overwritten.
  std::vector<std::int32_t> prompt;
  for (int t = 0; t < 6 * kPage; ++t) prompt.push_back(777000 + t);
  const int copies_before = s.device.copies_to_device;
  s.engine.submit({"first", prompt, 1});
  s.engine.run_until_idle();
  settle();
  // A fresh prompt loads nothing: its 6 whole pages (prompt and answer) reach the device only
  // through the staging, one copy call each.
  EXPECT_EQ(s.device.copies_to_device - copies_before, 6) << "the staging path was not taken";
  const LayoutDesc& pool = s.device_pool.layout();
  std::memset(pool.base, 0x5A, s.device_pool.size_bytes());
  s.engine.submit({"again", prompt, 1});
  s.engine.run_until_idle();
  const auto done = s.engine.drain_finished();
  ASSERT_FALSE(done.empty());
  EXPECT_EQ(done.back().device_hit_tokens, 5 * kPage) << "the prompt was not found on the device";
  EXPECT_EQ(s.engine.stats().mismatched_pages, 5) << "a corrupt device page went unnoticed";
  EXPECT_NE(s.engine.first_mismatch().find("request again page 0"), std::string::npos)
      << s.engine.first_mismatch();
}

TEST(SimulatedEngine, AWarmRestartFindsItsPagesInStorage) {
  const TempRoot root("restart");
  auto requests = workload(60, 4, 2);
  std::int64_t first_computed = 0;
  {
    Stack s(root, 64, 128);
    for (auto r : requests) s.engine.submit(std::move(r));
    s.engine.run_until_idle();
    first_computed = s.engine.stats().computed_tokens;
    // Let every backup land before the "crash".
    while (s.cache.stats().backups_in_flight > 0 || s.cache.stats().writes_in_flight > 0) {
      s.cache.check_events();
    }
  }
  Stack again(root, 64, 128);
  for (auto r : requests) again.engine.submit(std::move(r));
  again.engine.run_until_idle();
  const auto& st = again.engine.stats();
  EXPECT_EQ(st.finished, 60);
  EXPECT_EQ(st.mismatched_pages, 0) << again.engine.first_mismatch();
  EXPECT_LT(st.computed_tokens, first_computed / 4) << "the restarted engine recomputed most";
  EXPECT_GT(again.cache.stats().prefetched_tokens, 0);
}

// SGLang #39436's shape on the hybrid reference model (a recurrent state of 6 layers
// checkpointed every 4 pages and at each sequence's end, beside the KV): 8 conversations of 12
// pages (24 checkpoints; the device holds 32, so a batch of all 8 replays fits), their device
// copies evicted, replayed: 8 of 8 restore their whole prompt from the host,
// state included (SGLang's host state pool was too small and got 0 of 8), compute nothing, and
// every KV and state page they read is the one computed from scratch. By the engine's cost
// model recomputing the 8 prompts takes 8 x 48 tokens x 3 layers x 100 us = 115 ms; the
// replay's loads took what the controller measured (printed: about 2 ms on the 2-core machine).
TEST(SimulatedEngine, EightHybridConversationsReplayedFromTheHostAllHit) {
  const HiCacheConfig cache = HiCacheConfig::from_json_text(R"({
      "device": "host", "page_size": 4, "device_tokens": 512, "host_ratio": 2,
      "write_policy": "write_through", "model": {"layers": 3, "kv_heads": 1, "head_dim": 8},
      "sidecars": {"state": {"policy": "trailing", "layers": 6, "slot_bytes": 256,
                             "dtype": "fp32", "device_pages": 32, "host_pages": 64}}})");
  constexpr double kCost = 1e-4;  // seconds per token per layer
  workload::EngineStack stack({.cache = cache,
                               .engine = {.cost_per_token_layer = kCost, .use_storage = false}});
  SimulatedEngine& e = stack.engine();
  auto conversation = [](int c) {
    SimulatedRequest r{.id = str_cat("c", c)};
    for (int i = 0; i < 12 * kPage; ++i) r.tokens.push_back(c * 1000 + i);
    return r;
  };
  for (int c = 0; c < 8; ++c) e.submit(conversation(c));
  e.run_until_idle();
  e.flush();
  (void)e.drain_finished();
  HiRadixCache& tree = stack.cache();
  tree.evict_device(1 << 20);  // every device copy (the state pool's room took some already)
  ASSERT_EQ(tree.stats().device_tokens, 0);
  ASSERT_EQ(tree.stats().host_tokens, 8 * 12 * kPage) << "every conversation on the host";
  const double load_seconds = stack.controller().stats().load_seconds;
  const std::int64_t verified_states = e.stats().verified_sidecar_pages;
  for (int c = 0; c < 8; ++c) {
    SimulatedRequest r = conversation(c);
    r.id += "-replay";
    e.submit(std::move(r));
  }
  e.run_until_idle();
  const auto replays = e.drain_finished();
  ASSERT_EQ(replays.size(), 8u);
  for (const FinishedRequest& f : replays) {
    EXPECT_EQ(f.host_hit_tokens, 12 * kPage) << f.id << ": not a whole host hit";
    EXPECT_EQ(f.computed_tokens, 0) << f.id;
  }
  EXPECT_EQ(e.stats().verified_sidecar_pages - verified_states, 8) << "one state per replay";
  EXPECT_EQ(e.stats().mismatched_pages, 0) << e.first_mismatch();
  const double replay_loads = stack.controller().stats().load_seconds - load_seconds;
  std::printf("#39436 shape: 8/8 host hits; recompute by the cost model %.1f ms, replay loads "
              "%.3f ms\n",
              8 * 12 * kPage * 3 * kCost * 1e3, replay_loads * 1e3);
}

TEST(SimulatedEngine, ComputeFollowsTheCostModel) {
  const TempRoot root("cost");
  Stack s(root, 64, 128, {.cost_per_token_layer = 2e-6, .use_storage = false});
  s.engine.submit({"a", std::vector<std::int32_t>(10 * kPage, 7)});
  s.engine.run_until_idle();
  const auto& st = s.engine.stats();
  EXPECT_EQ(st.computed_tokens, 10 * kPage);
  EXPECT_NEAR(st.compute_seconds, 10 * kPage * 3 * 2e-6, 1e-9);
  EXPECT_GE(st.step_seconds, st.compute_seconds);
}

TEST(SimulatedEngine, BadInputIsNamedAndOversizedRequestsAreRejected) {
  const TempRoot root("bad");
  Stack s(root, 4, 8, {.use_storage = false});
  EXPECT_THROW(s.engine.submit({"tiny", std::vector<std::int32_t>(kPage - 1, 1)}),
               InvalidArgument);
  EXPECT_THROW(SimulatedEngine(s.cache, s.controller, s.device_pool, s.host_pool, s.device,
                               {.max_batch = 0}),
               InvalidArgument);
  s.engine.submit({"huge", std::vector<std::int32_t>(5 * kPage, 1)});  // 5 pages, pool holds 4
  s.engine.submit({"fits", std::vector<std::int32_t>(2 * kPage, 2)});
  s.engine.run_until_idle();  // steps while acks are in flight: no step count to rely on
  EXPECT_EQ(s.engine.stats().rejected, 1);
  EXPECT_EQ(s.engine.stats().finished, 1);
}

// A conversation: round 1 is a prompt and an answer decoded token by token; round 2's prompt is
// round 1's prompt, its answer and a new question. The answer's pages are cached at the end of
// round 1, so round 2 computes only the question.
TEST(SimulatedEngine, DecodedAnswersAreCachedForTheNextRound) {
  const TempRoot root("decode");
  Stack s(root, 64, 128, {.decode_step_seconds = 1e-4, .use_storage = false});
  std::vector<std::int32_t> round1;
  for (int t = 0; t < 10 * kPage; ++t) round1.push_back(100 + t);  // 8 pages prompt, 2 answer
  s.engine.submit({"c0-r1", round1, 2 * kPage});
  s.engine.run_until_idle();
  auto done = s.engine.drain_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, "c0-r1");
  EXPECT_EQ(done[0].prompt_tokens, 8 * kPage);
  EXPECT_EQ(done[0].output_tokens, 2 * kPage);
  EXPECT_EQ(done[0].computed_tokens, 8 * kPage);
  EXPECT_EQ(s.engine.stats().decode_steps, 2 * kPage - 1) << "prefill makes the first token";
  // Sleeps give lower bounds only: e2e covers 7 decode steps of >= 100 us after the TTFT.
  EXPECT_GE(done[0].e2e_s - done[0].ttft_s, (2 * kPage - 1) * 1e-4);
  EXPECT_GE(done[0].itl_s, 1e-4);
  EXPECT_GT(done[0].ttft_s, 0);

  auto round2 = round1;
  for (int t = 0; t < 2 * kPage; ++t) round2.push_back(5000 + t);
  s.engine.submit({"c0-r2", round2, 1});
  s.engine.run_until_idle();
  done = s.engine.drain_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].prompt_tokens, 12 * kPage - 1);
  EXPECT_EQ(done[0].device_hit_tokens, 10 * kPage) << "the answer of round 1 was not cached";
  EXPECT_EQ(done[0].computed_tokens, 2 * kPage - 1);
  EXPECT_EQ(done[0].itl_s, 0);
  EXPECT_EQ(s.engine.stats().mismatched_pages, 0) << s.engine.first_mismatch();
  EXPECT_EQ(s.engine.stats().verified_pages, 10);
  EXPECT_TRUE(s.engine.drain_finished().empty());
  EXPECT_THROW(s.engine.submit({"all-answer", round1, static_cast<std::int32_t>(round1.size())}),
               InvalidArgument);
  EXPECT_THROW(SimulatedEngine(s.cache, s.controller, s.device_pool, s.host_pool, s.device,
                               {.max_batch = 8, .max_running = 4}),
               InvalidArgument);
}

// A 6-page prompt an engine on `root` served and backed up to L3 (then went away).
std::vector<std::int32_t> prompt_in_storage(const fs::path& root) {
  std::vector<std::int32_t> prompt;
  for (int t = 0; t < 6 * kPage; ++t) prompt.push_back(7 + 3 * t);
  Stack first(root, 64, 128);
  first.engine.submit({"a", prompt, 1});
  first.engine.flush();
  EXPECT_EQ(first.cache.stats().backups_in_flight, 0);
  EXPECT_GT(first.cache.stats().stored_tokens, 0);
  return prompt;
}

// A second engine on the same L3 finds a conversation's pages there: its report counts them as
// storage hits, and they are byte-for-byte what the first engine computed.
TEST(SimulatedEngine, StorageHitsAreAttributedToTheRequestThatFetchedThem) {
  const TempRoot root("attribution");
  const auto prompt = prompt_in_storage(root);
  Stack second(root, 64, 128);
  auto again = prompt;
  again.push_back(99);  // the prompt is the 6 pages; one token of answer
  second.engine.submit({"b", again, 1});
  second.engine.run_until_idle();
  const auto done = second.engine.drain_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].storage_hit_tokens, 6 * kPage);
  EXPECT_EQ(done[0].host_hit_tokens, 0);
  EXPECT_EQ(done[0].device_hit_tokens, 0);
  EXPECT_EQ(done[0].computed_tokens, 0);
  EXPECT_EQ(second.engine.stats().verified_pages, 6);
  EXPECT_EQ(second.engine.stats().mismatched_pages, 0) << second.engine.first_mismatch();
}

// A step that can run nothing (its request waits for a prefetch) is followed by a sleep until
// the prefetch moves on, not by spinning: with the read held up for 100 ms, the whole request
// takes fewer than 50 calls of step() (a spinning loop used them up in microseconds and left
// the request unfinished).
TEST(SimulatedEngine, AStalledEngineSleepsUntilThePrefetchMovesOn) {
  const TempRoot root("stalled");
  const auto prompt = prompt_in_storage(root);
  Stack second(root, 64, 128);
  std::unique_lock gate(second.store.gate);
  auto again = prompt;
  again.push_back(99);
  second.engine.submit({"b", again, 1});
  std::thread loop([&] { second.engine.run_until_idle(50); });
  while (second.store.reads_at_gate.load() == 0) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  gate.unlock();
  loop.join();
  const auto& st = second.engine.stats();
  EXPECT_EQ(st.finished, 1) << "the engine polled while it waited for the prefetch";
  EXPECT_EQ(st.mismatched_pages, 0) << second.engine.first_mismatch();
  EXPECT_EQ(second.cache.stats().prefetched_tokens, 6 * kPage);
}

// The backstop: a wait with nothing at all happening (an op that never answers would be a bug)
// ends after kQuietWait and says so, which is how run_until_idle() and flush() give up instead
// of sleeping forever.
TEST(SimulatedEngine, AWaitWithNothingHappeningEndsAfterTheQuietWait) {
  const TempRoot root("quiet");
  const auto prompt = prompt_in_storage(root);
  Stack second(root, 64, 128);
  std::unique_lock gate(second.store.gate);
  second.engine.submit({"b", prompt, 1});
  while (second.store.reads_at_gate.load() == 0) {
    second.engine.step();
    second.engine.wait_for_progress(std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  }
  second.engine.step();  // stalled, and nothing can happen until the gate opens
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(second.engine.wait_for_progress());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, SimulatedEngine::kQuietWait);
  gate.unlock();
  second.engine.run_until_idle();
  EXPECT_EQ(second.engine.stats().finished, 1);
}

// The --compare baseline: no hierarchy. Nothing reaches the host, evicted pages are recomputed.
// A load that fails (its copy could not be issued) while a prefill waits on it: the prefill is
// dropped, not run on the bytes that never arrived; its requests give their slots back and are
// admitted again, the failed load's device slots are freed by its ack first, and the second
// admission loads the pages again and serves them with correct bytes. Nothing leaks.
TEST(SimulatedEngine, AFailedLoadDropsThePrefillAndItsRequestsAreServedAgain) {
  const TempRoot root("failed-load");
  Stack s(root, 64, 128, {.use_storage = false});
  std::vector<SimulatedRequest> requests = workload(6, 1, 9);  // one family: shared prefixes
  for (const auto& r : requests) s.engine.submit(r);
  s.engine.run_until_idle();
  s.engine.flush();  // every page written to the host
  s.cache.evict_device(s.device_pool.capacity_tokens());  // the tree is on the host only
  ASSERT_EQ(s.cache.stats().device_tokens, 0);
  const auto before = s.engine.stats();
  s.device.fail_loads = 1;
  for (auto& r : requests) {
    r.id += "-again";
    s.engine.submit(r);
  }
  s.engine.run_until_idle();
  s.engine.flush();
  const auto& st = s.engine.stats();
  EXPECT_EQ(s.device.failed, 1) << "the injected failure never hit a load";
  EXPECT_EQ(s.controller.stats().load_failures, 1u);
  EXPECT_GE(st.failed_prefills, 1);
  EXPECT_EQ(st.mismatched_pages, 0) << s.engine.first_mismatch();
  EXPECT_EQ(st.finished - before.finished, static_cast<std::int64_t>(requests.size()));
  EXPECT_GT(st.loaded_back_tokens, before.loaded_back_tokens) << "the retry loaded the pages";
  EXPECT_GT(st.verified_pages, before.verified_pages);
  EXPECT_EQ(st.rejected, 0);
  // Every device slot is the tree's again, every host page too.
  const auto cs = s.cache.stats();
  EXPECT_EQ(s.device_pool.capacity_tokens() - s.device_pool.allocator().free_tokens(),
            cs.device_tokens);
  EXPECT_EQ(s.host_pool.capacity_tokens() - s.host_pool.free_tokens(), cs.host_tokens);
  EXPECT_EQ(cs.loads_in_flight, 0);
  EXPECT_EQ(s.cache.check_invariants(), "");
}

TEST(SimulatedEngine, DeviceOnlyCacheWritesNothingToTheHost) {
  const TempRoot root("device-only");
  Stack s(root, 16, 8, {.use_storage = false}, {.host_tier = false});
  for (auto& r : workload(40, 6, 5)) s.engine.submit(std::move(r));
  s.engine.run_until_idle(2'000'000);
  const auto& st = s.engine.stats();
  EXPECT_EQ(st.finished, 40);
  EXPECT_EQ(st.mismatched_pages, 0) << s.engine.first_mismatch();
  EXPECT_GT(st.device_hit_tokens, 0);
  EXPECT_EQ(st.loaded_back_tokens, 0);
  EXPECT_GT(s.cache.stats().evicted_device_tokens, 0);
  EXPECT_EQ(s.controller.stats().writes_done, 0u);
  EXPECT_EQ(s.host_pool.free_tokens(), s.host_pool.capacity_tokens());
  EXPECT_EQ(s.cache.check_invariants(), "");
  // Its illegal twin: a device-only cache with a storage tier.
  EXPECT_THROW(HiRadixCache(s.controller, s.device_pool, s.host_pool, {.host_tier = false},
                            &s.storage, &s.ns),
               InvalidArgument);
}

// reset() under traffic, at many different points: every request in flight is aborted, both
// pools are entirely free at once, the tree is empty and consistent, and the engine then serves
// a new workload with correct bytes, finding in L3 what was backed up before the reset.
TEST(SimulatedEngine, ResetUnderTrafficFreesEverythingAndServesAgain) {
  const TempRoot root("reset");
  Stack s(root, 40, 48, {.max_batch = 4, .decode_step_seconds = 0});
  std::mt19937 rng(11);
  std::int64_t aborted = 0;
  for (int round = 0; round < 30; ++round) {
    auto requests = workload(20, 5, 100 + static_cast<std::uint32_t>(round));
    for (auto& r : requests) {
      r.output_tokens = static_cast<std::int32_t>(rng() % 6);
      s.engine.submit(std::move(r));
    }
    const int steps = static_cast<int>(rng() % 12);
    for (int i = 0; i < steps; ++i) s.engine.step();
    // Every tenth round lets its writes and backups land first, so that L3 surely holds pages
    // from before the resets (otherwise whether any backup beat a reset is up to the threads).
    if (round % 10 == 0) s.engine.flush();
    const std::size_t n = s.engine.reset();
    aborted += static_cast<std::int64_t>(n);
    ASSERT_EQ(s.device_pool.allocator().free_tokens(), s.device_pool.capacity_tokens()) << round;
    ASSERT_EQ(s.host_pool.free_tokens(), s.host_pool.capacity_tokens()) << round;
    ASSERT_EQ(s.cache.stats().nodes, 0) << round;
    ASSERT_EQ(s.cache.check_invariants(), "") << round;
    ASSERT_EQ(s.engine.waiting() + s.engine.decoding(), 0u);
    std::size_t reported_aborted = 0;
    for (const auto& f : s.engine.drain_finished()) reported_aborted += f.aborted ? 1 : 0;
    ASSERT_EQ(reported_aborted, n);
  }
  EXPECT_GT(aborted, 0);
  EXPECT_EQ(s.cache.stats().resets, 30);
  EXPECT_EQ(s.engine.stats().mismatched_pages, 0) << s.engine.first_mismatch();
  // Afterwards: a full workload, every page correct, L3 pages written before the resets found.
  for (auto& r : workload(60, 5, 7)) s.engine.submit(std::move(r));
  s.engine.run_until_idle(2'000'000);
  EXPECT_EQ(s.engine.waiting(), 0u);
  EXPECT_EQ(s.engine.stats().mismatched_pages, 0) << s.engine.first_mismatch();
  EXPECT_GT(s.engine.stats().verified_pages, 0);
  EXPECT_GT(s.cache.stats().prefetched_tokens, 0) << "nothing found in L3 after the resets";
  EXPECT_EQ(s.cache.check_invariants(), "");
}

TEST(SimulatedEngine, CachedPrefixTokensLeavesTheTreeAsItWas) {
  const TempRoot root("peek");
  Stack s(root, 64, 128, {.use_storage = false});
  std::vector<std::int32_t> tokens;
  for (int t = 0; t < 6 * kPage; ++t) tokens.push_back(t);
  s.engine.submit({"a", tokens, 1});
  s.engine.run_until_idle();
  const std::string before = s.cache.describe();
  auto probe = std::vector<std::int32_t>(tokens.begin(), tokens.begin() + 3 * kPage);
  probe.push_back(-1);  // ends inside the node, then a partial page
  EXPECT_EQ(s.cache.cached_prefix_tokens(probe), 3 * kPage);
  EXPECT_EQ(s.cache.cached_prefix_tokens(tokens), 6 * kPage);
  probe[kPage] = -5;  // differs in page 2
  EXPECT_EQ(s.cache.cached_prefix_tokens(probe), kPage);
  EXPECT_EQ(s.cache.describe(), before) << "the probe split or touched a node";
}

}  // namespace
}  // namespace hicache
