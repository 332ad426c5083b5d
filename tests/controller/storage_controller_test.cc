#include "controller/storage_controller.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <chrono>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;
constexpr std::int32_t kPage = 4;

KVGeometry geometry() { return KVGeometry::mha(2, 2, 8, DType::kFloat16, kPage); }

// Wraps a backend; batch_set fails (error) every key from the `fail_from`-th key it is asked to
// store on, or throws when `throw_all` is set.
class FaultyStorage final : public StorageBackend {
 public:
  explicit FaultyStorage(StorageBackend& inner) : inner_(inner) {}
  std::string_view name() const override { return "faulty"; }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    std::lock_guard hold(gate);  // a test holds the gate to keep a prefetch in its hit query
    return inner_.batch_exists(keys);
  }
  std::mutex gate;
  bool remove(const std::string& key) override { return inner_.remove(key); }
  void clear() override { inner_.clear(); }
  // Records each chain it is touched with; a test holding touch_gate keeps the caller inside.
  void touch(std::span<const std::string> keys) override {
    touch_entered.fetch_add(1);
    std::lock_guard hold(touch_gate);
    std::lock_guard lock(touch_mu);
    touched.emplace_back(keys.begin(), keys.end());
  }
  std::vector<std::vector<std::string>> touched_chains() {
    std::lock_guard lock(touch_mu);
    return touched;
  }
  std::mutex touch_gate, touch_mu;
  std::vector<std::vector<std::string>> touched;
  std::atomic<int> touch_entered{0};
  std::atomic<std::int64_t> fail_from{-1};      // batch_set: keys from this index on fail
  std::atomic<bool> throw_all{false};           // batch_set throws
  std::atomic<std::int64_t> get_fail_from{-1};  // batch_get: keys from this index on fail
  std::atomic<bool> throw_get{false};           // batch_get throws
  std::atomic<int> set_calls{0}, get_calls{0};

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    ++get_calls;
    if (throw_get) throw std::runtime_error("backend exploded on read");
    return inject(inner_.batch_get(keys, dst), get_seen_, get_fail_from, "injected read failure");
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    ++set_calls;
    if (throw_all) throw std::runtime_error("backend exploded");
    return inject(inner_.batch_set(keys, src), seen_, fail_from, "injected failure");
  }

 private:
  // Turns every result from the `fail_from`-th key seen on into an error.
  static std::vector<IoResult> inject(std::vector<IoResult> out, std::atomic<std::int64_t>& seen,
                                      std::int64_t fail_from, const char* why) {
    const std::int64_t first = seen.fetch_add(static_cast<std::int64_t>(out.size()));
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (fail_from >= 0 && first + static_cast<std::int64_t>(i) >= fail_from) {
        out[i] = IoResult::error(why);
      }
    }
    return out;
  }

  StorageBackend& inner_;
  std::atomic<std::int64_t> seen_{0};      // several controllers may share one test backend
  std::atomic<std::int64_t> get_seen_{0};
};

KeyNamespace test_ns() {
  return {.model = "m", .fingerprint = "f", .dtype = "fp16", .layout = "l", .page_size = kPage};
}

// Three collectives for one rank: prefetch thread, backup thread, caller.
struct Comms {
  std::shared_ptr<InProcessGroup> group_prefetch, group_backup, group_main;  // set first
  std::vector<std::unique_ptr<Collective>> prefetch, backup, main;
  explicit Comms(int size)
      : prefetch(InProcessGroup::make_ranks(size, std::chrono::seconds(30), &group_prefetch)),
        backup(InProcessGroup::make_ranks(size, std::chrono::seconds(30), &group_backup)),
        main(InProcessGroup::make_ranks(size, std::chrono::seconds(30), &group_main)) {}
  std::string divergence() const {
    return group_prefetch->divergence() + group_backup->divergence() + group_main->divergence();
  }
};

std::vector<BackupAck> wait_acks(StorageController& c, std::size_t n) {
  std::vector<BackupAck> acks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (acks.size() < n && std::chrono::steady_clock::now() < deadline) {
    if (c.drain_backup_acks(acks) == 0) std::this_thread::yield();
  }
  return acks;
}

struct Rank {
  HostDevice device;
  HostKVPool host;
  fs::path root;
  FileStorage file;
  FaultyStorage storage{file};
  Rank(HostLayout layout, const std::string& name)
      : host(device, geometry(), layout, 16 * kPage),
        root(fs::temp_directory_path() / str_cat("hicache-sc-", name, "-", ::getpid())),
        file(FileStorageConfig{.root = (fs::remove_all(root), root.string())}) {}
  ~Rank() { fs::remove_all(root); }

  // Allocates `pages` host pages filled with the data of keys 1000 + i.
  std::vector<std::int64_t> filled_pages(int pages) {
    auto slots = host.alloc(pages * kPage).value();  // throws rather than run past the pool
    for (int i = 0; i < pages; ++i) fill_page(host.layout(), slots[i * kPage] / kPage, 1000 + i);
    return slots;
  }
};

std::vector<std::string> keys_for(const std::string& stem, int pages) {
  std::vector<std::string> keys;
  for (int i = 0; i < pages; ++i) keys.push_back(str_cat(stem, "-", i));
  return keys;
}

// Waits (up to 10 s) until `done` holds.
template <class F>
bool eventually(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// touch(): each chain reaches the store as it was given, in the order given, on the touch thread;
// a bad key is refused with nothing queued; beyond kMaxPendingTouchKeys waiting, and after
// stop(), chains are dropped and counted, never queued.
TEST(StorageControllerTouch, ChainsReachTheStoreInOrderAndTheRestIsDroppedAndCounted) {
  Rank r(HostLayout::kLayerFirst, "touch");
  LocalCollective local;
  MetricsRegistry registry;  // outlives the controller
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  c.register_metrics(registry);
  const auto count = [&registry](const char* result) {
    const std::string text = registry.prometheus_text();
    const std::string line = str_cat("hicache_storage_touch_keys_total{result=\"", result, "\"} ");
    const auto at = text.find(line);
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + line.size()));
  };
  EXPECT_THROW(c.touch({"a-0", ".hidden"}), InvalidArgument);
  c.touch({"a-0", "a-1"});
  c.touch({"b-0"});
  c.touch({});  // nothing
  ASSERT_TRUE(eventually([&] { return r.storage.touched_chains().size() == 2; }));
  EXPECT_EQ(r.storage.touched_chains(),
            (std::vector<std::vector<std::string>>{{"a-0", "a-1"}, {"b-0"}}));
  EXPECT_EQ(count("passed"), 3);
  // The thread held inside the store: what waits is bounded.
  {
    std::unique_lock hold(r.storage.touch_gate);
    c.touch({"c-0"});
    ASSERT_TRUE(eventually([&] { return r.storage.touch_entered.load() == 3; }));
    c.touch(std::vector<std::string>(StorageController::kMaxPendingTouchKeys, "big"));
    c.touch({"d-0", "d-1"});  // over the bound: dropped
    EXPECT_EQ(count("dropped"), 2);
  }
  ASSERT_TRUE(eventually([&] { return r.storage.touched_chains().size() == 4; }));
  EXPECT_EQ(r.storage.touched_chains()[2], std::vector<std::string>{"c-0"});
  EXPECT_EQ(r.storage.touched_chains()[3].size(), StorageController::kMaxPendingTouchKeys);
  c.stop();
  c.touch({"e-0"});
  EXPECT_EQ(count("dropped"), 3);
  EXPECT_EQ(r.storage.touched_chains().size(), 4u);
}

class BackupLayouts : public ::testing::TestWithParam<HostLayout> {};

TEST_P(BackupLayouts, StoresEveryPageByteForByte) {
  Rank r(GetParam(), str_cat("rt", static_cast<int>(GetParam())));
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local, {.io_batch_pages = 3});
  const auto slots = r.filled_pages(7);
  const auto keys = keys_for("bk", 7);
  const auto id = c.write_storage(slots, keys);
  ASSERT_TRUE(id.has_value());
  const auto acks = wait_acks(c, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].id, *id);
  EXPECT_EQ(acks[0].completed_tokens, 7 * kPage) << acks[0].error;
  EXPECT_EQ(acks[0].total_tokens, 7 * kPage);
  // Read each record back into a fresh host page and verify it as the key's data.
  auto spare = *r.host.alloc(kPage);
  std::vector<std::byte> bytes(static_cast<std::size_t>(geometry().page_bytes()));
  for (int i = 0; i < 7; ++i) {
    const std::vector<std::string> k = {keys[i]};
    const std::vector<ByteSpan> dst = {bytes};
    ASSERT_TRUE(r.file.batch_get(k, dst)[0].is_ok()) << keys[i];
    r.host.copy_page_in(spare[0] / kPage, bytes);
    EXPECT_TRUE(verify_page(r.host.layout(), spare[0] / kPage, 1000 + i)) << keys[i];
  }
}

INSTANTIATE_TEST_SUITE_P(StorageController, BackupLayouts,
                         ::testing::Values(HostLayout::kLayerFirst, HostLayout::kPageFirst));

TEST(StorageController, AckCountsOnlyTheStoredPrefix) {
  Rank r(HostLayout::kPageFirst, "partial");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local, {.io_batch_pages = 2});
  r.storage.fail_from = 3;  // the 4th page fails: the prefix is 3 pages
  c.write_storage(r.filled_pages(6), keys_for("pp", 6));
  const auto acks = wait_acks(c, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].completed_tokens, 3 * kPage);
  EXPECT_NE(acks[0].error.find("injected failure"), std::string::npos) << acks[0].error;
  EXPECT_NE(acks[0].error.find("pp-3"), std::string::npos) << acks[0].error;
}

TEST(StorageController, ThreadSurvivesAThrowingBackend) {
  Rank r(HostLayout::kPageFirst, "throw");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  r.storage.throw_all = true;
  c.write_storage(r.filled_pages(2), keys_for("tb", 2));
  auto acks = wait_acks(c, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].completed_tokens, 0);
  EXPECT_NE(acks[0].error.find("backend exploded"), std::string::npos) << acks[0].error;
  r.storage.throw_all = false;
  c.write_storage(r.filled_pages(2), keys_for("tb2", 2));
  acks = wait_acks(c, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].completed_tokens, 2 * kPage) << "the thread is alive and L3 still on";
}

TEST(StorageController, TwoRanksAckTheMinimum) {
  Rank r0(HostLayout::kPageFirst, "tp0"), r1(HostLayout::kPageFirst, "tp1");
  Comms comms(2);
  StorageController c0(r0.host, r0.storage, test_ns(), *comms.prefetch[0], *comms.backup[0],
                       *comms.main[0]);
  StorageController c1(r1.host, r1.storage, test_ns(), *comms.prefetch[1], *comms.backup[1],
                       *comms.main[1]);
  r1.storage.fail_from = 2;
  c0.write_storage(r0.filled_pages(5), keys_for("tp", 5));
  c1.write_storage(r1.filled_pages(5), keys_for("tp", 5));
  const auto a0 = wait_acks(c0, 1), a1 = wait_acks(c1, 1);
  ASSERT_EQ(a0.size(), 1u);
  ASSERT_EQ(a1.size(), 1u);
  EXPECT_EQ(a0[0].completed_tokens, 2 * kPage) << "rank 0 stored 5 but rank 1 only 2";
  EXPECT_EQ(a1[0].completed_tokens, 2 * kPage);
  EXPECT_EQ(comms.divergence(), "");
}

TEST(StorageController, MlaBackupIsWrittenByRankZeroOnly) {
  Rank r0(HostLayout::kPageFirst, "mla0"), r1(HostLayout::kPageFirst, "mla1");
  Comms comms(2);
  StorageController c0(r0.host, r0.storage, test_ns(), *comms.prefetch[0], *comms.backup[0],
                       *comms.main[0], {.mla = true});
  StorageController c1(r1.host, r1.storage, test_ns(), *comms.prefetch[1], *comms.backup[1],
                       *comms.main[1], {.mla = true});
  c0.write_storage(r0.filled_pages(3), keys_for("mla", 3));
  c1.write_storage(r1.filled_pages(3), keys_for("mla", 3));
  const auto a0 = wait_acks(c0, 1), a1 = wait_acks(c1, 1);
  ASSERT_EQ(a1.size(), 1u);
  EXPECT_EQ(a0[0].completed_tokens, 3 * kPage);
  EXPECT_EQ(a1[0].completed_tokens, 3 * kPage) << "other ranks ack the full length";
  EXPECT_EQ(r0.file.stats().set_written, 3u);
  EXPECT_EQ(r1.file.stats().set_written, 0u);
}

TEST(StorageController, BadInputIsRefusedAndNothingIsQueued) {
  Rank r(HostLayout::kPageFirst, "bad");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  const auto slots = r.filled_pages(2);
  EXPECT_THROW(c.write_storage(slots, keys_for("b", 3)), InvalidArgument);
  EXPECT_THROW(c.write_storage(slots, {"ok", "bad/key"}), InvalidArgument);
  const std::vector<std::int64_t> torn = {1, 2, 3, 4};
  EXPECT_THROW(c.write_storage(torn, keys_for("b", 1)), InvalidArgument);
  const std::vector<std::int64_t> outside = {1000 * kPage, 1000 * kPage + 1, 1000 * kPage + 2,
                                             1000 * kPage + 3};
  EXPECT_THROW(c.write_storage(outside, keys_for("b", 1)), InvalidArgument);
  EXPECT_THROW(StorageController(r.host, r.storage, test_ns(), local, local, local,
                                 {.io_batch_pages = -1}),
               InvalidArgument);
  EXPECT_THROW(StorageController(r.host, r.storage, test_ns(), local, local, local,
                                 {.prefetch_budget_tokens = kPage - 1}),
               InvalidArgument);
  KeyNamespace other = test_ns();
  other.page_size = 2 * kPage;
  EXPECT_THROW(StorageController(r.host, r.storage, other, local, local, local), InvalidArgument);
  EXPECT_THROW(parse_prefetch_policy("eager"), InvalidArgument);
  EXPECT_EQ(parse_prefetch_policy("timeout"), PrefetchPolicy::kTimeout);
  EXPECT_THROW(c.prefetch("", std::vector<std::int32_t>(kPage, 1)), InvalidArgument);
  c.stop();
  std::vector<BackupAck> acks;
  EXPECT_EQ(c.drain_backup_acks(acks), 0u);
}

TEST(StorageController, StopAcksQueuedOpsWithZero) {
  Rank r(HostLayout::kPageFirst, "stop");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  for (int i = 0; i < 12; ++i) c.write_storage(r.filled_pages(1), keys_for(str_cat("s", i), 1));
  c.stop();
  std::vector<BackupAck> acks;
  c.drain_backup_acks(acks);
  EXPECT_EQ(acks.size(), 12u) << "every op is acked, run or not";
  EXPECT_FALSE(c.write_storage(r.filled_pages(1), keys_for("late", 1)).has_value());
}

// stop() and later reset(): ops that stop() took off the queues unrun count as over, so reset()
// (which first waits for every queued op) returns, and the controller works again.
TEST(StorageController, ResetAfterStopReturnsAndTheControllerWorksAgain) {
  Rank r(HostLayout::kPageFirst, "stop-reset");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(4 * kPage));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i);
  std::unique_lock gate(r.storage.gate);  // the prefetch thread stops in the first hit query
  auto first = c.prefetch("first", tokens);
  auto second = c.prefetch("second", tokens);  // queued behind it
  ASSERT_TRUE(first && second);
  std::thread stopper([&] { c.stop(); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (c.prefetch("probe", tokens) != nullptr && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();  // until stop() has closed the queues
  }
  gate.unlock();
  stopper.join();
  EXPECT_EQ(second->stage(), PrefetchStage::kRevoked) << "taken off the queue, never run";
  c.reset();
  ASSERT_TRUE(c.write_storage(r.filled_pages(1), keys_for("after", 1)).has_value());
  const auto acks = wait_acks(c, 1);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].completed_tokens, kPage) << acks[0].error;
}

// TP shutdown: rank 1's backup thread took an op and entered its collective; rank 0 took the
// same op off its queue unrun when it stopped (here: never queued it). Rank 1's stop() cancels
// the collective, so it returns at once (the collective's timeout is 30 s) and the op is acked
// with zero and the reason.
TEST(StorageController, StopEndsACollectiveThePeersWillNeverJoin) {
  Rank r0(HostLayout::kPageFirst, "tpstop0"), r1(HostLayout::kPageFirst, "tpstop1");
  Comms comms(2);
  StorageController c0(r0.host, r0.storage, test_ns(), *comms.prefetch[0], *comms.backup[0],
                       *comms.main[0]);
  StorageController c1(r1.host, r1.storage, test_ns(), *comms.prefetch[1], *comms.backup[1],
                       *comms.main[1]);
  ASSERT_TRUE(c1.write_storage(r1.filled_pages(2), keys_for("tpstop", 2)).has_value());
  // Rank 1 waits for rank 0 (bounded, so that a broken feature fails rather than hangs).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (comms.group_backup->waiting() == 0) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "rank 1 never entered its call";
    std::this_thread::yield();
  }
  const auto t0 = std::chrono::steady_clock::now();
  c1.stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  std::vector<BackupAck> acks;
  c1.drain_backup_acks(acks);
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].completed_tokens, 0);
  EXPECT_NE(acks[0].error.find("cancelled during the call: the storage controller stopped"),
            std::string::npos)
      << acks[0].error;
  c0.stop();
  acks.clear();
  EXPECT_EQ(c0.drain_backup_acks(acks), 0u);
}

// ---------------------------------------------------------------------------------------------
// Prefetch

std::vector<std::int32_t> tokens_for(int pages, int seed) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(pages * kPage));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = seed * 100000 + static_cast<std::int32_t>(i);
  return t;
}

std::uint64_t seed_of(const std::string& key) { return std::hash<std::string>{}(key); }

// Stores pages [0, pages) of `tokens` directly into `storage` (data derived from each key), as
// an earlier engine's backup would have; `skip` leaves one page out.
void seed_storage(StorageBackend& storage, const HostKVPool& like,
                  std::span<const std::int32_t> tokens, int pages, int skip = -1) {
  PageKeyer keyer(test_ns());
  std::vector<std::string> keys;
  keyer.keys(tokens.first(static_cast<std::size_t>(pages * kPage)), nullptr, keys);
  HostDevice device;
  HostKVPool scratch(device, like.geometry(), like.host_layout(), kPage);
  std::vector<std::byte> bytes(static_cast<std::size_t>(like.geometry().page_bytes()));
  for (int i = 0; i < pages; ++i) {
    if (i == skip) continue;
    fill_page(scratch.layout(), 0, seed_of(keys[i]));
    scratch.copy_page_out(0, bytes);
    const std::vector<std::string> k = {keys[i]};
    const std::vector<ConstByteSpan> src = {bytes};
    ASSERT_TRUE(storage.batch_set(k, src)[0].is_ok());
  }
}

PrefetchResult wait_and_terminate(StorageController& c, PrefetchOperation& op) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (op.stage() == PrefetchStage::kQueued || op.stage() == PrefetchStage::kLoading) {
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::yield();
  }
  return c.terminate_prefetch(op);
}

// Every page handed over holds the bytes of its key.
void expect_pages_verify(const HostKVPool& host, const PrefetchResult& r) {
  ASSERT_EQ(r.host_slots.size(), r.keys.size() * kPage);
  for (std::size_t i = 0; i < r.keys.size(); ++i) {
    const std::int64_t page = r.host_slots[i * kPage] / kPage;
    EXPECT_TRUE(verify_page(host.layout(), page, seed_of(r.keys[i]))) << r.keys[i];
    EXPECT_EQ(host.page_state(page), PageState::kBackup);
  }
}

class PrefetchLayouts : public ::testing::TestWithParam<HostLayout> {};

TEST_P(PrefetchLayouts, ReadsTheLeadingHitIntoHostPagesByteForByte) {
  Rank r(GetParam(), str_cat("pf", static_cast<int>(GetParam())));
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local, {.io_batch_pages = 2});
  const auto tokens = tokens_for(7, 1);
  seed_storage(r.file, r.host, tokens, 6, /*skip=*/4);  // hit: pages 0-3
  const std::int64_t free_before = r.host.free_tokens();
  auto op = c.prefetch("req-1", tokens);
  ASSERT_TRUE(op);
  const PrefetchResult res = wait_and_terminate(c, *op);
  EXPECT_EQ(op->hit_tokens(), 4 * kPage);
  EXPECT_EQ(res.tokens, 4 * kPage) << op->error();
  expect_pages_verify(r.host, res);
  EXPECT_EQ(r.host.free_tokens(), free_before - 4 * kPage) << "exactly the hit is held";
  EXPECT_EQ(c.prefetch_tokens_held(), 0);
  r.host.free(res.host_slots);
  EXPECT_EQ(r.host.free_tokens(), free_before);
}

INSTANTIATE_TEST_SUITE_P(StorageController, PrefetchLayouts,
                         ::testing::Values(HostLayout::kLayerFirst, HostLayout::kPageFirst));

// By default a storage call carries the store's preferred_batch_pages (a file store's 64 MiB:
// these pages are small, a 7-page backup is one call), and a prefetch's reads are paced up to it
// from one page, at most doubling (1 + 2 + 4: three calls at least); an explicit size is kept
// for both.
// layer_first: both go through the staging buffers, grown on first use.
TEST(StorageController, AutomaticBatchesFillKAutoBatchBytesAndExplicitOnesAreKept) {
  Rank r(HostLayout::kLayerFirst, "autobatch");
  LocalCollective local;
  const std::int64_t page_bytes = geometry().page_bytes();
  for (const std::int64_t explicit_pages : {0, 3}) {
    SCOPED_TRACE(explicit_pages);
    StorageController c(r.host, r.storage, test_ns(), local, local, local,
                        {.io_batch_pages = explicit_pages});
    EXPECT_EQ(c.batch_pages(), explicit_pages > 0
                                   ? explicit_pages
                                   : (std::int64_t{64} << 20) / page_bytes);
    const int calls_per_op = explicit_pages > 0 ? 3 : 1;  // 7 pages
    const auto slots = r.filled_pages(7);
    const int sets = r.storage.set_calls;
    c.write_storage(slots, keys_for(str_cat("ab", explicit_pages), 7));
    const auto acks = wait_acks(c, 1);
    ASSERT_EQ(acks.size(), 1u);
    EXPECT_EQ(acks[0].completed_tokens, 7 * kPage) << acks[0].error;
    EXPECT_EQ(r.storage.set_calls - sets, calls_per_op);
    r.host.free(slots);

    const auto tokens = tokens_for(7, 60 + static_cast<int>(explicit_pages));
    seed_storage(r.file, r.host, tokens, 7);
    const int gets = r.storage.get_calls;
    auto op = c.prefetch("auto", tokens);
    ASSERT_TRUE(op);
    const PrefetchResult res = wait_and_terminate(c, *op);
    EXPECT_EQ(res.tokens, 7 * kPage) << op->error();
    expect_pages_verify(r.host, res);
    if (explicit_pages > 0) {
      EXPECT_EQ(r.storage.get_calls - gets, calls_per_op);
    } else {
      EXPECT_GE(r.storage.get_calls - gets, 3);
      EXPECT_LE(r.storage.get_calls - gets, 7);
    }
    r.host.free(res.host_slots);
  }
}

// prefetch_into: the caller reserved the host slots (SGLang's radix cache allocates before it
// asks). The hit lands in the first of them byte for byte; nothing is freed on the controller's
// threads (TP ranks must find the same room on the caller's thread): terminate frees those past
// the agreed prefix, all of them for a revoked op; no budget.
TEST_P(PrefetchLayouts, IntoTheCallersSlotsKeepsTheHitAndFreesTheRest) {
  Rank r(GetParam(), str_cat("pfi", static_cast<int>(GetParam())));
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local,
                      {.io_batch_pages = 2, .prefetch_threshold_tokens = 2 * kPage,
                       .prefetch_budget_tokens = kPage});
  const auto tokens = tokens_for(7, 11);
  seed_storage(r.file, r.host, tokens, 6, /*skip=*/4);  // hit: pages 0-3
  const std::int64_t free_before = r.host.free_tokens();
  const auto mine = r.host.alloc(7 * kPage).value();
  auto op = c.prefetch_into("req-into", tokens, std::nullopt, mine);
  ASSERT_TRUE(op);
  while (op->stage() == PrefetchStage::kQueued || op->stage() == PrefetchStage::kLoading) {
    std::this_thread::yield();
  }
  EXPECT_EQ(r.host.free_tokens(), free_before - 7 * kPage) << "freed on the controller's thread";
  const PrefetchResult res = wait_and_terminate(c, *op);
  EXPECT_EQ(res.tokens, 4 * kPage) << op->error();
  expect_pages_verify(r.host, res);
  EXPECT_EQ(res.host_slots, std::vector<std::int64_t>(mine.begin(), mine.begin() + 4 * kPage))
      << "the hit lands in the caller's first slots";
  EXPECT_EQ(r.host.free_tokens(), free_before - 4 * kPage) << "the 3 pages past the hit are free";
  EXPECT_EQ(c.prefetch_tokens_held(), 0) << "no budget taken (it is 1 page)";
  r.host.free(res.host_slots);

  // Below the threshold: revoked; its slots stay reserved until terminate frees them all.
  const auto short_tokens = tokens_for(3, 12);
  seed_storage(r.file, r.host, short_tokens, 1);
  const auto theirs = r.host.alloc(3 * kPage).value();
  auto revoked_op = c.prefetch_into("req-short", short_tokens, std::nullopt, theirs);
  std::vector<std::string> revoked;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (revoked.empty() && std::chrono::steady_clock::now() < deadline) {
    if (c.drain_revokes(revoked) == 0) std::this_thread::yield();
  }
  EXPECT_EQ(revoked, std::vector<std::string>{"req-short"});
  EXPECT_EQ(r.host.free_tokens(), free_before - 3 * kPage) << "the caller's until terminate";
  EXPECT_EQ(c.terminate_prefetch(*revoked_op).tokens, 0);
  EXPECT_EQ(r.host.free_tokens(), free_before);
}

// Bad slots are refused at the call and change nothing: too few, not reserved, not whole pages.
TEST(StorageController, PrefetchIntoRefusesSlotsThatAreNotTheCallersReservation) {
  Rank r(HostLayout::kPageFirst, "pfibad");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  const auto tokens = tokens_for(3, 13);
  const auto two = r.host.alloc(2 * kPage).value();
  EXPECT_THROW(c.prefetch_into("few", tokens, std::nullopt, two), InvalidArgument);
  const std::int64_t free_before = r.host.free_tokens();
  auto synced = r.host.alloc(3 * kPage).value();
  r.host.protect_write(synced);
  r.host.complete_io(synced, PageState::kSynced);
  try {
    c.prefetch_into("synced", tokens, std::nullopt, synced);
    ADD_FAILURE() << "pages in state synced accepted";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("prefetch_into"), std::string::npos) << e.what();
  }
  EXPECT_EQ(r.host.page_state(synced[0] / kPage), PageState::kSynced);
  auto partial = r.host.alloc(3 * kPage).value();
  partial.back() = partial.front();  // the last page is not whole, the first one twice
  EXPECT_ANY_THROW(c.prefetch_into("partial", tokens, std::nullopt, partial));
  EXPECT_THROW(c.prefetch_into("", tokens, std::nullopt, two), InvalidArgument);
  EXPECT_EQ(r.host.free_tokens(), free_before - 3 * kPage - 3 * kPage);
  std::vector<std::string> revoked;
  EXPECT_EQ(c.drain_revokes(revoked), 0u);
}

TEST(StorageController, PrefetchBelowThresholdIsRevokedAndHoldsNothing) {
  Rank r(HostLayout::kPageFirst, "thr");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local,
                      {.prefetch_threshold_tokens = 3 * kPage});
  const auto tokens = tokens_for(4, 2);
  seed_storage(r.file, r.host, tokens, 2);
  const std::int64_t free_before = r.host.free_tokens();
  auto op = c.prefetch("short", tokens);
  const PrefetchResult res = wait_and_terminate(c, *op);
  EXPECT_EQ(op->stage(), PrefetchStage::kTerminated);
  EXPECT_EQ(res.tokens, 0);
  std::vector<std::string> revoked;
  c.drain_revokes(revoked);
  EXPECT_EQ(revoked, std::vector<std::string>{"short"});
  EXPECT_EQ(r.host.free_tokens(), free_before);
  EXPECT_THROW(c.terminate_prefetch(*op), StateError) << "terminated twice";
}

// No host room for the agreed hit (some rank short): the prefetch is revoked, and its whole
// hit counts as unfulfilled for host capacity (SGLang's storage_prefetch_unfulfilled_tokens_total
// reason host_capacity), the revoke as an outcome of its own.
TEST(StorageController, ARevokedReservationCountsItsHitAsUnfulfilledForHostCapacity) {
  Rank r(HostLayout::kPageFirst, "room");
  LocalCollective local;
  MetricsRegistry m;  // before the controller: its metrics go first
  StorageController c(r.host, r.storage, test_ns(), local, local, local);
  c.register_metrics(m);
  const auto tokens = tokens_for(4, 3);
  seed_storage(r.file, r.host, tokens, 4);
  auto held = r.host.alloc(r.host.free_tokens() - 2 * kPage).value();  // two pages left
  auto op = c.prefetch("roomless", tokens);
  EXPECT_EQ(wait_and_terminate(c, *op).tokens, 0);
  EXPECT_EQ(m.value("hicache_prefetch_hit_tokens_total"), 4 * kPage);
  EXPECT_EQ(m.value("hicache_prefetch_unfulfilled_tokens_total", {{"reason", "host_capacity"}}),
            4 * kPage);
  EXPECT_EQ(m.value("hicache_prefetch_unfulfilled_tokens_total", {{"reason", "below_threshold"}}),
            0);
  EXPECT_EQ(m.value("hicache_prefetch_outcomes_total", {{"outcome", "revoked_host_capacity"}}), 1);
  r.host.free(held);
  auto again = c.prefetch("room", tokens);  // with the room back it is read
  EXPECT_EQ(wait_and_terminate(c, *again).tokens, 4 * kPage);
  EXPECT_EQ(m.value("hicache_prefetch_hit_tokens_total"), 8 * kPage);
  EXPECT_EQ(m.value("hicache_prefetch_unfulfilled_tokens_total", {{"reason", "host_capacity"}}),
            4 * kPage);
}

TEST(StorageController, PrefetchPastTheBudgetIsDeclined) {
  Rank r(HostLayout::kPageFirst, "budget");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local,
                      {.prefetch_budget_tokens = 3 * kPage});
  const auto a = tokens_for(2, 3), b = tokens_for(2, 4);
  seed_storage(r.file, r.host, a, 2);
  seed_storage(r.file, r.host, b, 2);
  auto first = c.prefetch("a", a);
  while (first->stage() == PrefetchStage::kQueued) std::this_thread::yield();
  EXPECT_EQ(c.prefetch_tokens_held(), 2 * kPage);
  auto second = c.prefetch("b", b);  // 2 more pages would pass the budget of 3
  const PrefetchResult rb = wait_and_terminate(c, *second);
  EXPECT_EQ(rb.tokens, 0);
  EXPECT_EQ(second->hit_tokens(), 0);
  const PrefetchResult ra = wait_and_terminate(c, *first);
  EXPECT_EQ(ra.tokens, 2 * kPage);
  EXPECT_EQ(c.prefetch_tokens_held(), 0) << "credits come back on every path";
  // With the credits back, b fits.
  auto again = c.prefetch("b2", b);
  EXPECT_EQ(wait_and_terminate(c, *again).tokens, 2 * kPage);
}

TEST(StorageController, StorageFailureMidPrefetchKeepsThePrefixAndLaterOnesWork) {
  Rank r(HostLayout::kPageFirst, "midfail");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local, {.io_batch_pages = 2});
  const auto tokens = tokens_for(6, 5);
  seed_storage(r.file, r.host, tokens, 6);
  const std::int64_t free_before = r.host.free_tokens();
  r.storage.get_fail_from = 3;  // the server "dies" at the 4th page
  auto op = c.prefetch("mid", tokens);
  PrefetchResult res = wait_and_terminate(c, *op);
  EXPECT_EQ(res.tokens, 3 * kPage);
  EXPECT_NE(op->error().find("injected read failure"), std::string::npos) << op->error();
  expect_pages_verify(r.host, res);
  r.host.free(res.host_slots);
  EXPECT_EQ(r.host.free_tokens(), free_before) << "the failed pages went back to the pool";
  r.storage.get_fail_from = -1;
  r.storage.throw_get = true;
  op = c.prefetch("throws", tokens);
  res = wait_and_terminate(c, *op);
  EXPECT_EQ(res.tokens, 0);
  EXPECT_NE(op->error().find("exploded"), std::string::npos) << op->error();
  r.storage.throw_get = false;
  op = c.prefetch("after", tokens);
  res = wait_and_terminate(c, *op);
  EXPECT_EQ(res.tokens, 6 * kPage) << "the threads survived: L3 is still on";
  r.host.free(res.host_slots);
  EXPECT_EQ(r.host.free_tokens(), free_before);
}

// hicache_prefetch_confirm_seconds: from the last page of a prefetch that read its whole hit to
// the terminate_prefetch that takes it; a prefetch whose reads stopped short (a failed page) or
// that was revoked (a full miss) adds nothing.
TEST(StorageController, ConfirmLatencyRunsFromTheLastPageToTerminateForWholeReadsOnly) {
  Rank r(HostLayout::kPageFirst, "confirm");
  LocalCollective local;
  MetricsRegistry registry;  // outlives the controller, which forgets its series at the end
  StorageController c(r.host, r.storage, test_ns(), local, local, local, {.io_batch_pages = 2});
  c.register_metrics(registry);
  const auto confirm = [&] {
    const auto all = nlohmann::json::parse(registry.json_text());
    const auto& series = all.at("hicache_prefetch_confirm_seconds").at("series").at(0);
    return std::pair{series.at("count").get<std::uint64_t>(), series.at("sum").get<double>()};
  };
  const auto tokens = tokens_for(9, 2);
  seed_storage(r.file, r.host, tokens, 4);
  auto op = c.prefetch("whole", tokens);
  ASSERT_TRUE(eventually([&] { return op->stage() == PrefetchStage::kFinished; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the pages wait to be taken
  PrefetchResult res = c.terminate_prefetch(*op);
  EXPECT_EQ(res.tokens, 4 * kPage);
  r.host.free(res.host_slots);
  auto [count, sum] = confirm();
  EXPECT_EQ(count, 1u);
  EXPECT_GE(sum, 0.05);
  EXPECT_LT(sum, 10.0);
  r.storage.get_fail_from = 4 + 2;  // reads (4 so far) stop after 2 of the next 4 pages
  op = c.prefetch("short", tokens);
  res = wait_and_terminate(c, *op);
  EXPECT_EQ(res.tokens, 2 * kPage);
  r.host.free(res.host_slots);
  r.storage.get_fail_from = -1;
  op = c.prefetch("miss", tokens_for(4, 77));  // nothing stored: revoked
  res = wait_and_terminate(c, *op);
  EXPECT_TRUE(res.revoked);
  std::tie(count, sum) = confirm();
  EXPECT_EQ(count, 1u) << "a prefetch cut short or revoked is not a confirmation";
}

TEST(StorageController, TerminateRacingTheWorkerFreesEveryPageExactlyOnce) {
  Rank r(HostLayout::kPageFirst, "race");
  LocalCollective local;
  StorageController c(r.host, r.storage, test_ns(), local, local, local, {.io_batch_pages = 1});
  const auto tokens = tokens_for(8, 6);
  seed_storage(r.file, r.host, tokens, 8);
  const std::int64_t free_before = r.host.free_tokens();
  int full = 0, cut = 0;
  for (int i = 0; i < 300; ++i) {
    auto op = c.prefetch(str_cat("race-", i), tokens);
    // Terminate at once, once the first page is in, or once the op is done.
    if (i % 3 == 1) {
      while (op->completed_tokens() == 0 && op->stage() != PrefetchStage::kRevoked &&
             op->stage() != PrefetchStage::kFinished) {
        std::this_thread::yield();
      }
    } else if (i % 3 == 2) {
      while (op->stage() == PrefetchStage::kQueued || op->stage() == PrefetchStage::kLoading) {
        std::this_thread::yield();
      }
    }
    const PrefetchResult res = c.terminate_prefetch(*op);
    ASSERT_EQ(res.tokens % kPage, 0);
    ASSERT_LE(res.tokens, 8 * kPage);
    ASSERT_GE(res.tokens, i % 3 == 0 ? 0 : i % 3 == 1 ? kPage : 8 * kPage) << "round " << i;
    (res.tokens == 8 * kPage ? full : cut) += 1;
    expect_pages_verify(r.host, res);
    if (!res.host_slots.empty()) r.host.free(res.host_slots);
    ASSERT_EQ(r.host.free_tokens(), free_before) << "round " << i;
  }
  EXPECT_EQ(c.prefetch_tokens_held(), 0);
  EXPECT_EQ(r.host.count_in_state(PageState::kFree), r.host.num_pages());
  EXPECT_GE(full, 100);
  EXPECT_GT(cut, 0) << "terminate never cut an op short";
}

TEST(StorageController, FourRanksPrefetchTheMinimumAndAgree) {
  constexpr int kRanks = 4;
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int i = 0; i < kRanks; ++i) {
    ranks.push_back(std::make_unique<Rank>(HostLayout::kPageFirst, str_cat("tp4-", i)));
  }
  Comms comms(kRanks);
  const auto tokens = tokens_for(8, 7);
  std::vector<std::unique_ptr<StorageController>> ctl;
  for (int i = 0; i < kRanks; ++i) {
    seed_storage(ranks[i]->file, ranks[i]->host, tokens, 3 + i);  // rank i holds 3 + i pages
    ctl.push_back(std::make_unique<StorageController>(
        ranks[i]->host, ranks[i]->storage, test_ns(), *comms.prefetch[i], *comms.backup[i],
        *comms.main[i], StorageControllerConfig{.io_batch_pages = 2}));
  }
  std::vector<PrefetchResult> results(kRanks);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRanks; ++i) {
    threads.emplace_back([&, i] {
      for (int round = 0; round < 20; ++round) {
        auto op = ctl[i]->prefetch(str_cat("r", round), tokens);
        results[i] = wait_and_terminate(*ctl[i], *op);
        if (round + 1 < 20) ranks[i]->host.free(results[i].host_slots);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kRanks; ++i) {
    EXPECT_EQ(results[i].tokens, 3 * kPage) << "rank " << i;
    EXPECT_EQ(results[i].keys, results[0].keys);
    expect_pages_verify(ranks[i]->host, results[i]);
  }
  EXPECT_EQ(comms.divergence(), "");
}

TEST(StorageController, PoliciesDecideWhenTerminateMayRun) {
  Rank r(HostLayout::kPageFirst, "policy");
  LocalCollective local;
  const auto tokens = tokens_for(2, 8);
  seed_storage(r.file, r.host, tokens, 2);
  for (auto policy : {PrefetchPolicy::kBestEffort, PrefetchPolicy::kWaitComplete,
                      PrefetchPolicy::kTimeout}) {
    StorageController c(r.host, r.storage, test_ns(), local, local, local,
                        {.policy = policy, .timeout_base = std::chrono::milliseconds(0),
                         .timeout_per_page = std::chrono::milliseconds(0)});
    auto op = c.prefetch("p", tokens);
    if (policy != PrefetchPolicy::kWaitComplete) {
      EXPECT_TRUE(c.can_terminate(*op)) << "best effort at once; timeout of 0 ms expired";
    }
    while (op->stage() == PrefetchStage::kQueued || op->stage() == PrefetchStage::kLoading) {
      std::this_thread::yield();
    }
    EXPECT_TRUE(c.can_terminate(*op));
    const auto res = c.terminate_prefetch(*op);
    r.host.free(res.host_slots);
  }
  StorageController slow(r.host, r.storage, test_ns(), local, local, local,
                         {.policy = PrefetchPolicy::kTimeout,
                          .timeout_base = std::chrono::milliseconds(60000)});
  StorageController patient(r.host, r.storage, test_ns(), local, local, local,
                            {.policy = PrefetchPolicy::kWaitComplete});
  std::shared_ptr<PrefetchOperation> op, op2;
  {
    std::lock_guard hold(r.storage.gate);  // both ops stay in their hit query
    op = slow.prefetch("q", tokens);
    op2 = patient.prefetch("q2", tokens);
    EXPECT_FALSE(slow.can_terminate(*op)) << "not finished, timeout a minute away";
    EXPECT_FALSE(patient.can_terminate(*op2)) << "not finished";
    patient.set_prefetch_policy(PrefetchPolicy::kBestEffort);  // from now on, ops in flight too
    EXPECT_TRUE(patient.can_terminate(*op2));
    patient.set_prefetch_policy(PrefetchPolicy::kWaitComplete);
    EXPECT_FALSE(patient.can_terminate(*op2));
  }
  r.host.free(wait_and_terminate(patient, *op2).host_slots);
  r.host.free(wait_and_terminate(slow, *op).host_slots);
}

TEST(StorageController, BudgetCreditsComeBackOnEveryPath) {
  auto used = std::make_shared<std::atomic<std::int64_t>>(0);
  {
    BudgetCredit a = BudgetCredit::take(used, 6, 10);
    EXPECT_EQ(a.tokens(), 6);
    BudgetCredit refused = BudgetCredit::take(used, 5, 10);
    EXPECT_EQ(refused.tokens(), 0) << "6 + 5 passes the limit of 10";
    EXPECT_EQ(used->load(), 6);
    BudgetCredit moved = std::move(a);
    EXPECT_EQ(a.tokens(), 0);
    EXPECT_EQ(used->load(), 6) << "a move keeps one owner";
    BudgetCredit b = BudgetCredit::take(used, 4, 10);
    EXPECT_EQ(used->load(), 10);
    b.release();
    b.release();
    EXPECT_EQ(used->load(), 6) << "released once only";
  }
  EXPECT_EQ(used->load(), 0) << "destruction returns what is left";
}

}  // namespace
}  // namespace hicache
