#include "controller/storage_controller.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

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
    return inner_.batch_exists(keys);
  }
  bool remove(const std::string& key) override { return inner_.remove(key); }
  void clear() override { inner_.clear(); }
  std::atomic<std::int64_t> fail_from{-1};
  std::atomic<bool> throw_all{false};

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    return inner_.batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    if (throw_all) throw std::runtime_error("backend exploded");
    std::vector<IoResult> out = inner_.batch_set(keys, src);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (fail_from >= 0 && seen_ + static_cast<std::int64_t>(i) >= fail_from) {
        out[i] = IoResult::error("injected failure");
      }
    }
    seen_ += static_cast<std::int64_t>(keys.size());
    return out;
  }

 private:
  StorageBackend& inner_;
  std::int64_t seen_ = 0;
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

class BackupLayouts : public ::testing::TestWithParam<HostLayout> {};

TEST_P(BackupLayouts, StoresEveryPageByteForByte) {
  Rank r(GetParam(), str_cat("rt", static_cast<int>(GetParam())));
  LocalCollective local;
  StorageController c(r.host, r.storage, local, {.io_batch_pages = 3});
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
  StorageController c(r.host, r.storage, local, {.io_batch_pages = 2});
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
  StorageController c(r.host, r.storage, local);
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
  std::shared_ptr<InProcessGroup> group;
  auto ranks = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &group);
  StorageController c0(r0.host, r0.storage, *ranks[0]), c1(r1.host, r1.storage, *ranks[1]);
  r1.storage.fail_from = 2;
  c0.write_storage(r0.filled_pages(5), keys_for("tp", 5));
  c1.write_storage(r1.filled_pages(5), keys_for("tp", 5));
  const auto a0 = wait_acks(c0, 1), a1 = wait_acks(c1, 1);
  ASSERT_EQ(a0.size(), 1u);
  ASSERT_EQ(a1.size(), 1u);
  EXPECT_EQ(a0[0].completed_tokens, 2 * kPage) << "rank 0 stored 5 but rank 1 only 2";
  EXPECT_EQ(a1[0].completed_tokens, 2 * kPage);
  EXPECT_EQ(group->divergence(), "");
}

TEST(StorageController, MlaBackupIsWrittenByRankZeroOnly) {
  Rank r0(HostLayout::kPageFirst, "mla0"), r1(HostLayout::kPageFirst, "mla1");
  auto ranks = InProcessGroup::make_ranks(2);
  StorageController c0(r0.host, r0.storage, *ranks[0], {.mla = true});
  StorageController c1(r1.host, r1.storage, *ranks[1], {.mla = true});
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
  StorageController c(r.host, r.storage, local);
  const auto slots = r.filled_pages(2);
  EXPECT_THROW(c.write_storage(slots, keys_for("b", 3)), InvalidArgument);
  EXPECT_THROW(c.write_storage(slots, {"ok", "bad/key"}), InvalidArgument);
  const std::vector<std::int64_t> torn = {1, 2, 3, 4};
  EXPECT_THROW(c.write_storage(torn, keys_for("b", 1)), InvalidArgument);
  const std::vector<std::int64_t> outside = {1000 * kPage, 1000 * kPage + 1, 1000 * kPage + 2,
                                             1000 * kPage + 3};
  EXPECT_THROW(c.write_storage(outside, keys_for("b", 1)), InvalidArgument);
  EXPECT_THROW(StorageController(r.host, r.storage, local, {.io_batch_pages = 0}),
               InvalidArgument);
  c.stop();
  std::vector<BackupAck> acks;
  EXPECT_EQ(c.drain_backup_acks(acks), 0u);
}

TEST(StorageController, StopAcksQueuedOpsWithZero) {
  Rank r(HostLayout::kPageFirst, "stop");
  LocalCollective local;
  StorageController c(r.host, r.storage, local);
  for (int i = 0; i < 12; ++i) c.write_storage(r.filled_pages(1), keys_for(str_cat("s", i), 1));
  c.stop();
  std::vector<BackupAck> acks;
  c.drain_backup_acks(acks);
  EXPECT_EQ(acks.size(), 12u) << "every op is acked, run or not";
  EXPECT_FALSE(c.write_storage(r.filled_pages(1), keys_for("late", 1)).has_value());
}

}  // namespace
}  // namespace hicache
