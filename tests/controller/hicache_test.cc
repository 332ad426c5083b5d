#include "controller/hicache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "tests/controller/error_of.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;

// A small model on the host backend; `extra` adds keys ("" for none).
std::string config_json(const std::string& extra) {
  return str_cat(R"({"device": "host", "page_size": 4, "device_tokens": 64,
    "model": {"attention": "mha", "layers": 2, "kv_heads": 1, "head_dim": 8},
    "model_name": "m", "model_fingerprint": "f")",
                 extra.empty() ? "" : ", ", extra, "}");
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / str_cat("hicache-front-", ::getpid(), "-", ++count);
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
  static inline int count = 0;
};

// Inserts tokens 1..16 (4 pages) and steps the cache until they are stored in L3 (or 20 s).
void store_sixteen_tokens(HiCache& hc) {
  HiRadixCache& cache = hc.cache();
  std::vector<std::int32_t> tokens(16);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i + 1);
  auto slots = hc.device_pool().allocator().alloc(16);
  ASSERT_TRUE(slots);
  cache.insert(tokens, *slots);
  for (int i = 0; i < 2000 && cache.stats().stored_tokens < 16; ++i) {
    const std::uint64_t seen = cache.event_seq();
    cache.check_events();
    cache.wait_for_events(seen, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  }
}

TEST(HiCache, BuildsEveryTierFromOneConfig) {
  TempDir dir;
  HiCache hc(HiCacheConfig::from_json_text(config_json(str_cat(
      R"("host_ratio": 3, "storage": {"backend": "file", "root": ")", dir.path.string(), R"("})"))));
  EXPECT_EQ(hc.device_pool().allocator().capacity_tokens(), 64);
  EXPECT_EQ(hc.host_pool().capacity_tokens(), 192);
  ASSERT_NE(hc.storage(), nullptr);
  ASSERT_NE(hc.storage_controller(), nullptr);
  EXPECT_TRUE(fs::is_directory(dir.path)) << "the store was not opened";
  EXPECT_EQ(hc.key_namespace().prefix(), "m.f.fp16.layer_first.p4.tp0of1");
  EXPECT_EQ(hc.cache().page_size(), 4);
}

TEST(HiCache, WithoutStorageHasNoStorageController) {
  HiCache hc(HiCacheConfig::from_json_text(config_json("")));
  EXPECT_EQ(hc.storage(), nullptr);
  EXPECT_EQ(hc.storage_controller(), nullptr);
  EXPECT_EQ(hc.host_pool().capacity_tokens(), 128);  // host_ratio 2 by default
}

// L3 detached, attached (another store) and cleared at run time: the store and its controller
// go and come; a store that cannot be opened changes nothing; clear empties the store.
TEST(HiCache, DetachesAttachesAndClearsL3AtRunTime) {
  TempDir first, second;
  HiCache hc(HiCacheConfig::from_json_text(config_json(str_cat(
      R"("storage": {"backend": "file", "root": ")", first.path.string(), R"("})"))));
  hc.detach_storage();
  EXPECT_EQ(hc.storage(), nullptr);
  EXPECT_EQ(hc.storage_controller(), nullptr);
  hc.detach_storage();  // nothing attached: nothing happens
  hc.clear_storage();
  // A store that cannot be opened (a root that is a file) is refused and changes nothing.
  const fs::path file = second.path.string() + "-file";
  std::ofstream(file) << "x";
  EXPECT_NE(error_of([&] {
              hc.attach_storage(str_cat(R"({"backend": "file", "root": ")", file.string(), R"("})"));
            }).find(file.string()),
            std::string::npos);
  EXPECT_EQ(hc.storage(), nullptr);
  fs::remove(file);
  hc.attach_storage(str_cat(R"({"backend": "file", "root": ")", second.path.string(), R"("})"));
  ASSERT_NE(hc.storage(), nullptr);
  ASSERT_NE(hc.storage_controller(), nullptr);
  EXPECT_TRUE(fs::is_directory(second.path));
  EXPECT_NE(error_of([&] { hc.attach_storage(); }).find("attached already"), std::string::npos);
  // Pages written through the cache land in the attached store; clear empties it.
  HiRadixCache& cache = hc.cache();
  store_sixteen_tokens(hc);
  EXPECT_EQ(cache.stats().stored_tokens, 16);
  EXPECT_EQ(hc.storage()->stats().stored_keys, 4u);
  hc.clear_storage();
  EXPECT_EQ(hc.storage()->stats().stored_keys, 0u);
  EXPECT_EQ(cache.stats().stored_tokens, 0);
  EXPECT_EQ(cache.check_invariants(), "");
  // The config's own store, attached again after a detach.
  hc.detach_storage();
  hc.attach_storage();
  EXPECT_NE(hc.storage(), nullptr);
}

// A store that forwards to the one HiCache opened, counting what it forwards (wrap_storage).
class CountingWrapper final : public StorageBackend {
 public:
  explicit CountingWrapper(std::unique_ptr<StorageBackend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    return inner_->batch_exists(keys);
  }
  bool remove(const std::string& key) override { return inner_->remove(key); }
  void clear() override { inner_->clear(); }
  std::atomic<int> sets{0};

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    return inner_->batch_get(keys, dst);
  }
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    sets += static_cast<int>(keys.size());
    return inner_->batch_set(keys, src);
  }
  StorageBackend* wrapped() const override { return inner_.get(); }

 private:
  std::unique_ptr<StorageBackend> inner_;
};

// wrap_storage wraps every store HiCache opens from a config, at construction and on an attach:
// the cache's backups go through the wrapper, the counts and the metrics are the real store's
// (wrapped()), and a wrapper that returns no store is refused, changing nothing.
TEST(HiCache, WrapStorageWrapsEveryStoreItOpens) {
  TempDir dir;
  std::vector<CountingWrapper*> made;
  HiCacheParts parts;
  parts.wrap_storage = [&made](std::unique_ptr<StorageBackend> store) {
    auto w = std::make_shared<CountingWrapper>(std::move(store));
    made.push_back(w.get());
    return w;
  };
  HiCache hc(HiCacheConfig::from_json_text(config_json(str_cat(
                 R"("storage": {"backend": "file", "root": ")", dir.path.string(), R"("})"))),
             std::move(parts));
  ASSERT_EQ(made.size(), 1u);
  EXPECT_EQ(hc.storage(), made[0]);
  EXPECT_EQ(hc.storage()->name(), "file");
  HiRadixCache& cache = hc.cache();
  store_sixteen_tokens(hc);
  EXPECT_EQ(cache.stats().stored_tokens, 16);
  EXPECT_EQ(made[0]->sets.load(), 4);  // the 4 pages went through the wrapper
  EXPECT_EQ(hc.storage()->stats().stored_keys, 4u);  // the file store's own gauge
  EXPECT_EQ(hc.storage()->stats().set_written, 4u);
  EXPECT_NE(hc.metrics().prometheus_text().find(
                R"(hicache_storage_keys_total{tp_rank="0",backend="file",op="set",result="written"} 4)"),
            std::string::npos)
      << hc.metrics().prometheus_text();
  hc.detach_storage();
  hc.attach_storage();
  ASSERT_EQ(made.size(), 2u);
  EXPECT_EQ(hc.storage(), made[1]);
}

TEST(HiCache, AWrapperThatReturnsNoStoreIsRefused) {
  TempDir dir;
  HiCacheParts parts;
  parts.wrap_storage = [](std::unique_ptr<StorageBackend>) { return nullptr; };
  const std::string json = config_json(
      str_cat(R"("storage": {"backend": "file", "root": ")", dir.path.string(), R"("})"));
  EXPECT_NE(error_of([&] { HiCache hc(HiCacheConfig::from_json_text(json), std::move(parts)); })
                .find("wrap_storage returned no store"),
            std::string::npos);
}

TEST(HiCache, DerivesTheKeyNamespaceOfAnMlaModelForEveryRank) {
  auto c = HiCacheConfig::from_json_text(R"({"device": "host", "page_size": 4,
    "device_tokens": 64, "model": {"attention": "mla", "layers": 2, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "dtype": "bf16"}, "model_name": "ds", "host_layout": "page_first"})");
  HiCache hc(c);
  EXPECT_EQ(hc.key_namespace().prefix(), "ds.unversioned.bf16.page_first.p4.mla");
}

TEST(HiCache, RefusesAHostPoolSmallerThanTheDevicePool) {
  const std::string e =
      error_of([] { (void)HiCacheConfig::from_json_text(config_json(R"("host_ratio": 0.5)")); });
  EXPECT_NE(e.find("host pool (32 tokens"), std::string::npos) << e;
  EXPECT_NE(e.find("host_ratio 0.5"), std::string::npos) << e;
  EXPECT_NE(e.find("device_tokens 64"), std::string::npos) << e;
  // The same rule when the config is built in code and handed to HiCache.
  auto c = HiCacheConfig::from_json_text(config_json(""));
  c.host_size = HostPoolSize{.tokens = 32};
  EXPECT_THROW(HiCache{c}, InvalidArgument);
}

TEST(HiCache, ADeviceOnlyCacheTakesNoStore) {
  auto c = HiCacheConfig::from_json_text(config_json(R"("host_tier": false)"));
  TempDir dir;
  HiCacheParts parts;
  parts.storage = std::make_unique<FileStorage>(FileStorageConfig{.root = dir.path.string()});
  const std::string e = error_of([&] { HiCache hc(c, std::move(parts)); });
  EXPECT_NE(e.find("needs the host tier"), std::string::npos) << e;
  EXPECT_NE(error_of([] {
              (void)HiCacheConfig::from_json_text(
                  config_json(R"("host_tier": false, "storage": {"backend": "file", "root": "x"})"));
            }).find("takes no 'storage'"),
            std::string::npos);
}

TEST(HiCache, RefusesATpRankOutsideTheGroup) {
  const std::string e = error_of(
      [] { (void)HiCacheConfig::from_json_text(config_json(R"("tp_rank": 2, "tp_size": 2)")); });
  EXPECT_NE(e.find("tp_rank 2 is outside [0, tp_size 2)"), std::string::npos) << e;
}

TEST(HiCache, SeveralRanksWithoutCollectivesNeedARendezvousDirectory) {
  const std::string e = error_of([] {
    HiCache hc(HiCacheConfig::from_json_text(config_json(R"("tp_rank": 0, "tp_size": 2)")));
  });
  EXPECT_NE(e.find("tp"), std::string::npos) << e;
  EXPECT_NE(e.find("store_dir"), std::string::npos) << e;
}

// Ranks of an MHA model hold different slices (their key namespaces differ), yet they must
// meet in one Gloo group per role: two ranks built at once from the config agree and run.
TEST(HiCache, RanksOfAnMhaModelMeetOverGlooFromTheConfig) {
  TempDir dir, rendezvous;
  fs::create_directories(rendezvous.path);
  const auto make = [&](int rank) {
    return std::make_unique<HiCache>(HiCacheConfig::from_json_text(config_json(str_cat(
        R"("tp_size": 2, "tp_rank": )", rank, R"(, "tp_store_dir": ")", rendezvous.path.string(),
        R"(", "tp_connect_timeout_ms": 20000, "storage": {"backend": "file", "root": ")",
        dir.path.string(), R"("})"))));
  };
  std::unique_ptr<HiCache> other;
  std::string other_error;
  std::thread t([&] {
    try {
      other = make(1);
    } catch (const std::exception& e) {
      other_error = e.what();
    }
  });
  std::unique_ptr<HiCache> first;
  std::string error = error_of([&] { first = make(0); });
  t.join();
  ASSERT_TRUE(first && other) << error << " / " << other_error;
  EXPECT_NE(first->key_namespace().prefix(), other->key_namespace().prefix());
  std::thread stop([&] { other->detach_storage(); });  // an agreement of both ranks
  first->detach_storage();
  stop.join();
  EXPECT_EQ(first->storage_controller(), nullptr);
}

// Every TP rank of an MLA model reads the records rank 0 writes: HiCache opens a file store
// shared (without a "shared" key) and refuses "shared": false, naming it, before it meets the
// other ranks.
TEST(HiCache, AFileStoreOfAnMlaModelUnderTpIsShared) {
  TempDir dir, rendezvous;
  fs::create_directories(rendezvous.path);
  const auto config = [&](int rank, const std::string& shared) {
    return HiCacheConfig::from_json_text(str_cat(
        R"({"device": "host", "page_size": 4, "device_tokens": 64, "model": {"attention": "mla",
        "layers": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8}, "tp_size": 2, "tp_rank": )",
        rank, R"(, "tp_store_dir": ")", rendezvous.path.string(),
        R"(", "tp_connect_timeout_ms": 20000, "storage": {"backend": "file", "root": ")",
        dir.path.string(), R"(")", shared, "}}"));
  };
  const std::string e = error_of([&] { HiCache hc(config(0, R"(, "shared": false)")); });
  EXPECT_NE(e.find("\"shared\": false"), std::string::npos) << e;
  EXPECT_NE(e.find("MLA"), std::string::npos) << e;
  std::unique_ptr<HiCache> other;
  std::string other_error;
  std::thread t([&] {
    try {
      other = std::make_unique<HiCache>(config(1, ""));
    } catch (const std::exception& ex) {
      other_error = ex.what();
    }
  });
  std::unique_ptr<HiCache> first;
  const std::string error = error_of([&] { first = std::make_unique<HiCache>(config(0, "")); });
  t.join();
  ASSERT_TRUE(first && other) << error << " / " << other_error;
  for (HiCache* hc : {first.get(), other.get()}) {
    const auto* file = dynamic_cast<const FileStorage*>(hc->storage());
    ASSERT_NE(file, nullptr);
    EXPECT_EQ(file->config().shared, true);
  }
  std::thread stop([&] { other->detach_storage(); });
  first->detach_storage();
  stop.join();
}

TEST(HiCache, RefusesCollectivesThatDisagreeWithTheConfig) {
  auto ranks = InProcessGroup::make_ranks(2);
  auto c = HiCacheConfig::from_json_text(config_json(""));  // tp_size 1
  HiCacheParts parts;
  parts.collectives = {ranks[0].get(), ranks[0].get(), ranks[0].get()};
  const std::string e = error_of([&] { HiCache hc(c, std::move(parts)); });
  EXPECT_NE(e.find("rank 0 of 2, the config says tp_rank 0 of tp_size 1"), std::string::npos) << e;

  c.tp = {.rank = 0, .size = 2};
  HiCacheParts shared;
  shared.collectives = {ranks[0].get(), ranks[0].get(), ranks[0].get()};
  EXPECT_NE(error_of([&] { HiCache hc(c, std::move(shared)); }).find("separate groups"),
            std::string::npos);
  HiCacheParts partial;
  partial.collectives.main = ranks[0].get();
  EXPECT_NE(error_of([&] { HiCache hc(c, std::move(partial)); }).find("prefetch collective is missing"),
            std::string::npos);
}

TEST(HiCache, AStoreThatCannotBeOpenedIsAnErrorAtConstruction) {
  TempDir dir;
  std::ofstream(dir.path.string() + ".file") << "not a directory";
  const std::string root = dir.path.string() + ".file/store";
  const std::string e = error_of([&] {
    HiCache hc(HiCacheConfig::from_json_text(
        config_json(str_cat(R"("storage": {"backend": "file", "root": ")", root, R"("})"))));
  });
  fs::remove(dir.path.string() + ".file");
  EXPECT_NE(e.find(root), std::string::npos) << e;
}

TEST(HiCache, UsesTheEnginesDevice) {
  auto device = Device::create("host");
  HiCacheParts parts;
  parts.device = device.get();
  HiCache hc(HiCacheConfig::from_json_text(config_json("")), std::move(parts));
  EXPECT_EQ(&hc.device(), device.get());
  hc.stop();
  hc.stop();  // idempotent
}

TEST(HiCacheConfig, ReadsAConfigFileAndNamesItInErrors) {
  TempDir dir;
  fs::create_directories(dir.path);
  const std::string good = (dir.path / "good.json").string();
  const std::string bad = (dir.path / "bad.json").string();
  std::ofstream(good) << config_json(R"("tp_size": 4, "tp_rank": 3)");
  std::ofstream(bad) << config_json(R"("page_size": 0)");
  const auto c = HiCacheConfig::from_json_file(good);
  EXPECT_EQ(c.tp.rank, 3);
  EXPECT_EQ(c.tp.size, 4);
  EXPECT_NE(error_of([&] { (void)HiCacheConfig::from_json_file(bad); }).find(bad),
            std::string::npos);
  const std::string missing = (dir.path / "missing.json").string();
  EXPECT_NE(error_of([&] { (void)HiCacheConfig::from_json_file(missing); })
                .find("cannot read '" + missing + "'"),
            std::string::npos);
}

}  // namespace
}  // namespace hicache
