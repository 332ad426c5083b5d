// radix::L3Paths on its own: a real StorageController over a file store, a fake of
// L3Paths::Cache standing in for the coordinator (locks and refreshes over a real tree and
// eviction index). Digests chain from the parent and the identity; a backup stores a node's
// pages under its keys and its ack counts them; a second cache's prefetch brings the same bytes
// back; a prefetch below the threshold is declined before any query; detach releases what the
// paths held and forgets L3.
#include "controller/radix/l3_paths.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "controller/radix/eviction.h"
#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "storage/record.h"
#include "tests/controller/forwarding_store.h"
#include "tests/controller/radix/fake_locks.h"
#include "tests/controller/radix/test_pages.h"
#include "transfer/host_device.h"

namespace hicache::radix {
namespace {

constexpr std::int32_t kPage = kTestPage;

KVGeometry geometry() { return KVGeometry::mha(2, 1, 8, DType::kFloat16, kPage); }
KeyNamespace key_ns() {
  return {.model = "m",
          .fingerprint = "f",
          .dtype = "fp16",
          .layout = "page_first",
          .page_size = kPage};
}

// The coordinator's part: locks up the path, refresh into the index, new leaves with digests.
class FakeCache final : public L3Paths::Cache {
 public:
  FakeCache(Tree& tree, EvictionIndex& index, HostKVPool& host)
      : tree_(tree), index_(index), host_(host) {}
  void lock(Node* node) override { lock_path(node, index_); }
  void unlock(Node* node) override { unlock_path(node, index_); }
  std::int64_t evict_host(std::int64_t tokens) override {
    evict_host_asked += tokens;
    return 0;
  }
  std::int64_t host_room() const override { return host_.free_tokens(); }
  Node* split_node(Node*, std::size_t) override {
    ADD_FAILURE() << "no test here splits a node";
    return nullptr;
  }
  Node* add_node(Node* parent, std::span<const std::int32_t> key,
                 std::string_view identity) override {
    Node* n = tree_.add_leaf(parent, key, identity);
    paths->set_digests(n);
    index_.refresh(n);
    index_.refresh(parent);
    return n;
  }
  void refresh(Node* node) override { index_.refresh(node); }
  void l3_stored(const Node* node, std::int64_t from, std::int64_t to, std::uint64_t) override {
    stored.push_back({node->id, from, to});
  }
  std::uint64_t l3_removal_clock() const override { return 0; }
  void backup_acked(Node* node) override { acked.push_back(node->id); }
  // No sidecar pools here: the paths never reserve any and hand over none.
  bool reserve_prefetch_sidecars(std::span<const std::int64_t>, std::vector<SidecarPagesIo>&,
                                 std::vector<std::int64_t>&) override {
    ADD_FAILURE() << "sidecar pages reserved without sidecar pools";
    return false;
  }
  void sidecar_hosts_released(std::int32_t, std::int64_t) override {
    ADD_FAILURE() << "sidecar pages released without sidecar pools";
  }
  void adopt_sidecar_hosts(Node*, std::vector<SidecarPagesIo>& fetched, std::int64_t) override {
    EXPECT_TRUE(fetched.empty());
  }
  void free_sidecar_hosts(std::span<const SidecarPagesIo> fetched) override {
    EXPECT_TRUE(fetched.empty());
  }
  std::vector<NodeId> acked;

  L3Paths* paths = nullptr;
  std::int64_t evict_host_asked = 0;
  struct Stored {
    NodeId id;
    std::int64_t from, to;
    bool operator==(const Stored&) const = default;
  };
  std::vector<Stored> stored;

 private:
  Tree& tree_;
  EvictionIndex& index_;
  HostKVPool& host_;
};

// A file store in a temporary directory, shared by the rigs of a test (two engines, one L3).
struct Store {
  std::filesystem::path root =
      std::filesystem::temp_directory_path() /
      str_cat("hicache-l3paths-", ::getpid(), "-",
              ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::uint64_t capacity_bytes = 0;
  FileStorage file{FileStorageConfig{.root = (std::filesystem::remove_all(root), root.string()),
                                     .capacity_bytes = capacity_bytes}};
  // What the rigs use: the file store, or (asked) the same behind a wrapper that does not answer
  // from memory, so that a prefetch is queued whatever L3 holds (the storage controller asks).
  hicache::testing::Forwarding asking{file};
  bool asked = false;
  StorageBackend& backend() { return asked ? static_cast<StorageBackend&>(asking) : file; }
  Store() = default;
  explicit Store(std::uint64_t capacity) : capacity_bytes(capacity) {}
  ~Store() { std::filesystem::remove_all(root); }
};

// L3Paths with everything it works on, L3 attached.
struct Rig {
  HostDevice device;
  HostKVPool host_pool;
  LocalCollective local;
  KeyNamespace ns = key_ns();
  StorageController storage;
  Tree tree{kPage, 64};
  EvictionIndex index{EvictionPolicy::kLru, kPage};
  PendingOps pending;
  ArrivedAcks arrived;
  Agreement agreement{nullptr};
  CostRule cost{0, geometry().token_bytes()};
  CacheEvents events;
  FakeCache cache{tree, index, host_pool};
  L3Paths paths{cache, tree, pending, arrived, agreement, cost, events, host_pool};
  std::shared_ptr<EventSignal> signal = std::make_shared<EventSignal>();

  explicit Rig(Store& store, StorageControllerConfig config = {})
      : host_pool(device, geometry(), HostLayout::kPageFirst, 32 * kPage),
        storage(host_pool, store.backend(), ns, local, local, local, config) {
    cache.paths = &paths;
    paths.attach(storage, std::make_unique<PageKeyer>(ns), signal);
  }

  // A host-only leaf (pages in state backup) holding data keyed by (first, page).
  Node* host_leaf(Node* parent, std::int32_t first, int pages, std::string_view identity = {}) {
    Node* n = cache.add_node(parent, pages_from(first, pages), identity);
    auto slots = host_pool.alloc(pages * kPage);
    EXPECT_TRUE(slots.has_value());
    host_pool.protect_write(*slots);
    for (int p = 0; p < pages; ++p) {
      fill_page(host_pool.layout(), (*slots)[static_cast<std::size_t>(p * kPage)] / kPage,
                seed(first, p));
    }
    host_pool.complete_io(*slots, PageState::kBackup);
    n->host = std::move(*slots);
    index.refresh(n);
    return n;
  }
  static std::uint64_t seed(std::int32_t first, int page) {
    return static_cast<std::uint64_t>(first) * 1000 + static_cast<std::uint64_t>(page);
  }
  // Drains the storage controller's acks until `done()` or 60 s passed, sleeping between.
  template <typename Done>
  bool wait(Done&& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (true) {
      const std::uint64_t seen = signal->seq();
      paths.drain_acks();
      if (done()) return true;
      if (!signal->wait(seen, deadline)) return false;
    }
  }
  // Applies the backup acks that arrived, as check_events does on one rank.
  void apply_backups() {
    for (const auto& [id, v] : arrived.backups) paths.apply_backup_ack(id, v, v);
    arrived.backups.clear();
  }
};

TEST(L3Paths, DigestsChainFromTheParentAndFromTheIdentity) {
  Store store;
  Rig rig(store);
  Node* a = rig.host_leaf(rig.tree.root(), 1, 2);
  Node* b = rig.host_leaf(a, 2, 1);
  Node* lora = rig.host_leaf(rig.tree.root(), 1, 2, "lora");
  // The chain over the whole sequence, as any engine sharing the store computes it.
  PageKeyer keyer(key_ns());
  std::vector<std::int32_t> seq = pages_from(1, 2);
  const std::vector<std::int32_t> tail = pages_from(2, 1);
  seq.insert(seq.end(), tail.begin(), tail.end());
  std::vector<std::string> keys;
  std::vector<PageDigest> chain;
  keyer.keys(seq, nullptr, keys, &chain);
  ASSERT_EQ(a->digests.size(), 2u);
  ASSERT_EQ(b->digests.size(), 1u);
  EXPECT_EQ(a->digests[0], chain[0]);
  EXPECT_EQ(a->digests[1], chain[1]);
  EXPECT_EQ(b->digests[0], chain[2]);  // continues its parent's last digest
  // Same tokens under another identity: another chain, from the identity's seed.
  std::vector<PageDigest> lora_chain;
  const PageDigest lora_seed = keyer.identity_seed("lora");
  keyer.keys(pages_from(1, 2), &lora_seed, keys, &lora_chain);
  ASSERT_EQ(lora->digests.size(), 2u);
  EXPECT_EQ(lora->digests, lora_chain);
  EXPECT_NE(lora->digests[0], a->digests[0]);
}

TEST(L3Paths, WithoutL3ANodeGetsDigestsOnlyWhenAskedToKeepThem) {
  HostDevice device;
  HostKVPool host_pool(device, geometry(), HostLayout::kPageFirst, 8 * kPage);
  Tree tree(kPage, 64);
  EvictionIndex index(EvictionPolicy::kLru, kPage);
  PendingOps pending;
  ArrivedAcks arrived;
  Agreement agreement(nullptr);
  CostRule cost(0, geometry().token_bytes());
  CacheEvents events;
  FakeCache cache(tree, index, host_pool);
  L3Paths paths(cache, tree, pending, arrived, agreement, cost, events, host_pool);
  cache.paths = &paths;
  Node* n = cache.add_node(tree.root(), pages_from(1, 2), "");
  EXPECT_TRUE(n->digests.empty());
  EXPECT_FALSE(paths.attached());
  paths.backup_node(n);  // no L3: nothing
  EXPECT_EQ(n->backup_op, 0);
  EXPECT_FALSE(paths.prefetch("r", tree.root(), pages_from(1, 2), ""));
  paths.keep_digests(kPage);
  EXPECT_EQ(n->digests.size(), 2u);  // set on the nodes that lacked them
}

TEST(L3Paths, ABackupStoresTheNodesPagesAndASecondCachePrefetchesTheSameBytes) {
  Store store;
  Rig rig(store);
  Node* n = rig.host_leaf(rig.tree.root(), 1, 3);
  rig.paths.backup_node(n);
  ASSERT_NE(n->backup_op, 0);
  // Not locked (its device copy may go), but its host copy stays out of host eviction until the
  // ack.
  EXPECT_EQ(n->lock, 0);
  EXPECT_EQ(rig.index.next_victim(Tier::kHost), nullptr);
  ASSERT_TRUE(rig.wait([&] { return !rig.arrived.backups.empty(); }));
  rig.apply_backups();
  EXPECT_EQ(n->backup_op, 0);
  EXPECT_EQ(rig.index.next_victim(Tier::kHost), n);  // a host-only leaf again
  EXPECT_EQ(n->lock, 0);
  EXPECT_EQ(n->stored_pages, 3);
  EXPECT_EQ(rig.cache.stored, (std::vector<FakeCache::Stored>{{n->id, 0, 3}}));
  EXPECT_EQ(rig.cache.acked, std::vector<NodeId>{n->id}) << "handed to the tier policy";
  std::vector<std::string> keys;
  PageKeyer(key_ns()).keys(pages_from(1, 3), nullptr, keys);
  EXPECT_EQ(store.file.batch_exists(keys), 3u);  // under the keys any engine computes
  rig.paths.backup_node(n);                      // in L3 already: nothing
  EXPECT_EQ(n->backup_op, 0);

  // Another engine over the same store, with an empty tree: its prefetch inserts the pages.
  Rig other(store);
  const auto want = pages_from(1, 3);
  ASSERT_TRUE(other.paths.prefetch("r", other.tree.root(), want, ""));
  EXPECT_EQ(other.paths.reserved_tokens(), 12);
  ASSERT_TRUE(other.wait(
      [&] { return other.pending.prefetches.at("r").op->stage() == PrefetchStage::kFinished; }));
  other.paths.finish_arrived_prefetches();
  std::int64_t inserted = -1;
  EXPECT_TRUE(other.paths.check_progress("r", &inserted));
  EXPECT_EQ(inserted, 12);
  EXPECT_EQ(other.paths.reserved_tokens(), 0);
  Node* got = other.tree.child_of(other.tree.root(), std::span(want).first(kPage), "");
  ASSERT_NE(got, nullptr);
  ASSERT_EQ(got->host.size(), 12u);
  EXPECT_EQ(got->stored_pages, 3);  // came from L3
  EXPECT_EQ(got->digests, n->digests);
  for (int p = 0; p < 3; ++p) {
    EXPECT_TRUE(verify_page(other.host_pool.layout(),
                            got->host[static_cast<std::size_t>(p * kPage)] / kPage,
                            Rig::seed(1, p)))
        << "page " << p;
  }
  EXPECT_EQ(other.tree.root()->lock, 1);  // the prefetch's lock went with it
}

TEST(L3Paths, APrefetchBelowTheThresholdIsDeclinedBeforeAnyQuery) {
  Store store;
  store.asked = true;  // the span at the threshold is queued, though L3 holds none of it
  Rig rig(store, {.prefetch_threshold_tokens = 3 * kPage});
  const std::int64_t free_before = rig.host_pool.free_tokens();
  EXPECT_FALSE(rig.paths.prefetch("short", rig.tree.root(), pages_from(1, 2), ""));
  EXPECT_EQ(rig.events.prefetch_attempts.value(), 1u);
  EXPECT_EQ(rig.events.prefetches_too_short.value(), 1u);
  EXPECT_EQ(rig.events.prefetches_issued.value(), 0u);
  EXPECT_EQ(store.file.stats().exists_queries, 0u);  // never asked the store
  EXPECT_TRUE(rig.pending.prefetches.empty());
  EXPECT_EQ(rig.tree.root()->lock, 1);
  EXPECT_EQ(rig.paths.reserved_tokens(), 0);
  EXPECT_EQ(rig.host_pool.free_tokens(), free_before);
  // At the threshold: issued, the prefix locked and the host pages reserved until it ends.
  EXPECT_TRUE(rig.paths.prefetch("long", rig.tree.root(), pages_from(1, 3), ""));
  EXPECT_EQ(rig.events.prefetches_issued.value(), 1u);
  EXPECT_EQ(rig.tree.root()->lock, 2);
  EXPECT_EQ(rig.paths.reserved_tokens(), 12);
  EXPECT_EQ(rig.host_pool.free_tokens(), free_before - 12);
  EXPECT_FALSE(rig.paths.prefetch("long", rig.tree.root(), pages_from(1, 3), ""));  // id in use
  rig.paths.release_aborted("long");
  EXPECT_TRUE(rig.pending.prefetches.empty());
  EXPECT_EQ(rig.tree.root()->lock, 1);
  EXPECT_EQ(rig.paths.reserved_tokens(), 0);
  EXPECT_EQ(rig.host_pool.free_tokens(), free_before);
}

TEST(L3Paths, DetachReleasesWhatItHeldAndForgetsL3) {
  Store store;
  store.asked = true;  // the prefetch of pages L3 never held is queued
  Rig rig(store);
  Node* stored = rig.host_leaf(rig.tree.root(), 1, 2);
  rig.paths.backup_node(stored);
  ASSERT_TRUE(rig.wait([&] { return !rig.arrived.backups.empty(); }));
  rig.apply_backups();
  ASSERT_EQ(stored->stored_pages, 2);
  Node* backing_up = rig.host_leaf(rig.tree.root(), 2, 2);
  rig.paths.backup_node(backing_up);  // may be done or not when detach stops the threads
  ASSERT_NE(backing_up->backup_op, 0);
  ASSERT_TRUE(rig.paths.prefetch("r", rig.tree.root(), pages_from(7, 2), ""));
  const std::int64_t free_tokens = rig.host_pool.free_tokens();
  rig.paths.detach();
  EXPECT_FALSE(rig.paths.attached());
  EXPECT_EQ(rig.paths.storage(), nullptr);
  EXPECT_EQ(stored->stored_pages, 0);  // L3 is gone: nothing is known to be there
  EXPECT_EQ(backing_up->backup_op, 0);
  EXPECT_EQ(backing_up->stored_pages, 0);
  EXPECT_EQ(backing_up->lock, 0);
  EXPECT_TRUE(rig.pending.backups.empty());
  EXPECT_TRUE(rig.pending.prefetches.empty());
  EXPECT_EQ(rig.paths.reserved_tokens(), 0);
  EXPECT_EQ(rig.tree.root()->lock, 1);
  EXPECT_EQ(rig.host_pool.free_tokens(), free_tokens + 8);  // nothing of pages 7.. was in L3
  EXPECT_EQ(rig.index.check(rig.tree), "");
  rig.paths.backup_node(stored);  // detached: nothing
  EXPECT_EQ(stored->backup_op, 0);
}

}  // namespace
}  // namespace hicache::radix

namespace hicache::radix {
namespace {

// touch_path: a backup's ack touches the path from the root, so the parent's pages (the chain's
// head) end younger than the child's new page, and a full store evicts another chain's tail,
// not the head it would strand the child behind (plain write order would evict the parent's
// first page first).
TEST(L3Paths, AnAckTouchesThePathSoAFullStoreKeepsTheChainsHead) {
  std::vector<std::string> one;
  PageKeyer(key_ns()).keys(pages_from(1, 1), nullptr, one);
  const std::uint64_t record =
      record_head_bytes(one[0]) + static_cast<std::uint64_t>(geometry().token_bytes()) * kPage;
  Store store(4 * record + record / 2);  // room for four records, not five
  Rig rig(store);
  auto backup = [&](Node* n) {
    rig.paths.backup_node(n);
    ASSERT_NE(n->backup_op, 0);
    ASSERT_TRUE(rig.wait([&] { return !rig.arrived.backups.empty(); }));
    rig.apply_backups();
    ASSERT_EQ(n->backup_op, 0);
  };
  auto keys_of = [](Node* n) {
    std::vector<std::string> keys;
    for (const PageDigest& d : n->digests) keys.push_back(PageKeyer(key_ns()).key(d));
    return keys;
  };
  Node* p = rig.host_leaf(rig.tree.root(), 1, 2);
  backup(p);
  Node* q = rig.host_leaf(rig.tree.root(), 100, 1);
  backup(q);
  Node* c = rig.host_leaf(p, 1 + 2 * kPage, 1);
  backup(c);
  // The touch thread runs the ack's touch after the write: wait until the store holds p's head
  // younger than c (a fifth record then evicts q, the oldest).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (rig.storage.touched_keys() < 2 + 1 + 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_EQ(rig.storage.touched_keys(), 2 + 1 + 3);
  Node* r = rig.host_leaf(rig.tree.root(), 200, 1);
  backup(r);
  EXPECT_EQ(store.file.batch_exists(keys_of(p)), 2u);
  EXPECT_EQ(store.file.batch_exists(keys_of(c)), 1u);
  EXPECT_EQ(store.file.batch_exists(keys_of(q)), 0u) << "the other chain's record goes";
  EXPECT_EQ(store.file.stats().evictions, 1u);
}

}  // namespace
}  // namespace hicache::radix
